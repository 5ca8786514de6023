"""`ast.run`: a whole job in one call, its outputs, records and sources that fail, and the
refusal inside a running loop."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from operator_helpers import (
    run_script,
)
from shared_functions import (
    OPERATOR_BACKENDS,
    Boom,
    Counter,
    cfg,
    first,
    ident,
    new_backend,
    with_tag,
)

import asyncstate as ast


@pytest.mark.timeout(30)
def test_run_raises_the_key_selector_exception() -> None:
    err = Boom("sel")

    def selector(record: Any) -> Any:
        if record == 3:
            raise err
        return record

    with pytest.raises(Boom) as info:
        ast.run(Counter(output=with_tag), [1, 2, 3, 4], key_selector=selector)
    assert info.value is err


@pytest.mark.timeout(30)
def test_run_raises_the_original_user_failure() -> None:
    err = Boom("x")

    class Fails(ast.KeyedProcessFunction):
        def open(self, ctx: Any) -> None:
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        async def process_element(self, value: Any, ctx: Any) -> None:
            await self.v.update(value)
            if value == 7:
                raise err

    for backend in (ast.HeapBackend(), new_backend("remote1")):
        with pytest.raises(Boom) as info:
            ast.run(Fails(), range(20), key_selector=lambda r: r % 3, backend=backend,
                    config=cfg(max_in_flight=4))
        assert info.value is err


@pytest.mark.timeout(30)
def test_run_empty_iterable_opens_and_closes_once():
    fn = Counter()
    assert ast.run(fn, [], key_selector=ident) == []
    assert ast.run(fn, iter(()), key_selector=ident) == []
    assert fn.calls == ["open", "close"] * 2


@pytest.mark.timeout(30)
def test_run_single_record_and_config_none_equals_default(make_backend):
    assert ast.run(Counter(), ["x"], key_selector=ident, backend=make_backend(),
                   config=None) == [("x", 1)]
    records = [i % 4 for i in range(20)]
    a = ast.run(Counter(), records, key_selector=ident, backend=make_backend(), config=None)
    b = ast.run(Counter(), records, key_selector=ident, backend=make_backend(),
                config=ast.AsyncStateConfig())
    assert sorted(a) == sorted(b)


@pytest.mark.timeout(30)
def test_run_generator_raising_midway_propagates_and_closes_backend(make_backend):
    consumed: list[int] = []

    def records():
        for i in range(3):
            consumed.append(i)
            yield i
        raise OSError("source broke")

    fn = Counter()
    with pytest.raises(OSError, match="source broke"):
        ast.run(fn, records(), key_selector=ident, backend=make_backend())
    assert consumed == [0, 1, 2]
    assert fn.calls == ["open", "close"]


@pytest.mark.timeout(30)
def test_run_generator_raising_midway_releases_rocksdb(tmp_path):
    path = str(tmp_path / "db")

    def records():
        yield 1
        raise OSError("source broke")

    with pytest.raises(OSError, match="source broke"):
        ast.run(Counter(), records(), key_selector=ident, backend=ast.RocksDBBackend(path))
    ast.run(Counter(), [1], key_selector=ident, backend=ast.RocksDBBackend(path))


@pytest.mark.timeout(30)
def test_run_stops_pulling_an_infinite_source_after_a_failure():
    pulled = [0]

    def forever():
        while True:
            pulled[0] += 1
            yield pulled[0]

    class Fails(Counter):
        async def process_element(self, value, ctx):
            await self.count.value()
            if value == 5:
                raise Boom(value)

    with pytest.raises(Boom):
        ast.run(Fails(), forever(), key_selector=lambda r: r % 3, backend=new_backend("remote1"),
                config=ast.AsyncStateConfig(max_in_flight=4))
    assert pulled[0] < 1000


@pytest.mark.timeout(30)
def test_run_accepts_none_and_unhashable_records():
    class Echo(ast.KeyedProcessFunction):
        def process_element(self, value, ctx):
            ctx.emit(value)

    recs = [None, [1, 2], {"a": [1]}, {1, 2}]
    assert ast.run(Echo(), recs, key_selector=lambda r: 0) == recs


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad_key", [{"a": 1}, object(), 2**64, -(2**63) - 1, {1}, 1j])
def test_run_bad_key_raises_serialization_error_and_closes(bad_key):
    fn = Counter()
    with pytest.raises(ast.SerializationError):
        ast.run(fn, [1], key_selector=lambda r: bad_key)
    assert fn.calls == ["open", "close"]


@pytest.mark.timeout(30)
async def test_run_from_running_loop_raises_without_touching_function_or_backend():
    fn = Counter()
    backend = ast.HeapBackend()
    with pytest.raises(ast.InvalidStateError, match="running event loop"):
        ast.run(fn, [1], key_selector=ident, backend=backend)
    assert fn.calls == []
    # The backend was not opened: it can still serve an operator.
    async with ast.KeyedOperator(fn, key_selector=ident, backend=backend) as op:
        await op.process(1)
    assert op.outputs() == [(1, 1)]


class Emitting(ast.KeyedProcessFunction):
    """Counts per key and records every emission in `log` at the moment it is emitted."""

    def __init__(self):
        self.log = []

    def open(self, ctx):
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    async def process_element(self, value, ctx):
        n = (await self.count.value() or 0) + 1
        await self.count.update(n)
        for out in ((value[0], n, "first"), (value[0], n, "second")):
            self.log.append(out)
            ctx.emit(out)


@pytest.mark.parametrize("kind", [None, *OPERATOR_BACKENDS])
def test_run_returns_outputs_in_emission_order(kind):
    fn = Emitting()
    records = [(k, i) for i, k in enumerate("abcabcaab" * 5)]
    out = ast.run(fn, records, key_selector=first,
                  backend=None if kind is None else new_backend(kind),
                  config=ast.AsyncStateConfig(batch_size=4))
    assert out == fn.log
    assert len(out) == 2 * len(records)
    for key in "abc":
        assert [n for k, n, _ in out if k == key] == [
            n for n in range(1, ("abcabcaab" * 5).count(key) + 1) for _ in (0, 1)]


def test_run_default_backend_is_fresh_per_call():
    records = [("a", 1), ("a", 2)]
    assert ast.run(Counter(), records, key_selector=first) == [("a", 1), ("a", 2)]
    assert ast.run(Counter(), records, key_selector=first) == [("a", 1), ("a", 2)]


def test_run_passes_timestamps():
    class Fn(ast.KeyedProcessFunction):
        def process_element(self, value, ctx):
            ctx.emit((value, ctx.timestamp))

    out = ast.run(Fn(), [1, 2, 3], key_selector=lambda r: r,
                  timestamp_selector=lambda r: None if r == 2 else r * 100)
    assert out == [(1, 100), (2, None), (3, 300)]


async def test_run_inside_a_running_loop_raises_a_clear_error():
    loop = asyncio.get_running_loop()
    with pytest.raises(ast.InvalidStateError,
                       match=r"^ast\.run\(\) cannot be called from a running event loop; "
                             r"inside async code use `async with ast\.KeyedOperator"):
        ast.run(Counter(), [("a", 1)], key_selector=first)
    assert asyncio.get_running_loop() is loop
    await asyncio.sleep(0)  # the loop is still usable


def test_run_failure_while_a_record_awaits_state_in_a_task_does_not_hang():
    """A failure ends ast.run, without hanging, even while another record's Task awaits a
    batch."""
    out = run_script("""
    import asyncio
    import asyncstate as ast

    class Fn(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        async def process_element(self, value, ctx):
            global awaiting
            if value == "bad":
                await awaiting.wait()
                raise ValueError("boom")
            awaiting = asyncio.Event()
            await asyncio.sleep(0)
            awaiting.set()
            await self.v.value()  # pending (200 ms batch) when "bad" fails the run

    try:
        ast.run(Fn(), ["a", "bad"], key_selector=lambda r: r,
                backend=ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=200))
    except ValueError as exc:
        print(repr(exc))
    """)
    assert out.split() == ["ValueError('boom')"]


ORPHAN = r"^state 'v' accessed for the record with key 'a' after that record finished"


def test_run_waits_for_a_task_a_record_left_running_and_fails_on_its_state_call():
    class Fn(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        async def process_element(self, record, ctx):
            await self.v.update(1)

            async def later():
                await asyncio.sleep(0)
                await self.v.update(2)  # the record is over: this must not be lost silently

            asyncio.get_running_loop().create_task(later())

    with pytest.raises(ast.InvalidStateError, match=ORPHAN):
        ast.run(Fn(), [("a", None)], key_selector=first)


def test_run_fails_with_the_exception_of_a_task_a_record_left_running():
    class Fn(ast.KeyedProcessFunction):
        async def process_element(self, record, ctx):
            async def later():
                await asyncio.sleep(0)
                raise Boom("late")

            asyncio.get_running_loop().create_task(later())

    with pytest.raises(Boom, match=r"^late$"):
        ast.run(Fn(), [("a", None)], key_selector=first)
