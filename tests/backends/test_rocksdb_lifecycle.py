"""RocksDBBackend's lifecycle: opening (locks, paths, forks, bad arguments), registering
states, closing (from other threads, with reads queued, after failures) and releasing the
directory and the I/O threads however the operator on it ends."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import rocksdict
from backend_harness import (
    MAX_PARALLELISM,
    STATES,
    Harness,
    ReadOnly,
    key_of,
    run_operator,
)
from executor_doubles import wait_for_condition
from shared_functions import Boom, Counter, let_loop_run

import asyncstate as ast
from asyncstate.backends.base import ExecutorBinding
from asyncstate.backends.rocksdb import (
    RocksDBBackend,
    _translate_error,
)
from asyncstate.errors import (
    BackendError,
    ConfigError,
    InvalidStateError,
)
from asyncstate.runtime.requests import StateKind, StateRequestType


def test_translate_error_says_a_closed_database_is_closed():
    err = _translate_error(rocksdict.DbClosedError("DB instance already closed"), "/data/db")
    assert isinstance(err, BackendError) and err.path == "/data/db"
    assert str(err) == "RocksDB database '/data/db' is closed"


T = StateRequestType


def test_translate_error_recognises_lock_failures():
    same = Exception("IO error: lock hold by current process, acquire time 1795251702 acquiring "
                     "thread 1399: /data/db/LOCK: No locks available")
    other = Exception("IO error: While lock file: /data/db/LOCK: Resource temporarily unavailable")
    for exc in (same, other):
        err = _translate_error(exc, "/data/db")
        assert isinstance(err, BackendError) and err.path == "/data/db"
        assert re.match(r"^RocksDB directory '/data/db' is already in use \(by this process or "
                        r"another\); close the RocksDBBackend", str(err))
    err = _translate_error(Exception("Corruption: bad block"), "/data/db")
    assert str(err) == "RocksDB failed on '/data/db': Corruption: bad block"
    # Failing to open the LOCK file is not contention.
    denied = Exception("IO error: while open a file for lock: /data/db/LOCK: Permission denied")
    assert str(_translate_error(denied, "/data/db")) == f"RocksDB failed on '/data/db': {denied}"


def test_a_lock_path_that_cannot_be_opened_is_not_reported_as_in_use(tmp_path):
    path = tmp_path / "db"
    os.makedirs(path / "LOCK")  # nothing holds a lock: the LOCK file cannot be opened
    with pytest.raises(BackendError, match=r"^RocksDB failed on .*LOCK: Is a directory") as info:
        RocksDBBackend(path)
    assert info.value.path == str(path)


def test_opening_a_directory_twice_in_one_process_names_the_path(tmp_path):
    path = str(tmp_path / "db")
    with RocksDBBackend(path):
        with pytest.raises(BackendError, match=rf"^RocksDB directory {re.escape(repr(path))} is "
                                               r"already in use") as info:
            RocksDBBackend(path)
        assert info.value.path == path


@pytest.mark.parametrize("spelling", ["symlink", "dot", "trailing-slash", "proc-root"])
def test_opening_a_directory_twice_under_another_spelling_is_refused(tmp_path, spelling):
    """RocksDB refuses a second open in one process by path: the backend opens the real
    path, so a symlink or another spelling of the directory is refused too (two backends
    on one directory lose each other's state)."""
    path = tmp_path / "db"
    real = os.path.realpath(path)
    if spelling == "symlink":
        os.symlink(path, tmp_path / "link", target_is_directory=True)
        other = str(tmp_path / "link")
    elif spelling == "dot":
        other = os.path.join(str(tmp_path), ".", "db")
    elif spelling == "trailing-slash":
        other = str(path) + "/"
    else:
        other = "/proc/self/root" + real
    with RocksDBBackend(path) as first:
        first.register_state("v", StateKind.VALUE)
        if spelling == "symlink":
            assert first.path == real
        with pytest.raises(BackendError, match=rf"^RocksDB directory {re.escape(repr(real))} is "
                                               r"already in use") as info:
            RocksDBBackend(other)
        assert info.value.path == real
        assert first.registered_states() == {"v": StateKind.VALUE}


def test_opening_a_directory_used_by_another_process_names_the_path(tmp_path):
    path = str(tmp_path / "db")
    script = textwrap.dedent(f"""
        from asyncstate.backends.rocksdb import RocksDBBackend
        from asyncstate.errors import BackendError
        try:
            RocksDBBackend({path!r})
        except BackendError as exc:
            print(exc.path, exc)
    """)
    with RocksDBBackend(path):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             check=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.stdout.startswith(f"{path} RocksDB directory {path!r} is already in use")


_FORK_AFTER_OPEN = textwrap.dedent("""
    import os, sys, asyncstate as ast
    from asyncstate.backends import rocksdb_options
    from asyncstate.errors import BackendError
    from asyncstate.runtime.requests import StateKind
    root, opened_first = sys.argv[1], sys.argv[2] == "1"
    if opened_first:  # RocksDB's background threads start with the first database
        ast.RocksDBBackend(os.path.join(root, "parent")).close()
    parent_caches = dict(rocksdb_options._caches)
    pid = os.fork()
    if pid == 0:
        try:
            backend = ast.RocksDBBackend(os.path.join(root, "child"))
            backend.register_state("v", StateKind.VALUE)
            backend.close()  # the first flush: it would wait forever in a broken child
            print("child opened and closed", flush=True)
        except BackendError as exc:
            print("child refused:", exc, flush=True)
        own = rocksdb_options._shared_block_cache(64 * 1024 * 1024)
        print("child cache is the parent's:", any(own is c for c in parent_caches.values()),
              flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print("child status", status, flush=True)
""")


@pytest.mark.parametrize("opened_first", [True, False])
def test_a_process_forked_after_rocksdb_was_opened_refuses_it_clearly(tmp_path,
                                                                      opened_first):
    """RocksDB's background threads do not survive a fork: a database opened in such a child
    would hang at its first flush, so it is refused with an error saying why. A child forked
    before any database was opened uses RocksDB normally, and builds its own block cache."""
    out = subprocess.run([sys.executable, "-c", _FORK_AFTER_OPEN, str(tmp_path),
                          "1" if opened_first else "0"], capture_output=True, text=True,
                         check=True, timeout=120,  # the hang this guards against
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    lines = out.stdout.splitlines()
    if opened_first:
        assert re.match(r"^child refused: cannot open RocksDB directory '.*child': this process "
                        r"was forked from process \d+ after that one had opened a RocksDB "
                        r"database", lines[0]), out.stdout + out.stderr
    else:
        assert lines[0] == "child opened and closed", out.stdout + out.stderr
    assert lines[1] == "child cache is the parent's: False"


async def test_close_releases_the_directory_even_with_live_handles_and_cursors(tmp_path):
    path = tmp_path / "db"
    backend = RocksDBBackend(path)
    rdb = Harness(backend, asyncio.get_running_loop(), chunk_size=3)
    [_, chunk] = await rdb.run([("l", T.LIST_ADD_ALL, list(range(10)), 0, None),
                                ("l", T.LIST_GET, None, 0, None)])
    assert chunk.continuation is not None
    backend.close()
    backend.close()  # idempotent
    RocksDBBackend(path).close()  # the LOCK is free although `rdb` and `chunk` are alive
    assert "closed" in repr(rdb.states["l"].handle)


async def test_reopen_keeps_data_kinds_and_list_sequence(tmp_path):
    path = tmp_path / "db"
    loop = asyncio.get_running_loop()
    with RocksDBBackend(path) as backend:
        rdb = Harness(backend, loop)
        await rdb.run([("v", T.VALUE_UPDATE, {"x": 1}, 1, None),
                       ("l", T.LIST_ADD_ALL, ["a", "b"], 1, "ns"),
                       ("m", T.MAP_PUT, ("u", 2), 1, None)])
        sequence = backend.list_sequence()
        assert sequence == 2
    with RocksDBBackend(path) as backend:
        assert backend.list_sequence() == sequence
        assert backend.registered_states() == dict(sorted(STATES.items()))
        with pytest.raises(ValueError, match=r"^state 'v' is already registered as value state"):
            backend.register_state("v", StateKind.LIST)
        rdb = Harness(backend, loop)
        await rdb.run([("l", T.LIST_ADD, "c", 1, "ns")])
        got = await rdb.run([("v", T.VALUE_GET, None, 1, None), ("l", T.LIST_GET, None, 1, "ns"),
                             ("m", T.MAP_GET, "u", 1, None)])
        assert got[0] == {"x": 1} and got[1].items == ["a", "b", "c"] and got[2] == 2
        assert backend.list_sequence() == sequence + 1


def test_register_state_with_another_kind_raises_value_error(rocks):
    handle = rocks.register_state("s", StateKind.MAP)
    assert rocks.register_state("s", StateKind.MAP) is handle
    with pytest.raises(ValueError, match=r"^state 's' is already registered as map state \(in "):
        rocks.register_state("s", StateKind.VALUE)


@pytest.mark.parametrize("path", ["", b"db", 5, None, [], b""], ids=repr)
def test_path_that_is_not_a_non_empty_str_is_refused_before_anything_is_created(
        tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)  # "" would otherwise open the current directory as a database
    with pytest.raises(ConfigError, match=r"^path must be a non-empty str or "
                                          r"os\.PathLike\[str\] naming the database directory, "
                                          rf"got {re.escape(repr(path))}$"):
        RocksDBBackend(path)  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(60)
async def test_close_from_another_thread_fails_the_batches_under_way(tmp_path):
    """close() on another thread (a shutdown hook) while batches wait for reads: each is
    delivered once, failed, on the loop thread, so nothing waits for them forever."""
    backend = RocksDBBackend(tmp_path / "db", io_parallelism=1, inline_read_keys=0)
    harness = Harness(backend, asyncio.get_running_loop())
    gate = threading.Event()
    backend._pool.submit(gate.wait, 30)  # the one I/O thread is busy: the reads queue behind
    pending = [harness.submit([harness.request(("v", T.VALUE_GET, None, k, None))])
               for k in range(5)]
    assert not any(f.done() for f in pending)
    closer = threading.Thread(target=backend.close)
    closer.start()
    gate.set()
    closer.join(30)  # the loop thread waits here: nothing is delivered before the close ends
    assert not closer.is_alive()
    for fut in pending:
        with pytest.raises(InvalidStateError, match=r"was closed while this batch was under "
                                                    r"way$"):
            await asyncio.wait_for(fut, 10)
    assert sorted(harness.delivery_order) == sorted(set(harness.delivery_order))
    assert len(harness.delivery_order) == 5


_CLOSE_WITH_A_FULL_DISK = textwrap.dedent("""
    import os, resource, signal, sys
    from asyncstate.backends.rocksdb import RocksDBBackend
    from asyncstate.errors import BackendError
    from asyncstate.runtime.requests import StateKind
    path = sys.argv[1]
    backend = RocksDBBackend(path)  # the WAL is off: close() flushes the memtable
    handle = backend.register_state("v", StateKind.VALUE)
    handle.cf[b"\\x00\\x00k"] = os.urandom(100_000)
    del handle
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    for attempt in range(3):
        try:
            backend.close()
            print("closed")
        except BackendError as exc:
            print("failed", exc.path)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
    RocksDBBackend(path).close()
    print("reopened")
""")


def test_close_that_failed_is_not_retried_and_releases_the_directory(tmp_path):
    """A close whose flush fails (the file size limit stands in for a full disk) raises
    BackendError once; later closes do nothing (close() is idempotent) and the directory
    can be opened again."""
    path = str(tmp_path / "db")
    out = subprocess.run([sys.executable, "-c", _CLOSE_WITH_A_FULL_DISK, path],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.splitlines() == [f"failed {path}", "closed", "closed", "reopened"]


def binding(loop: asyncio.AbstractEventLoop | None) -> ExecutorBinding:
    return ExecutorBinding(loop=loop, deliver=lambda batch, results, error: None,
                           iterator_chunk_size=10, max_parallelism=MAX_PARALLELISM)


class NamedStr(str):
    pass


@pytest.mark.parametrize(("name", "shown"), [("", "''"), (NamedStr("v"), "'v'")])
def test_register_state_rejects_an_empty_name_or_a_str_subclass(tmp_path, name, shown):
    with RocksDBBackend(tmp_path / "db") as backend:
        with pytest.raises(TypeError, match=rf"^state name must be a non-empty str, got "
                                            rf"{re.escape(shown)}$"):
            backend.register_state(name, StateKind.VALUE)
        assert backend.registered_states() == {}
    with RocksDBBackend(tmp_path / "db") as backend:  # nothing was stored either
        assert backend.registered_states() == {}


@pytest.mark.parametrize(("name", "kind", "message"), [
    (5, StateKind.VALUE, r"^state name must be a non-empty str, got 5$"),
    (None, StateKind.VALUE, r"^state name must be a non-empty str, got None$"),
    ("v", "value", r"^kind must be a StateKind, got 'value'$"),
])
def test_register_state_names_a_bad_type(tmp_path, name, kind, message):
    with RocksDBBackend(tmp_path / "db") as backend:
        with pytest.raises(TypeError, match=message):
            backend.register_state(name, kind)
        assert backend.registered_states() == {}


async def test_open_binds_once(tmp_path):
    loop = asyncio.get_running_loop()
    with RocksDBBackend(tmp_path / "db") as backend:
        backend.open(binding(loop))
        with pytest.raises(InvalidStateError, match=r"^this RocksDBBackend is already bound to "
                                                    r"an operator; create one backend per "
                                                    r"operator$"):
            backend.open(binding(loop))


def test_open_needs_an_event_loop(tmp_path):
    with RocksDBBackend(tmp_path / "db") as backend:
        with pytest.raises(InvalidStateError, match=r"^RocksDBBackend needs the operator's "
                                                    r"event loop \(loop=None\)$"):
            backend.open(binding(None))
        with pytest.raises(InvalidStateError, match=r"^open\(\) the RocksDBBackend before "
                                                    r"executing batches$"):
            backend.execute_batch([])  # the failed open bound nothing


def test_open_and_register_after_close_raise(tmp_path):
    path = tmp_path / "db"
    backend = RocksDBBackend(path)
    backend.close()
    closed = rf"^RocksDBBackend {re.escape(repr(str(path)))} is closed$"
    with pytest.raises(InvalidStateError, match=closed):
        backend.open(binding(None))  # the closed check comes first
    with pytest.raises(InvalidStateError, match=closed):
        backend.register_state("v", StateKind.VALUE)


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


@pytest.mark.timeout(60)
async def test_body_error_with_pool_reads_queued_releases_directory_and_threads(tmp_path):
    path = tmp_path / "db"
    backend = RocksDBBackend(path, inline_read_keys=0)
    op = ast.KeyedOperator(Counter(), key_selector=key_of, backend=backend,
                           config=ast.AsyncStateConfig(batch_size=5, buffer_timeout_ms=0))
    with pytest.raises(Boom, match=r"^the body failed$") as info:
        async with op:
            for k in range(20):
                await op.process(k)
            await op.drain()  # 20 keys at 1 each
            occupy_pool(backend, release_after=0.3)
            # Fewer records than the pacing admits at once (io_slots() + 1 batches of 5
            # requests), so that none waits for the held pool to be admitted.
            for k in range(10):
                await op.process(k)
            # batches are planned; their multi-gets wait for the held pool
            assert await wait_for_condition(lambda: backend._reading > 0)
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
    """Hold the backend's pool for 0.3 s and feed 8 counter records meanwhile (batches of 4):
    their reads queue behind the held pool. Fewer than the pacing admits at once (io_slots()
    + 1 batches of 4 requests, 12): more would wait for the held pool to be admitted."""
    occupy_pool(backend, release_after=0.3)
    for k in range(8):
        await op.process(k)


@pytest.mark.timeout(60)
async def test_cancelled_while_draining_pool_reads_releases_directory(tmp_path):
    path = tmp_path / "db"
    backend = RocksDBBackend(path, inline_read_keys=0)
    entered = asyncio.Event()

    async def body() -> None:
        op = ast.KeyedOperator(Counter(), key_selector=key_of, backend=backend,
                               config=ast.AsyncStateConfig(batch_size=4, buffer_timeout_ms=0))
        async with op:
            await feed_with_the_pool_held(op, backend)
            entered.set()
            await op.drain()  # never completes: cancelled while the reads wait for the pool

    task = asyncio.ensure_future(body())
    await entered.wait()
    await let_loop_run()  # the drain waits for reads the held pool does not serve
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool_threads_alive(backend) == []
    with RocksDBBackend(path) as reopened:  # released at once
        assert reopened.registered_states() == {"count": StateKind.VALUE}
    # Let the reads' late wake-ups run on the loop: they must not fail.
    await let_loop_run()


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
    op = ast.KeyedOperator(function, key_selector=key_of,
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
        op = ast.KeyedOperator(Counter(), key_selector=key_of, backend=backend,
                               config=ast.AsyncStateConfig(batch_size=4, buffer_timeout_ms=0))
        async with op:
            await feed_with_the_pool_held(op, backend)
            exiting.set()
        # the clean exit drains: cancelled there

    task = asyncio.ensure_future(body())
    await exiting.wait()
    await let_loop_run()  # the clean exit drains: cancelled there
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
        op = ast.KeyedOperator(Counter(), key_selector=key_of, backend=backend,
                               config=ast.AsyncStateConfig(batch_size=4, buffer_timeout_ms=0,
                                                           gc_threshold=None))
        await op.__aenter__()
        gates.append(occupy_pool(backend, release_after=30))
        for k in range(8):  # fewer than the pacing admits at once: 2 + 1 batches of 4
            await op.process(k)
        assert await wait_for_condition(lambda: backend._reading > 0)

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
    healthy = ast.KeyedOperator(Counter(), key_selector=key_of,
                                backend=RocksDBBackend(tmp_path / "a", inline_read_keys=0))
    async with healthy:
        for k in range(100):
            await healthy.process(k)
        with pytest.raises(Boom):
            async with ast.KeyedOperator(Counter(), key_selector=key_of,
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
        ast.run(FailsOnFive(), list(range(10)), key_selector=key_of,
                backend=RocksDBBackend(path))
    with RocksDBBackend(path) as backend:
        assert backend.registered_states() == {"count": StateKind.VALUE}


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
    first_op = ast.KeyedOperator(Counter(), key_selector=key_of, backend=backend)
    second_op = ast.KeyedOperator(Counter(), key_selector=key_of, backend=backend)
    async with first_op:
        await first_op.process(1)
        with pytest.raises(InvalidStateError, match="already bound to an operator"):
            async with second_op:
                pass
        await first_op.process(1)
        await first_op.drain()
        assert first_op.outputs() == [(1, 1), (1, 2)]
    # After the first operator closed it, the backend refuses to serve again.
    third_op = ast.KeyedOperator(Counter(), key_selector=key_of, backend=backend)
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
    op = ast.KeyedOperator(ReadOnly(), key_selector=key_of, backend=RocksDBBackend(path),
                           restore_from=tmp_path / "no-such-checkpoint")
    with pytest.raises(ast.CheckpointError):
        async with op:
            pass
    # Both failures released the directory, and the failed restore left the state alone.
    assert await run_operator(ReadOnly(), RocksDBBackend(path), [1]) == [(1, 2)]


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


def test_a_directory_of_another_programs_rocksdict_is_refused_and_left_untouched(
        tmp_path: Path) -> None:
    import rocksdict

    path = str(tmp_path / "other")
    other = rocksdict.Rdict(path)  # rocksdict's default mode: pickled keys and values
    other["k"] = 1
    other.close()
    config = Path(path, "rocksdict-config.json").read_bytes()
    with pytest.raises(ast.BackendError, match=r"holds a rocksdict database of another "
                                               r"program .* left untouched") as refused:
        ast.RocksDBBackend(path)
    assert refused.value.path == path
    assert Path(path, "rocksdict-config.json").read_bytes() == config
    again = rocksdict.Rdict(path)  # its owner still opens it
    try:
        assert again["k"] == 1
    finally:
        again.close()
