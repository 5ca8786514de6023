"""The cyclic GC's first threshold while operators run (runtime/gc_threshold.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

import asyncstate as ast
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


@pytest.mark.parametrize("bad", [0, -5, True, 1.5, "50000"])
def test_gc_threshold_must_be_a_positive_int_or_none(bad: object) -> None:
    with pytest.raises(ast.ConfigError, match="gc_threshold"):
        ast.AsyncStateConfig(gc_threshold=bad)  # type: ignore[arg-type]
