"""KeyedOperator.snapshot and restore_from: what a snapshot holds (records admitted before
it, state not declared in the run), checkpoint ids, and the restores that are refused."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import Counter as Multiset
from collections.abc import Callable
from typing import Any

import pytest
from shared_functions import (
    Ledger,
    new_backend,
    second,
)

import asyncstate as ast
from asyncstate.checkpoint.snapshot import write_snapshot

MAX_P = 16
BackendFactory = Callable[[str], Any]  # tag -> a fresh backend


def _backend_factory(kind: str, tmp: Any) -> BackendFactory:
    return lambda tag: new_backend(kind, tmp)


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
async def test_snapshot_same_id_replaces_other_id_is_independent(tmp_path: Any,
                                                                 kind: str) -> None:
    make = _backend_factory(kind, tmp_path)
    fn = Ledger()
    async with ast.KeyedOperator(fn, key_selector=second, backend=make("w")) as op:
        assert fn.split is not None
        await op.process(("w", "a", 1, "x"))
        await fn.split.add("first")
        p1 = await op.snapshot(str(tmp_path / "chk"), 7)
        await op.process(("w", "a", 2, "x"))
        await op.process(("w", "b", 5, "y"))
        await fn.split.update(["second"])
        p1_again = await op.snapshot(tmp_path / "chk", 7)  # a PathLike works too
        await op.process(("w", "c", 9, "z"))
        await fn.split.clear()
        p2 = await op.snapshot(str(tmp_path / "chk"), 8)
    assert p1 == p1_again == ast.checkpoint_path(str(tmp_path / "chk"), 7)
    assert p2 == ast.checkpoint_path(str(tmp_path / "chk"), 8)
    assert os.listdir(p1) == ["part-1-0"]
    assert len([f for f in os.listdir(os.path.join(p1, "part-1-0"))
                if f.startswith("data-")]) == 1

    async def read(path: str, tag: str) -> tuple[list[Any], list[Any]]:
        fn = Ledger()
        async with ast.KeyedOperator(fn, key_selector=second, backend=make(tag),
                                     restore_from=path) as op:
            assert fn.split is not None
            split = await (await fn.split.get()).to_list()
            for key in "abc":
                await op.process(("r", key))
            await op.drain()
            return split, op.outputs()

    assert await read(p1, "r1") == (["second"], [
        ("a", 3, [1, 2], {"x": 2}), ("b", 5, [5], {"y": 1}), ("c", None, [], {})])
    assert await read(p2, "r2") == ([], [
        ("a", 3, [1, 2], {"x": 2}), ("b", 5, [5], {"y": 1}), ("c", 9, [9], {"z": 1})])


class Slow(ast.KeyedProcessFunction):
    """Writes two value states with a sleep in between: a half-done record in a checkpoint
    shows as a != b."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.a = ctx.get_state(ast.ValueStateDescriptor("a"))
        self.b = ctx.get_state(ast.ValueStateDescriptor("b"))
        self.n = ctx.get_list_state(ast.ListStateDescriptor("n"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        key, v = value
        if v is None:
            ctx.emit((key, await self.a.value(), await self.b.value(),
                      await (await self.n.get()).to_list()))
            return
        await self.a.update(v)
        await asyncio.sleep(0.002)
        await self.n.add(v)
        await asyncio.sleep(0)
        await self.b.update(v)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
async def test_snapshot_drains_records_in_flight(tmp_path: Any, kind: str) -> None:
    make = _backend_factory(kind, tmp_path)
    config = ast.AsyncStateConfig(batch_size=4, max_in_flight=30, buffer_timeout_ms=10_000)
    records = [(f"k{i % 7}", i) for i in range(60)]
    async with ast.KeyedOperator(Slow(), key_selector=lambda r: r[0], backend=make("w"),
                                 config=config) as op:
        for r in records:
            await op.process(r)
        assert op.metrics["in_flight"] > 0
        path = await op.snapshot(str(tmp_path), 1)
        assert op.metrics["in_flight"] == 0
        assert op.metrics["records_done"] == len(records)
    async with ast.KeyedOperator(Slow(), key_selector=lambda r: r[0], backend=make("r"),
                                 config=config, restore_from=path) as op:
        for k in range(7):
            await op.process((f"k{k}", None))
        await op.drain()
        got = sorted(op.outputs())
    expected = sorted((f"k{k}", last, last, vals) for k in range(7)
                      for vals in [[i for i in range(60) if i % 7 == k]] for last in [vals[-1]])
    assert got == expected


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
async def test_keyed_state_not_declared_in_a_run_survives_the_next_checkpoint(
        tmp_path: Any, kind: str) -> None:
    class Nothing(ast.KeyedProcessFunction):
        def open(self, ctx: ast.RuntimeContext) -> None:
            pass

        async def process_element(self, value: Any, ctx: Any) -> None:
            pass

    make = _backend_factory(kind, tmp_path)
    async with ast.KeyedOperator(Ledger(), key_selector=second, backend=make("1")) as op:
        await op.process(("w", "a", 4, "x"))
        p1 = await op.snapshot(str(tmp_path), 1)
    async with ast.KeyedOperator(Nothing(), key_selector=second, backend=make("2"),
                                 restore_from=p1) as op:
        p2 = await op.snapshot(str(tmp_path), 2)
    async with ast.KeyedOperator(Ledger(), key_selector=second, backend=make("3"),
                                 restore_from=p2) as op:
        await op.process(("r", "a"))
        await op.drain()
        assert op.outputs() == [("a", 4, [4], {"x": 1})]


async def test_restore_from_missing_path_file_or_empty_directory(tmp_path: Any) -> None:
    (tmp_path / "a-file").write_bytes(b"not a checkpoint")
    (tmp_path / "empty").mkdir()
    for bad in [tmp_path / "missing", tmp_path / "a-file", tmp_path / "empty"]:
        backend = ast.HeapBackend()
        with pytest.raises(ast.CheckpointError, match="checkpoint") as info:
            async with ast.KeyedOperator(Ledger(), key_selector=second, backend=backend,
                                         restore_from=bad):
                pass  # pragma: no cover
        assert info.value.path is not None
        assert str(bad) in str(info.value)


async def test_restore_with_another_max_parallelism_is_a_checkpoint_error(
        tmp_path: Any) -> None:
    config = ast.AsyncStateConfig(max_parallelism=8)
    async with ast.KeyedOperator(Ledger(), key_selector=second, backend=ast.HeapBackend(),
                                 config=config) as op:
        await op.process(("w", "a", 1, "x"))
        path = await op.snapshot(str(tmp_path), 1)
    with pytest.raises(ast.CheckpointError, match="max_parallelism"):
        async with ast.KeyedOperator(Ledger(), key_selector=second, backend=ast.HeapBackend(),
                                     config=ast.AsyncStateConfig(max_parallelism=16),
                                     restore_from=path):
            pass  # pragma: no cover


async def test_an_id_written_again_at_another_parallelism_restores_the_later_run(
        tmp_path: Any) -> None:
    # Parts written by operators one after the other, as separate jobs would: nothing
    # removes the first run's part, and the reader leaves it out.
    for p, amount in ((1, 5), (2, 7)):
        for index in range(p):
            async with ast.KeyedOperator(Ledger(), key_selector=second, backend=ast.HeapBackend(),
                                         parallelism=p, operator_index=index) as op:
                if op.key_group_range.contains(ast.assign_to_key_group("k", 128)):
                    await op.process(("w", "k", amount, "x"))
                path = await op.snapshot(str(tmp_path), 1)
    assert sorted(os.listdir(path)) == ["part-1-0", "part-2-0", "part-2-1"]
    async with ast.KeyedOperator(Ledger(), key_selector=second, backend=ast.HeapBackend(),
                                 restore_from=path) as op:
        await op.process(("r", "k"))
        await op.drain()
        assert op.outputs() == [("k", 7, [7], {"x": 1})]


async def test_restore_into_a_used_rocksdb_directory_yields_exactly_the_checkpoint(
        tmp_path: Any) -> None:
    config = ast.AsyncStateConfig(max_parallelism=1)  # one key group: all keys share it
    async with ast.KeyedOperator(Ledger(), key_selector=second, backend=ast.HeapBackend(),
                                 config=config) as op:
        await op.process(("w", "k", 1, "x"))
        path = await op.snapshot(str(tmp_path), 1)
    db = str(tmp_path / "db")
    async with ast.KeyedOperator(Ledger(), key_selector=second, backend=ast.RocksDBBackend(db),
                                 config=config) as op:
        await op.process(("w", "old", 100, "x"))
    async with ast.KeyedOperator(Ledger(), key_selector=second, backend=ast.RocksDBBackend(db),
                                 config=config, restore_from=path) as op:
        await op.process(("r", "k"))
        await op.process(("r", "old"))
        await op.drain()
        assert op.outputs() == [("k", 1, [1], {"x": 1}), ("old", None, [], {})]


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
async def test_restore_with_another_state_kind_is_a_checkpoint_error(tmp_path: Any,
                                                                     kind: str) -> None:
    class AsValue(ast.KeyedProcessFunction):
        def open(self, ctx: ast.RuntimeContext) -> None:
            self.s = ctx.get_state(ast.ValueStateDescriptor("s"))

        async def process_element(self, value: Any, ctx: Any) -> None:
            await self.s.update(value)

    class AsMap(ast.KeyedProcessFunction):
        def open(self, ctx: ast.RuntimeContext) -> None:
            self.s = ctx.get_map_state(ast.MapStateDescriptor("s"))

        async def process_element(self, value: Any, ctx: Any) -> None:
            pass  # pragma: no cover

    make = _backend_factory(kind, tmp_path)
    async with ast.KeyedOperator(AsValue(), key_selector=lambda r: r, backend=make("1")) as op:
        await op.process("a")
        path = await op.snapshot(str(tmp_path), 1)
    with pytest.raises(ast.CheckpointError, match="'s'"):
        async with ast.KeyedOperator(AsMap(), key_selector=lambda r: r, backend=make("2"),
                                     restore_from=path):
            pass  # pragma: no cover


@pytest.mark.parametrize("items", [[5], ["text"], [None], [b"\xc1"], [b"\x01\x02"]])
async def test_malformed_operator_state_items_are_a_checkpoint_error(tmp_path: Any,
                                                                     items: list[Any]) -> None:
    path = ast.checkpoint_path(str(tmp_path), 1)
    write_snapshot(ast.HeapBackend(), path, parallelism=1, operator_index=0,
                   max_parallelism=MAX_P,
                   extra={"operator_state": {"offsets": {"mode": "split", "items": items}}})
    fn = Ledger()
    with pytest.raises(ast.CheckpointError, match=r"^extra section of data file .* has operator "
                       r"state 'offsets' whose element 0 is not the msgpack bytes of one "
                       r"value: ") as info:
        async with ast.KeyedOperator(fn, key_selector=second, backend=ast.HeapBackend(),
                                     config=ast.AsyncStateConfig(max_parallelism=MAX_P),
                                     restore_from=path):
            pass  # pragma: no cover
    assert info.value.path == os.path.join(path, "part-1-0", os.listdir(
        os.path.join(path, "part-1-0"))[0]) or str(info.value.path).startswith(path)


@pytest.mark.parametrize("inner", ["heap", "rocksdb"])
async def test_simulated_remote_backend_checkpoints_its_inner_backend(tmp_path: Any,
                                                                      inner: str) -> None:
    make = _backend_factory(inner, tmp_path)

    def remote(tag: str) -> Any:
        return ast.SimulatedRemoteBackend(make(tag), latency_ms=0.5)

    async with ast.KeyedOperator(Ledger(), key_selector=second, backend=remote("1")) as op:
        await op.process(("w", "a", 1, "x"))
        await op.process(("w", "b", 2, "y"))
        path = await op.snapshot(str(tmp_path), 1)
    for backend in (ast.HeapBackend(), remote("2")):  # restored into a plain and a wrapped one
        async with ast.KeyedOperator(Ledger(), key_selector=second, backend=backend,
                                     restore_from=path) as op:
            await op.process(("r", "a"))
            await op.process(("r", "b"))
            await op.drain()
            assert sorted(op.outputs()) == [("a", 1, [1], {"x": 1}), ("b", 2, [2], {"y": 1})]


async def test_a_backend_without_checkpoint_methods_is_refused_by_name(tmp_path: Any) -> None:
    class Plain:  # a StateExecutor that cannot take part in checkpoints
        completes_at_issue = False

        def __init__(self) -> None:
            self.inner = ast.HeapBackend()

        def open(self, binding: Any) -> None:
            self.inner.open(binding)

        def register_state(self, name: str, kind: Any) -> Any:
            return self.inner.register_state(name, kind)

        def execute_batch(self, batch: Any) -> None:
            self.inner.execute_batch(batch)

        def fully_loaded(self) -> bool:
            return False

        def close(self) -> None:
            self.inner.close()

    async with ast.KeyedOperator(Ledger(), key_selector=second, backend=Plain()) as op:
        await op.process(("w", "a", 1, "x"))
        with pytest.raises(ast.CheckpointError, match=r"^Plain cannot take part in checkpoint "
                           r".*: it has no registered_states, snapshot_key_group, "
                           r"restore_key_group \(see SnapshotBackend\)$"):
            await op.snapshot(str(tmp_path), 1)
        assert not os.path.exists(ast.checkpoint_path(str(tmp_path), 1))


class SlowCounter(ast.KeyedProcessFunction):
    """Counts per key, with a real sleep between the read and the write."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        n = await self.count.value() or 0
        await asyncio.sleep(0.002)
        await self.count.update(n + 1)


class ReadCount(SlowCounter):
    async def process_element(self, value: Any, ctx: Any) -> None:
        ctx.emit((value, await self.count.value()))


@pytest.mark.timeout(120)
async def test_a_snapshot_under_steady_input_holds_exactly_the_records_admitted_before_it(
        tmp_path: Any) -> None:
    """Another task keeps feeding records that each take 2 ms, so records are always in
    flight: the snapshot holds later records back instead of draining forever, and the
    part holds exactly the records whose process() returned before the call."""
    admitted = 0
    keys = 10
    progress = asyncio.Condition()

    async def feed(op: ast.KeyedOperator) -> None:
        nonlocal admitted
        i = 0
        while True:
            await op.process(i % keys)
            admitted += 1
            i += 1
            async with progress:
                progress.notify_all()
            await asyncio.sleep(0.0005)  # steady input, not a burst

    async def admitted_at_least(n: int) -> None:
        async with asyncio.timeout(60), progress:
            await progress.wait_for(lambda: admitted >= n)

    op = ast.KeyedOperator(SlowCounter(), key_selector=lambda r: r, backend=ast.HeapBackend(),
                           config=ast.AsyncStateConfig(max_in_flight=100))
    async with op:
        producer = asyncio.create_task(feed(op))
        try:
            paths = []
            for checkpoint_id in (1, 2):
                await admitted_at_least(50 * checkpoint_id)
                before = admitted
                async with asyncio.timeout(60):  # without the barrier: never returns
                    paths.append((await op.snapshot(tmp_path, checkpoint_id), before))
            await admitted_at_least(before + 10)  # the producer goes on after the snapshots
        finally:
            producer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await producer
    for path, before in paths:
        reader = ast.KeyedOperator(ReadCount(), key_selector=lambda r: r,
                                   backend=ast.HeapBackend(), restore_from=path)
        async with reader:
            for key in range(keys):
                await reader.process(key)
        expected = Multiset(i % keys for i in range(before))
        assert sorted(reader.outputs()) == [(k, expected[k] or None) for k in range(keys)]
