"""Adversarial lifecycle and failure-handling tests of RocksDBBackend: exits by error or
cancellation while multi-gets are under way, process crashes, reopening across runs, misuse
after close, option validation, odd paths and state names, and large or extreme
configurations (compared with HeapBackend where it applies)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

import asyncstate as ast
from asyncstate.backends.base import ExecutorBinding
from asyncstate.backends.heap import HeapBackend
from asyncstate.backends.rocksdb import RocksDBBackend, RocksDBOptions
from asyncstate.errors import BackendError, ConfigError, InvalidStateError
from asyncstate.keygroups import key_group_of_bytes
from asyncstate.runtime.requests import StateKind
from asyncstate.serde import canonical_key

POOL_THREAD_PREFIX = "asyncstate-rocksdb"


# -- functions ------------------------------------------------------------------------------

class Counter(ast.KeyedProcessFunction):
    """Counts records per key in value state `name`; emits (key, count)."""

    def __init__(self, name: str = "count") -> None:
        self.name = name

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor(self.name))

    async def process_element(self, value: Any, ctx: Any) -> None:
        n = (await self.count.value() or 0) + 1
        await self.count.update(n)
        ctx.emit((ctx.current_key, n))


class Appender(ast.KeyedProcessFunction):
    """Appends each record's payload to list state "l" and emits (key, whole list)."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.items = ctx.get_list_state(ast.ListStateDescriptor("l"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        await self.items.add(value[1])
        ctx.emit((ctx.current_key, [v async for v in await self.items.get()]))


class ListNamed(Appender):
    """Appender over list state `name`."""

    def __init__(self, name: str) -> None:
        self.name = name

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.items = ctx.get_list_state(ast.ListStateDescriptor(self.name))


class ManyStates(ast.KeyedProcessFunction):
    """One value state per name; each record writes `value[1]` into every one of them and
    emits what every state held before."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.states = [ctx.get_state(ast.ValueStateDescriptor(n)) for n in self.names]

    async def process_element(self, value: Any, ctx: Any) -> None:
        before = [await s.value() for s in self.states]
        for s in self.states:
            await s.update(value[1])
        ctx.emit((ctx.current_key, before))


class ReadOnly(ast.KeyedProcessFunction):
    """Emits (key, value of value state "count") without writing."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        ctx.emit((ctx.current_key, await self.count.value()))


def first(record: Any) -> Any:
    return record[0] if isinstance(record, tuple) else record


async def run_operator(function: ast.KeyedProcessFunction, backend: Any, records: list[Any],
                       config: ast.AsyncStateConfig | None = None) -> list[Any]:
    op = ast.KeyedOperator(function, key_selector=first, backend=backend, config=config)
    async with op:
        for record in records:
            await op.process(record)
        await op.drain()
        return op.outputs()


def per_key(outputs: list[Any]) -> dict[Any, list[Any]]:
    """Outputs grouped by key (the first element), in emission order: records of one key
    finish in order, records of different keys may interleave differently per backend."""
    grouped: dict[Any, list[Any]] = {}
    for out in outputs:
        grouped.setdefault(out[0], []).append(out)
    return grouped


def pool_threads_alive(backend: RocksDBBackend) -> list[threading.Thread]:
    return [t for t in backend._pool._threads if t.is_alive()]


def occupy_pool(backend: RocksDBBackend, release_after: float) -> threading.Event:
    """Block every I/O thread of `backend` until the returned event is set, and set it from a
    timer thread after `release_after` seconds (close() waits for the pool, so only another
    thread can let it finish)."""
    gate = threading.Event()
    started = threading.Barrier(backend._io_parallelism + 1)

    def block() -> None:
        started.wait(timeout=10)
        gate.wait(timeout=30)

    for _ in range(backend._io_parallelism):
        backend._pool.submit(block)
    started.wait(timeout=10)
    timer = threading.Timer(release_after, gate.set)
    timer.daemon = True
    timer.start()
    return gate


# -- exits by error or cancellation while multi-gets are queued or running -----------------

class Boom(Exception):
    pass


@pytest.mark.timeout(60)
async def test_body_error_with_pool_reads_queued_releases_directory_and_threads(tmp_path):
    path = tmp_path / "db"
    backend = RocksDBBackend(path, inline_read_keys=0)
    op = ast.KeyedOperator(Counter(), key_selector=first, backend=backend,
                           config=ast.AsyncStateConfig(batch_size=5, buffer_timeout_ms=0))
    with pytest.raises(Boom, match=r"^the body failed$") as info:
        async with op:
            for k in range(20):
                await op.process(k)
            await op.drain()  # 20 keys at 1 each
            occupy_pool(backend, release_after=0.3)
            for k in range(50):
                await op.process(k)
            await asyncio.sleep(0.05)  # batches are planned; their multi-gets wait
            assert backend._reading > 0
            raise Boom("the body failed")
    assert info.value.__context__ is None  # nothing raised while closing
    assert pool_threads_alive(backend) == []
    assert "closed" in repr(backend)
    # The directory is free at once, and what was drained before the failure is stored.
    with RocksDBBackend(path) as reopened:
        assert reopened.registered_states() == {"count": StateKind.VALUE}
    assert await run_operator(ReadOnly(), RocksDBBackend(path), list(range(20))) == [
        (k, 1) for k in range(20)]


async def feed_with_the_pool_held(op: ast.KeyedOperator, backend: RocksDBBackend) -> None:
    """Hold the backend's pool for 0.3 s and feed 40 counter records meanwhile: their reads
    queue behind the held pool."""
    occupy_pool(backend, release_after=0.3)
    for k in range(40):
        await op.process(k)


@pytest.mark.timeout(60)
async def test_cancelled_while_draining_pool_reads_releases_directory(tmp_path):
    path = tmp_path / "db"
    backend = RocksDBBackend(path, inline_read_keys=0)
    entered = asyncio.Event()

    async def body() -> None:
        op = ast.KeyedOperator(Counter(), key_selector=first, backend=backend,
                               config=ast.AsyncStateConfig(batch_size=4, buffer_timeout_ms=0))
        async with op:
            await feed_with_the_pool_held(op, backend)
            entered.set()
            await op.drain()  # never completes: cancelled while the reads wait for the pool

    task = asyncio.ensure_future(body())
    await entered.wait()
    await asyncio.sleep(0.02)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool_threads_alive(backend) == []
    with RocksDBBackend(path) as reopened:  # released at once
        assert reopened.registered_states() == {"count": StateKind.VALUE}
    # Let the reads' late wake-ups run on the loop: they must not fail.
    await asyncio.sleep(0.05)


@pytest.mark.timeout(60)
async def test_body_error_with_a_running_iteration_and_reads_keeps_the_users_error(tmp_path):
    # An error from user code in a record fails the run; the exit re-raises it and the
    # directory is released although the record's state objects stay referenced.
    path = tmp_path / "db"

    class FailsAfterRead(ast.KeyedProcessFunction):
        def open(self, ctx: ast.RuntimeContext) -> None:
            self.items = ctx.get_list_state(ast.ListStateDescriptor("l"))
            self.seen: list[Any] = []

        async def process_element(self, value: Any, ctx: Any) -> None:
            await self.items.add_all(list(range(30)))
            iterator = await self.items.get()
            self.seen.append(iterator)  # keep the iterator (and its cursor) alive
            if value == 7:
                raise Boom(f"record {value}")

    function = FailsAfterRead()
    op = ast.KeyedOperator(function, key_selector=first,
                           backend=RocksDBBackend(path, inline_read_keys=0),
                           config=ast.AsyncStateConfig(iterator_chunk_size=4))
    with pytest.raises(Boom, match=r"^record 7$"):
        async with op:
            for k in range(20):
                await op.process(k)
    assert function.seen  # still referenced here
    with RocksDBBackend(path) as reopened:
        assert reopened.registered_states() == {"l": StateKind.LIST}


@pytest.mark.timeout(60)
async def test_cancelled_during_the_clean_exit_drain_releases_the_directory(tmp_path):
    path = tmp_path / "db"
    backend = RocksDBBackend(path, inline_read_keys=0)
    exiting = asyncio.Event()

    async def body() -> None:
        op = ast.KeyedOperator(Counter(), key_selector=first, backend=backend,
                               config=ast.AsyncStateConfig(batch_size=4, buffer_timeout_ms=0))
        async with op:
            await feed_with_the_pool_held(op, backend)
            exiting.set()
        # the clean exit drains: cancelled there

    task = asyncio.ensure_future(body())
    await exiting.wait()
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool_threads_alive(backend) == []
    RocksDBBackend(path).close()


def test_close_after_the_loop_closed_with_reads_still_queued(tmp_path):
    # The operator is never exited and its loop is closed while multi-gets wait for the
    # pool; a later close() from plain code still finishes and releases the directory (the
    # reads' wake-ups hit a closed loop).
    path = tmp_path / "db"
    backend = RocksDBBackend(path, inline_read_keys=0)
    gates: list[threading.Event] = []

    async def abandon() -> None:
        # gc_threshold=None: an operator that is never exited would otherwise hold its
        # threshold for the rest of the process (and of the test session).
        op = ast.KeyedOperator(Counter(), key_selector=first, backend=backend,
                               config=ast.AsyncStateConfig(batch_size=4, buffer_timeout_ms=0,
                                                           gc_threshold=None))
        await op.__aenter__()
        gates.append(occupy_pool(backend, release_after=30))
        for k in range(20):
            await op.process(k)
        await asyncio.sleep(0.02)
        assert backend._reading > 0

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(abandon())
    finally:
        loop.close()
    gates[0].set()
    backend.close()
    assert pool_threads_alive(backend) == []
    RocksDBBackend(path).close()


@pytest.mark.timeout(60)
async def test_a_failing_run_on_one_directory_leaves_another_running_backend_alone(tmp_path):
    # Same options, so both share the process's block cache.
    healthy = ast.KeyedOperator(Counter(), key_selector=first,
                                backend=RocksDBBackend(tmp_path / "a", inline_read_keys=0))
    async with healthy:
        for k in range(100):
            await healthy.process(k)
        with pytest.raises(Boom):
            async with ast.KeyedOperator(Counter(), key_selector=first,
                                         backend=RocksDBBackend(tmp_path / "b")) as failing:
                for k in range(100):
                    await failing.process(k)
                raise Boom("b failed")
        for k in range(100):
            await healthy.process(k)
        await healthy.drain()
        assert sorted(healthy.outputs()) == sorted([(k, 1) for k in range(100)]
                                                   + [(k, 2) for k in range(100)])


def test_ast_run_failure_releases_the_directory(tmp_path):
    path = tmp_path / "db"

    class FailsOnFive(Counter):
        async def process_element(self, value: Any, ctx: Any) -> None:
            await super().process_element(value, ctx)
            if value == 5:
                raise Boom("five")

    with pytest.raises(Boom, match=r"^five$"):
        ast.run(FailsOnFive(), list(range(10)), key_selector=first,
                backend=RocksDBBackend(path))
    with RocksDBBackend(path) as backend:
        assert backend.registered_states() == {"count": StateKind.VALUE}


# -- a process killed while the database is open --------------------------------------------

CRASH_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    import asyncstate as ast
    from asyncstate.backends.rocksdb import RocksDBBackend, RocksDBOptions

    class Both(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))
            self.l = ctx.get_list_state(ast.ListStateDescriptor("l"))
        async def process_element(self, value, ctx):
            await self.v.update(value)
            await self.l.add(value)

    async def main(path, wal, checkpoints):
        # A small write buffer: the state families flush to SST files while the metadata
        # (kinds, list sequence) stays in the default family's memtable.
        options = RocksDBOptions(disable_wal=not wal, write_buffer_bytes=64 * 1024)
        backend = RocksDBBackend(path, options=options)
        op = ast.KeyedOperator(Both(), key_selector=lambda r: r % 50, backend=backend)
        await op.__aenter__()
        for r in range(3000):
            await op.process(r)
            if r == 1499:
                await op.snapshot(checkpoints, 1)
        await op.drain()
        print("drained", backend.list_sequence(), flush=True)
        await asyncio.sleep(600)

    asyncio.run(main(sys.argv[1], sys.argv[2] == "wal", sys.argv[3]))
""")


def run_and_kill(path: Path, wal: bool) -> int:
    """Run CRASH_SCRIPT (checkpoint 1 under path/../chk after 1500 records), SIGKILL it
    once it has drained 3000 records; returns its list sequence."""
    proc = subprocess.Popen([sys.executable, "-c", CRASH_SCRIPT, str(path),
                             "wal" if wal else "nowal", str(path.parent / "chk")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("drained"), (line, proc.stderr.read())  # type: ignore[union-attr]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
    assert proc.returncode == -signal.SIGKILL
    return int(line.split()[1])


def expected_state(records: int) -> dict[int, tuple[int, list[int]]]:
    """What CRASH_SCRIPT's keys hold after its first `records` records."""
    return {k: (records - 50 + k, list(range(k, records, 50))) for k in range(50)}


class ReadBoth(ast.KeyedProcessFunction):
    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))
        self.l = ctx.get_list_state(ast.ListStateDescriptor("l"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        if value[1] == "append":
            await self.l.add(-1)
        ctx.emit((value[0], await self.v.value(), [x async for x in await self.l.get()]))


READ_ALL = [(k, "read") for k in range(50)] + [(3, "append")]


def check_read_all(got: list[Any], records: int) -> None:
    reads = {k: (v, items) for k, v, items in got if not (k == 3 and items[-1:] == [-1])}
    assert reads == expected_state(records)
    [appended] = [items for k, _v, items in got if k == 3 and items[-1:] == [-1]]
    assert appended == [*range(3, records, 50), -1]  # no earlier element overwritten


@pytest.mark.timeout(60)
async def test_sigkill_with_the_wal_on_keeps_every_applied_batch(tmp_path):
    # backends.md: "Set disable_wal=False if a directory must survive a process crash
    # without a checkpoint."
    path = tmp_path / "db"
    assert run_and_kill(path, wal=True) == 3000
    backend = RocksDBBackend(path, options=RocksDBOptions(disable_wal=False))
    assert backend.registered_states() == {"l": StateKind.LIST, "v": StateKind.VALUE}
    assert backend.list_sequence() == 3000  # appends after the crash overwrite nothing
    check_read_all(await run_operator(ReadBoth(), backend, READ_ALL), 3000)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wal", [False, True], ids=["default-no-wal", "wal"])
async def test_sigkill_then_restore_into_the_same_directory_holds_exactly_the_checkpoint(
        tmp_path, wal):
    # The WAL is off by default: what the crashed run wrote may be lost or half there
    # (documented); a restart restores its last checkpoint, which discards the directory's
    # state first, including column families whose kind entry the crash lost.
    path = tmp_path / "db"
    run_and_kill(path, wal=wal)
    op = ast.KeyedOperator(ReadBoth(), key_selector=first, backend=RocksDBBackend(path),
                           restore_from=ast.checkpoint_path(tmp_path / "chk", 1))
    async with op:
        assert op.backend.list_sequence() == 1500
        for r in READ_ALL:
            await op.process(r)
        await op.drain()
        got = op.outputs()
    check_read_all(got, 1500)


# A hazard, not a documented promise: after a crash with the default options the state
# families keep what they flushed while the kinds and the list sequence (default family,
# never flushed) are gone. Reopening WITHOUT a restore then appends from sequence 0 over
# surviving elements. The docs say a crashed job must restart from a checkpoint, so this
# only pins what happens today.
@pytest.mark.timeout(60)
async def test_sigkill_without_wal_then_reopen_without_restore_loses_the_metadata(tmp_path):
    path = tmp_path / "db"
    run_and_kill(path, wal=False)
    with RocksDBBackend(path) as backend:
        assert backend.registered_states() == {}  # the kinds were never flushed
        assert backend.list_sequence() == 0
        handle = backend.register_state("l", StateKind.LIST)
        survived = sum(1 for _ in handle.cf.keys())  # noqa: SIM118 (an Rdict)
        assert survived >= 1000  # but flushed elements survived
        del handle


# -- reopening across runs without a restore ------------------------------------------------

@pytest.mark.timeout(60)
async def test_three_runs_on_one_directory_continue_like_one_heap_run(tmp_path):
    path = tmp_path / "db"
    runs = [[(k, f"r0-{i}") for i in range(3) for k in range(10)],
            [(k, f"r1-{i}") for i in range(2) for k in range(0, 10, 2)],
            [(k, "r2") for k in range(10)]]
    got = [await run_operator(Appender(), RocksDBBackend(path, inline_read_keys=0), records)
           for records in runs]
    heap_op = ast.KeyedOperator(Appender(), key_selector=first, backend=HeapBackend())
    expected = []
    async with heap_op:
        for records in runs:
            for r in records:
                await heap_op.process(r)
            await heap_op.drain()
            expected.append(heap_op.outputs())
    assert [per_key(g) for g in got] == [per_key(e) for e in expected]
    with RocksDBBackend(path) as backend:
        assert backend.list_sequence() == sum(len(r) for r in runs)


@pytest.mark.timeout(60)
async def test_another_set_of_states_in_the_next_run_and_a_kind_conflict(tmp_path):
    path = tmp_path / "db"
    await run_operator(ManyStates(["a", "b"]), RocksDBBackend(path), [(1, "x")])
    got = await run_operator(ManyStates(["c", "a"]), RocksDBBackend(path), [(1, "y")])
    assert got == [(1, [None, "x"])]  # "a" kept its value, "c" is new
    with RocksDBBackend(path) as backend:
        assert backend.registered_states() == {
            "a": StateKind.VALUE, "b": StateKind.VALUE, "c": StateKind.VALUE}
    # A later run declaring "a" as a list fails in open() and still releases the directory.
    with pytest.raises(ValueError, match=r"^state 'a' is already registered as value state"):
        await run_operator(ListNamed("a"), RocksDBBackend(path), [(1, "z")])
    got = await run_operator(ManyStates(["b"]), RocksDBBackend(path), [(1, "w")])
    assert got == [(1, ["x"])]


# -- close, misuse after close, one backend for two operators ------------------------------

def test_close_twice_and_from_another_thread_releases_the_directory(tmp_path):
    path = tmp_path / "db"
    backend = RocksDBBackend(path)
    backend.register_state("v", StateKind.VALUE)
    errors: list[BaseException] = []

    def close() -> None:
        try:
            backend.close()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=close)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive() and errors == []
    backend.close()
    backend.close()
    assert pool_threads_alive(backend) == []
    with RocksDBBackend(path) as again:
        assert again.registered_states() == {"v": StateKind.VALUE}


@pytest.mark.timeout(60)
async def test_close_from_another_thread_while_idle_then_batches_fail_clearly(tmp_path):
    path = tmp_path / "db"
    backend = RocksDBBackend(path)
    delivered: list[Any] = []
    backend.open(ExecutorBinding(loop=asyncio.get_running_loop(),
                                 deliver=lambda b, r, e: delivered.append((b, r, e)),
                                 iterator_chunk_size=10, max_parallelism=128))
    await asyncio.to_thread(backend.close)
    backend.execute_batch([])
    [(batch, results, error)] = delivered
    assert batch == [] and results is None
    assert isinstance(error, InvalidStateError)
    assert str(error) == f"RocksDBBackend {str(path)!r} is closed"
    RocksDBBackend(path).close()


def test_every_checkpoint_method_refuses_a_closed_backend(tmp_path):
    path = tmp_path / "db"
    backend = RocksDBBackend(path)
    backend.register_state("v", StateKind.VALUE)
    backend.close()
    closed = rf"^RocksDBBackend {str(path)!r} is closed$".replace("[", r"\[")
    with pytest.raises(InvalidStateError, match=closed):
        list(backend.snapshot_key_group(0))
    with pytest.raises(InvalidStateError, match=closed):
        backend.restore_key_group(0, [])
    with pytest.raises(InvalidStateError, match=closed):
        backend.discard_state()
    with pytest.raises(InvalidStateError, match=closed):
        backend.set_list_sequence(5)


def test_two_threads_closing_at_once_both_return_quietly(tmp_path):
    failures: list[BaseException] = []
    for attempt in range(10):
        path = tmp_path / f"db{attempt}"
        backend = RocksDBBackend(path)
        backend.register_state("v", StateKind.VALUE)
        barrier = threading.Barrier(2)

        def close(backend: RocksDBBackend = backend, barrier: threading.Barrier = barrier
                  ) -> None:
            barrier.wait(timeout=10)
            try:
                backend.close()
            except BaseException as exc:  # noqa: BLE001
                failures.append(exc)

        threads = [threading.Thread(target=close) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        RocksDBBackend(path).close()  # the directory is released either way
    assert failures == []


def test_registered_states_of_a_closed_backend_raises(tmp_path):
    path = tmp_path / "db"
    backend = RocksDBBackend(path)
    backend.register_state("v", StateKind.VALUE)
    backend.close()
    with pytest.raises(InvalidStateError, match="is closed"):
        backend.registered_states()


@pytest.mark.timeout(60)
async def test_one_backend_for_two_operators_is_refused_and_the_first_keeps_running(tmp_path):
    backend = RocksDBBackend(tmp_path / "db")
    first_op = ast.KeyedOperator(Counter(), key_selector=first, backend=backend)
    second_op = ast.KeyedOperator(Counter(), key_selector=first, backend=backend)
    async with first_op:
        await first_op.process(1)
        with pytest.raises(InvalidStateError, match="already bound to an operator"):
            async with second_op:
                pass
        await first_op.process(1)
        await first_op.drain()
        assert first_op.outputs() == [(1, 1), (1, 2)]
    # After the first operator closed it, the backend refuses to serve again.
    third_op = ast.KeyedOperator(Counter(), key_selector=first, backend=backend)
    with pytest.raises(InvalidStateError, match="is closed"):
        async with third_op:
            pass


@pytest.mark.timeout(60)
async def test_function_close_failure_and_missing_checkpoint_still_release_the_directory(
        tmp_path):
    path = tmp_path / "db"

    class FailsOnClose(Counter):
        def close(self) -> None:
            raise Boom("close failed")

    with pytest.raises(Boom, match=r"^close failed$"):
        await run_operator(FailsOnClose(), RocksDBBackend(path), [1, 1])
    op = ast.KeyedOperator(ReadOnly(), key_selector=first, backend=RocksDBBackend(path),
                           restore_from=tmp_path / "no-such-checkpoint")
    with pytest.raises(ast.CheckpointError):
        async with op:
            pass
    # Both failures released the directory, and the failed restore left the state alone.
    assert await run_operator(ReadOnly(), RocksDBBackend(path), [1]) == [(1, 2)]


@pytest.mark.timeout(60)
async def test_restore_replaces_a_state_of_another_kind_left_by_an_earlier_run(tmp_path):
    # The checkpoint has "count" as a value state; the directory has it as a list (and an
    # extra map state) from an unrelated earlier run.
    source = ast.KeyedOperator(Counter(), key_selector=first,
                               backend=RocksDBBackend(tmp_path / "source"))
    async with source:
        for k in (1, 2, 2):
            await source.process(k)
        checkpoint = await source.snapshot(tmp_path / "chk", 7)
    path = tmp_path / "db"
    with RocksDBBackend(path) as backend:
        backend.register_state("count", StateKind.LIST)
        backend.register_state("extra", StateKind.MAP)
    await run_operator(ListNamed("count"), RocksDBBackend(path), [(1, "x"), (3, "y")])
    op = ast.KeyedOperator(ReadOnly(), key_selector=first, backend=RocksDBBackend(path),
                           restore_from=checkpoint)
    async with op:
        assert op.backend.registered_states() == {"count": StateKind.VALUE}
        for k in (1, 2, 3):
            await op.process(k)
        await op.drain()
        assert sorted(op.outputs()) == [(1, 1), (2, 2), (3, None)]


@pytest.mark.timeout(60)
async def test_reopening_with_different_options_keeps_the_state(tmp_path):
    path = tmp_path / "db"
    variants = [RocksDBOptions(),
                RocksDBOptions(block_cache_bytes=0, bloom_filter_bits=0,
                               memtable_bloom_ratio=0, write_buffer_bytes=64 * 1024),
                RocksDBOptions(disable_wal=False, bloom_filter_bits=64,
                               memtable_bloom_ratio=0.25, block_cache_bytes=1 << 20)]
    records = [k for k in range(300)]
    for run, options in enumerate(variants * 2):
        got = await run_operator(Counter(), RocksDBBackend(path, options=options), records)
        assert sorted(got) == [(k, run + 1) for k in records]


# -- options and paths ----------------------------------------------------------------------

@pytest.mark.parametrize(("field", "value"), [
    ("block_cache_bytes", -1), ("block_cache_bytes", 1.5), ("block_cache_bytes", True),
    ("bloom_filter_bits", 65), ("bloom_filter_bits", -1), ("bloom_filter_bits", "10"),
    ("write_buffer_bytes", 64 * 1024 - 1), ("write_buffer_bytes", None),
    ("memtable_bloom_ratio", 0.26), ("memtable_bloom_ratio", -0.01),
    ("memtable_bloom_ratio", float("nan")), ("memtable_bloom_ratio", float("inf")),
    ("memtable_bloom_ratio", True), ("memtable_bloom_ratio", "0.1"),
    ("disable_wal", 0), ("disable_wal", "yes"), ("disable_wal", None),
])
def test_bad_options_raise_config_error_naming_the_option(field, value):
    with pytest.raises(ConfigError) as info:
        RocksDBOptions(**{field: value})
    assert info.value.option == field
    assert str(info.value).startswith(f"{field} must be ")


@pytest.mark.parametrize(("argument", "value"), [
    ("io_parallelism", 0), ("io_parallelism", 65), ("inline_read_keys", -1)])
def test_bad_backend_arguments_raise_config_error_and_create_nothing(tmp_path, argument,
                                                                     value):
    with pytest.raises(ConfigError) as info:
        RocksDBBackend(tmp_path / "db", **{argument: value})
    assert info.value.option == argument
    assert not (tmp_path / "db").exists()


@pytest.mark.parametrize("field", ["block_cache_bytes", "write_buffer_bytes"])
def test_sizes_beyond_64_bits_raise_config_error(tmp_path, field):
    with pytest.raises(ConfigError) as info:
        RocksDBBackend(tmp_path / "db", options=RocksDBOptions(**{field: 2**64})).close()
    assert info.value.option == field


def test_a_path_that_is_a_file_raises_backend_error_naming_it(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(b"not a database")
    with pytest.raises(BackendError) as info:
        RocksDBBackend(path)
    assert info.value.path == str(path)
    assert str(info.value).startswith(f"RocksDB failed on {str(path)!r}: ")
    assert path.read_bytes() == b"not a database"


def test_missing_parent_directories_are_created(tmp_path):
    path = tmp_path / "a" / "b" / "c"
    with RocksDBBackend(path) as backend:
        backend.register_state("v", StateKind.VALUE)
    assert (path / "CURRENT").exists()


def test_a_read_only_directory_raises_backend_error(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("running as root: file permissions do not stop writes")
    path = tmp_path / "ro"
    path.mkdir()
    path.chmod(0o500)
    try:
        with pytest.raises(BackendError) as info:
            RocksDBBackend(path / "db")
        assert info.value.path == str(path / "db")
    finally:
        path.chmod(0o700)


# -- odd state names and many states --------------------------------------------------------

ODD_NAMES = ["ü€🙂", "a/b", "a:b", ":", "state:x", " ", ".", "..", "x" * 10_000, "LOCK",
             "default"]


@pytest.mark.timeout(60)
async def test_odd_state_names_store_and_reopen_like_the_heap(tmp_path):
    path = tmp_path / "db"
    records = [(k, i) for i in range(3) for k in range(5)]
    got = await run_operator(ManyStates(ODD_NAMES), RocksDBBackend(path), records)
    expected = await run_operator(ManyStates(ODD_NAMES), HeapBackend(), records)
    assert per_key(got) == per_key(expected)
    with RocksDBBackend(path) as backend:
        assert backend.registered_states() == {n: StateKind.VALUE for n in ODD_NAMES}
    got = await run_operator(ManyStates(ODD_NAMES[::-1]), RocksDBBackend(path), [(0, "z")])
    assert got == [(0, [2] * len(ODD_NAMES))]


@pytest.mark.parametrize(("name", "rule"), [
    ("a\x00b", "without NUL characters"), ("\ud800", "that encodes to UTF-8")],
    ids=["nul", "lone-surrogate"])
def test_a_state_name_rocksdb_cannot_store_fails_and_leaves_the_backend_usable(tmp_path, name,
                                                                               rule):
    path = tmp_path / "db"
    with RocksDBBackend(path) as backend:
        with pytest.raises(ConfigError, match=rf"^state name must be a str {rule}"):
            backend.register_state(name, StateKind.VALUE)
        assert backend.registered_states() == {}
        backend.register_state("ok", StateKind.VALUE)
    with RocksDBBackend(path) as backend:
        assert backend.registered_states() == {"ok": StateKind.VALUE}


@pytest.mark.timeout(60)
async def test_one_hundred_states_round_trip_through_a_reopen(tmp_path):
    path = tmp_path / "db"
    names = [f"s{i:03d}" for i in range(100)]
    options = RocksDBOptions(write_buffer_bytes=256 * 1024)
    got = await run_operator(ManyStates(names), RocksDBBackend(path, options=options),
                             [(k, k * 10) for k in range(4)])
    assert got == [(k, [None] * 100) for k in range(4)]
    got = await run_operator(ManyStates(names[::-1]), RocksDBBackend(path, options=options),
                             [(k, -k) for k in range(4)])
    assert got == [(k, [k * 10] * 100) for k in range(4)]
    with RocksDBBackend(path, options=options) as backend:
        assert backend.registered_states() == {n: StateKind.VALUE for n in names}


# -- large batches and values, tiny chunks, every key group ---------------------------------

@pytest.mark.timeout(60)
async def test_a_batch_of_10000_requests_matches_the_heap(tmp_path):
    config = ast.AsyncStateConfig(batch_size=10_000, max_in_flight=20_000,
                                  buffer_timeout_ms=60_000)
    records = [k % 12_000 for k in range(15_000)]
    backend = RocksDBBackend(tmp_path / "db", inline_read_keys=0)
    op = ast.KeyedOperator(Counter(), key_selector=first, backend=backend, config=config)
    async with op:
        for r in records:
            await op.process(r)
        await op.drain()
        got = op.outputs()
        assert op.metrics["max_batch_size"] == 10_000  # read in parts over both I/O slots
    assert per_key(got) == per_key(await run_operator(Counter(), HeapBackend(), records))


class BigValues(ast.KeyedProcessFunction):
    """Stores value[1] in value state "v", appends it to list "l" and puts it in map "m";
    emits the sizes of what each held before."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))
        self.l = ctx.get_list_state(ast.ListStateDescriptor("l"))
        self.m = ctx.get_map_state(ast.MapStateDescriptor("m"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        key, payload = value
        old = await self.v.value()
        await self.v.update(payload)
        await self.l.add(payload)
        await self.m.put(len(payload) % 7, payload)
        items = [len(x) async for x in await self.l.get()]
        entries = sorted([(k, len(x)) async for k, x in await self.m.entries()])
        ctx.emit((key, None if old is None else (len(old), old[:1]), items, entries))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("write_buffer_bytes", [64 * 1024, 64 * 1024 * 1024],
                         ids=["values-larger-than-the-memtable", "default-memtable"])
async def test_one_megabyte_values_match_the_heap_and_survive_a_reopen(tmp_path,
                                                                       write_buffer_bytes):
    path = tmp_path / "db"
    options = RocksDBOptions(write_buffer_bytes=write_buffer_bytes)
    records = [(k % 4, bytes([k]) * (1024 * 1024 + k)) for k in range(24)]
    config = ast.AsyncStateConfig(iterator_chunk_size=2)
    got = await run_operator(BigValues(), RocksDBBackend(path, options=options), records[:12],
                             config)
    got += await run_operator(BigValues(), RocksDBBackend(path, options=options),
                              records[12:], config)
    heap = HeapBackend()
    op = ast.KeyedOperator(BigValues(), key_selector=first, backend=heap, config=config)
    async with op:
        for r in records:
            await op.process(r)
        await op.drain()
        expected = op.outputs()
    assert per_key(got) == per_key(expected)


class IterateAll(ast.KeyedProcessFunction):
    """Fills list "l" and map "m" with `value[1]` elements, then emits both iterations."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.l = ctx.get_list_state(ast.ListStateDescriptor("l"))
        self.m = ctx.get_map_state(ast.MapStateDescriptor("m"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        key, n = value
        await self.l.add_all(list(range(n)))
        await self.m.put_all({i: -i for i in range(n)})
        items = [x async for x in await self.l.get()]
        keys = sorted([k async for k in await self.m.keys()])
        values = sorted([v async for v in await self.m.values()])
        ctx.emit((key, items, keys, values, await self.m.is_empty()))


@pytest.mark.timeout(60)
async def test_iterator_chunk_size_one_over_thousands_of_elements_matches_the_heap(tmp_path):
    config = ast.AsyncStateConfig(iterator_chunk_size=1)
    records = [(1, 1500), (2, 1), (1, 3), (3, 0)]
    got = await run_operator(IterateAll(), RocksDBBackend(tmp_path / "db"), records, config)
    expected = await run_operator(IterateAll(), HeapBackend(), records, config)
    assert per_key(got) == per_key(expected)
    assert len(per_key(got)[1][1][1]) == 1503


def one_key_per_key_group(max_parallelism: int) -> dict[int, int]:
    keys: dict[int, int] = {}
    k = 0
    while len(keys) < max_parallelism:
        keys.setdefault(key_group_of_bytes(canonical_key(k), max_parallelism), k)
        k += 1
    return keys


@pytest.mark.timeout(60)
async def test_every_one_of_32768_key_groups_snapshot_and_restore_split_in_two(tmp_path):
    mp = 32_768
    config = ast.AsyncStateConfig(max_parallelism=mp)
    keys = one_key_per_key_group(mp)
    records = [keys[kg] for kg in range(mp)] + [keys[0], keys[mp - 1], keys[mp // 2]]
    op = ast.KeyedOperator(Counter(), key_selector=first,
                           backend=RocksDBBackend(tmp_path / "db"), config=config)
    async with op:
        for r in records:
            await op.process(r)
        await op.drain()
        got = op.outputs()
        checkpoint = await op.snapshot(tmp_path / "chk", 1)
    heap = await run_operator(Counter(), HeapBackend(), records, config)
    assert per_key(got) == per_key(heap)
    # Restore into two RocksDB instances, each with half of the key groups, then read back.
    counts: dict[int, int] = {}
    for index in range(2):
        restored = ast.KeyedOperator(ReadOnly(), key_selector=first,
                                     backend=RocksDBBackend(tmp_path / f"db{index}"),
                                     config=config, parallelism=2, operator_index=index,
                                     restore_from=checkpoint)
        async with restored:
            start, end = restored.key_group_range.start, restored.key_group_range.end
            for kg in range(start, end + 1):
                await restored.process(keys[kg])
            await restored.drain()
            counts.update(restored.outputs())
    assert counts == {keys[kg]: 2 if kg in (0, mp // 2, mp - 1) else 1 for kg in range(mp)}
