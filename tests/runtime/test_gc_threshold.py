"""The cyclic GC's first threshold while operators run (runtime/gc_threshold.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from shared_functions import Boom, Counter, ident, new_backend

import asyncstate as ast
from asyncstate.config import GC_THRESHOLD_PER_RECORD, MAX_GC_THRESHOLD, MIN_AUTO_GC_THRESHOLD
from asyncstate.runtime import gc_threshold


@pytest.fixture(autouse=True)
def known_thresholds() -> Iterator[tuple[int, int, int]]:
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield (700, 10, 10)
    gc.set_threshold(*before)


def test_hold_raises_only_the_first_threshold_and_release_restores_all() -> None:
    gc_threshold.hold(50_000)
    assert gc.get_threshold() == (50_000, 10, 10)
    gc_threshold.release(50_000)
    assert gc.get_threshold() == (700, 10, 10)


def test_overlapping_holds_use_the_largest_and_the_last_release_restores() -> None:
    gc_threshold.hold(20_000)
    gc_threshold.hold(90_000)
    assert gc.get_threshold()[0] == 90_000
    gc_threshold.release(90_000)
    assert gc.get_threshold()[0] == 20_000
    gc_threshold.release(20_000)
    assert gc.get_threshold() == (700, 10, 10)


def test_a_request_below_the_current_threshold_never_lowers_it() -> None:
    gc.set_threshold(100_000, 5, 5)
    gc_threshold.hold(1_000)
    assert gc.get_threshold() == (100_000, 5, 5)
    gc_threshold.release(1_000)
    assert gc.get_threshold() == (100_000, 5, 5)


class Nothing(ast.KeyedProcessFunction):
    def process_element(self, value: object, ctx: ast.RecordContext) -> None:
        return None


async def test_an_operator_holds_its_threshold_while_open_and_restores_on_close() -> None:
    op = ast.KeyedOperator(Nothing(), key_selector=lambda r: r, backend=ast.HeapBackend(),
                           config=ast.AsyncStateConfig(gc_threshold=30_000))
    assert gc.get_threshold()[0] == 700
    async with op:
        assert gc.get_threshold() == (30_000, 10, 10)
        await op.process(1)
    assert gc.get_threshold() == (700, 10, 10)


async def test_an_operator_that_fails_to_open_restores_the_threshold() -> None:
    class Broken(Nothing):
        def open(self, ctx: ast.RuntimeContext) -> None:
            raise RuntimeError("no")

    op = ast.KeyedOperator(Broken(), key_selector=lambda r: r, backend=ast.HeapBackend())
    with pytest.raises(RuntimeError, match="no"):
        async with op:
            pass
    assert gc.get_threshold() == (700, 10, 10)


async def test_gc_threshold_none_leaves_the_collector_alone() -> None:
    op = ast.KeyedOperator(Nothing(), key_selector=lambda r: r, backend=ast.HeapBackend(),
                           config=ast.AsyncStateConfig(gc_threshold=None))
    async with op:
        assert gc.get_threshold() == (700, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)


def test_run_restores_the_threshold_after_the_job() -> None:
    assert ast.run(Nothing(), [1, 2, 3], key_selector=lambda r: r) == []
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize("bad", [0, -5, True, 1.5, "50000", "AUTO", "", 2**31, 10**30])
def test_gc_threshold_must_be_a_c_int_above_0_auto_or_none(bad: object) -> None:
    with pytest.raises(ast.ConfigError, match=r'^gc_threshold must be an int in '
                                              r'\[1, 2147483647\], "auto" or None, got '):
        ast.AsyncStateConfig(gc_threshold=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("max_in_flight", "expected"), [
    (6000, 6000 * GC_THRESHOLD_PER_RECORD),
    (100_000, 100_000 * GC_THRESHOLD_PER_RECORD),
    (1, MIN_AUTO_GC_THRESHOLD),
    (MIN_AUTO_GC_THRESHOLD // GC_THRESHOLD_PER_RECORD, MIN_AUTO_GC_THRESHOLD),
    (MAX_GC_THRESHOLD // GC_THRESHOLD_PER_RECORD, MAX_GC_THRESHOLD // GC_THRESHOLD_PER_RECORD
     * GC_THRESHOLD_PER_RECORD),
    (MAX_GC_THRESHOLD // GC_THRESHOLD_PER_RECORD + 1, MAX_GC_THRESHOLD),  # capped
    (10**30, MAX_GC_THRESHOLD),
])
def test_auto_scales_with_max_in_flight_above_a_floor(max_in_flight: int, expected: int) -> None:
    config = ast.AsyncStateConfig(max_in_flight=max_in_flight)
    assert config.gc_threshold == "auto"
    assert config.resolved_gc_threshold() == expected


def test_a_hold_the_collector_refuses_is_withdrawn() -> None:
    """A threshold gc.set_threshold refuses raises from hold() and leaves nothing behind:
    the next hold and release work as if it never happened."""
    with pytest.raises(OverflowError):
        gc_threshold.hold(2**40)
    assert gc.get_threshold() == (700, 10, 10)
    gc_threshold.hold(40_000)
    assert gc.get_threshold() == (40_000, 10, 10)
    gc_threshold.release(40_000)
    assert gc.get_threshold() == (700, 10, 10)


async def test_an_operator_with_the_largest_max_in_flight_opens_and_restores() -> None:
    op = ast.KeyedOperator(Nothing(), key_selector=lambda r: r, backend=ast.HeapBackend(),
                           config=ast.AsyncStateConfig(max_in_flight=10**30))
    async with op:
        assert gc.get_threshold() == (MAX_GC_THRESHOLD, 10, 10)
        await op.process(1)
    assert gc.get_threshold() == (700, 10, 10)


def test_an_int_or_none_resolves_to_itself() -> None:
    assert ast.AsyncStateConfig(gc_threshold=1234).resolved_gc_threshold() == 1234
    assert ast.AsyncStateConfig(gc_threshold=None).resolved_gc_threshold() is None


async def test_an_operator_holds_the_auto_threshold_of_its_max_in_flight() -> None:
    op = ast.KeyedOperator(Nothing(), key_selector=lambda r: r, backend=ast.HeapBackend(),
                           config=ast.AsyncStateConfig(max_in_flight=2000))
    async with op:
        assert gc.get_threshold() == (max(MIN_AUTO_GC_THRESHOLD, 2000 * GC_THRESHOLD_PER_RECORD),
                                      10, 10)
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.timeout(30)
def test_open_raising_restores_gc_threshold():
    before = gc.get_threshold()

    class OpenRaises(Counter):
        def open(self, ctx):
            raise Boom("x")

    with pytest.raises(Boom):
        ast.run(OpenRaises(), [1], key_selector=ident,
                config=ast.AsyncStateConfig(gc_threshold=123_456))
    assert gc.get_threshold() == before


@pytest.mark.timeout(30)
def test_failed_run_restores_gc_threshold():
    before = gc.get_threshold()

    class Fails(Counter):
        async def process_element(self, value, ctx):
            await self.count.value()
            raise Boom(value)

    with pytest.raises(Boom):
        ast.run(Fails(), [1, 2, 3], key_selector=ident, backend=new_backend("remote0"),
                config=ast.AsyncStateConfig(gc_threshold=123_456))
    assert gc.get_threshold() == before
