"""Keyed functions, backends and helpers several test modules use (importable because tests/
holds conftest.py).

`BACKEND_FACTORIES` is the one table of backend kinds the suite runs against: a test takes the
`backend` fixture (a fresh backend) or `make_backend` (a factory of fresh backends of one kind)
and narrows the kinds with ``@pytest.mark.backends("heap", "rocksdb")`` (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import enum
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import types
from collections.abc import Callable, Coroutine, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import pytest
import uvloop

import asyncstate as ast
from asyncstate.runtime.requests import StateKind

SOAK_FACTOR = 20


def slow_examples(n: int) -> int:
    """max_examples for a test whose examples are slow (a RocksDB or a checkpoint each): `n`,
    or SOAK_FACTOR times that under the soak hypothesis profile (docs/contributing.md)."""
    return n * SOAK_FACTOR if os.environ.get("ASYNCSTATE_HYPOTHESIS_PROFILE") == "soak" else n


class Boom(Exception):
    """A failure of user code; tests check its identity (the original object comes back)."""


class BaseBoom(BaseException):
    """A failure of user code that is neither an Exception nor KeyboardInterrupt, SystemExit
    or CancelledError (as pytest's own outcomes are): it fails the run like any other."""


class FakeState:
    """What the controller and the backends need of a state: its name, its kind and the
    handle its backend registered."""

    __slots__ = ("handle", "kind", "name")

    def __init__(self, name: str, kind: StateKind, handle: Any) -> None:
        self.name = name
        self.kind = kind
        self.handle = handle

    @classmethod
    def register(cls, backend: Any, name: str, kind: StateKind = StateKind.VALUE) -> FakeState:
        return cls(name, kind, backend.register_state(name, kind))

    def __repr__(self) -> str:
        return f"<FakeState {self.name!r}>"


# -- key selectors ---------------------------------------------------------------------------


def first(record: Any) -> Any:
    """Key selector: a record is ``(key, ...)``."""
    return record[0]


def second(record: Any) -> Any:
    """Key selector: a record is ``(kind, key, ...)``."""
    return record[1]


def ident(record: Any) -> Any:
    """Key selector: the record is its own key."""
    return record


# -- backends --------------------------------------------------------------------------------

BackendFactory = Callable[[Path | None], Any]

_TMP_DIRS: list[str] = []


def _db_path(directory: Path | None) -> str:
    """A fresh database directory below `directory` (a test's tmp_path), or below a temporary
    directory removed when the session ends (for hypothesis tests, which take no tmp_path)."""
    if directory is None:
        directory = Path(tempfile.mkdtemp(prefix="asyncstate-test-"))
        _TMP_DIRS.append(str(directory))
    directory.mkdir(parents=True, exist_ok=True)
    return tempfile.mkdtemp(prefix="db-", dir=directory)


def remove_temporary_directories() -> None:
    while _TMP_DIRS:
        shutil.rmtree(_TMP_DIRS.pop(), ignore_errors=True)


def _remote(latency_ms: float, inner: Any = None, **options: Any) -> Any:
    return ast.SimulatedRemoteBackend(ast.HeapBackend() if inner is None else inner,
                                      latency_ms=latency_ms, **options)


BACKEND_FACTORIES: dict[str, BackendFactory] = {
    "heap": lambda d: ast.HeapBackend(),
    # The batched path: requests go through execute_batch, results come back per batch.
    "remote0": lambda d: _remote(0),
    # A real I/O thread and a round trip per batch: results arrive from loop callbacks.
    "remote1": lambda d: _remote(1),
    "remote5": lambda d: _remote(5),
    # One I/O slot: partial batches wait while it is busy.
    "remote2-p1": lambda d: _remote(2, io_parallelism=1),
    "rocksdb": lambda d: ast.RocksDBBackend(_db_path(d)),
    # One pool thread, every read through the pool.
    "rocksdb-p1": lambda d: ast.RocksDBBackend(_db_path(d), io_parallelism=1, inline_read_keys=0),
    # An inner backend that delivers from its own threads, behind the simulated network.
    "remote0-rocksdb": lambda d: _remote(0, ast.RocksDBBackend(_db_path(d))),
    # A state cache in front: hits answered at issue time, writes complete at once.
    "remote0-cache": lambda d: _remote(0, cache_entries=64),
    "rocksdb-cache": lambda d: ast.RocksDBBackend(_db_path(d), cache_entries=64),
}

# What the state-semantics tests run on unless they narrow it: every kind of storage.
STORAGE_BACKENDS = ("heap", "remote0", "rocksdb", "remote0-rocksdb")
# What operator tests run on unless they narrow it: immediate, batched, and a real round trip.
OPERATOR_BACKENDS = ("heap", "remote0", "remote1")


def new_backend(kind: str, directory: Path | str | None = None) -> Any:
    """A fresh backend of `kind` (a key of BACKEND_FACTORIES); RocksDB lives below
    `directory`."""
    return BACKEND_FACTORIES[kind](None if directory is None else Path(directory))


# -- operators -------------------------------------------------------------------------------


def keyed_operator(fn: ast.KeyedProcessFunction, backend: Any, *,
                   config: ast.AsyncStateConfig | None = None,
                   key_selector: Callable[[Any], Any] = first, **kwargs: Any) -> ast.KeyedOperator:
    """A KeyedOperator keyed by the record's first item, with the default config unless one is
    given (buffer timeout 1 s: a test that waits for it, instead of for the partial-batch flush
    of drain/advance_*, is slow or times out)."""
    return ast.KeyedOperator(fn, key_selector=key_selector, backend=backend, config=config,
                             **kwargs)


def cfg(**options: Any) -> ast.AsyncStateConfig:
    """A config without a buffer timeout unless `options` set one."""
    options.setdefault("buffer_timeout_ms", 0)
    return ast.AsyncStateConfig(**options)


def op_of(fn: ast.KeyedProcessFunction, backend: Any, *,
          config: ast.AsyncStateConfig | None = None, **kwargs: Any) -> ast.KeyedOperator:
    """`keyed_operator` with `cfg()` (no buffer timeout) unless a config is given."""
    return keyed_operator(fn, backend, config=config or cfg(), **kwargs)


async def run_records(fn: ast.KeyedProcessFunction, records: Iterable[Any], backend: Any, *,
                      key_selector: Callable[[Any], Any] = first,
                      config: ast.AsyncStateConfig | None = None, **options: Any) -> list[Any]:
    """Process `records` through a KeyedOperator on `backend` (with `config`, or a config of
    `options`); the outputs, in order."""
    async with ast.KeyedOperator(fn, key_selector=key_selector, backend=backend,
                                 config=config or ast.AsyncStateConfig(**options)) as op:
        for record in records:
            await op.process(record)
        async with asyncio.timeout(60):  # a record that never ends fails here
            await op.drain()
        return op.outputs()


def run_on_every_backend(state_helpers: Any, make_fn: Callable[[], ast.KeyedProcessFunction],
                         records: list[Any], *, loop: str | None = None,
                         **config: Any) -> dict[str, Any]:
    """Run a fresh function from `make_fn()` over `records` on every kind of storage; outputs
    (or the failure's type and message) by backend kind. Each RocksDB gets its own fresh
    directory. With `loop` (a key of LOOP_FACTORIES), a KeyedOperator processes and drains
    the records on a loop of that kind (no timers fire), else `ast.run` runs them (uvloop)."""
    results: dict[str, Any] = {}
    for kind, factory in state_helpers.factories.items():
        with tempfile.TemporaryDirectory(prefix="asyncstate-parity-") as tmp:
            backend = factory(Path(tmp))
            options = ast.AsyncStateConfig(**config)
            try:
                if loop is None:
                    results[kind] = ast.run(make_fn(), records, key_selector=first,
                                            backend=backend, config=options)
                else:
                    results[kind] = run_on_loop(loop, run_records(make_fn(), records, backend,
                                                                  config=options))
            except Exception as exc:  # noqa: BLE001 - compared between backends
                results[kind] = ("raised", type(exc).__name__, str(exc))
    return results


def run_python(code: str, *, pure: bool, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter on the compiled modules or (`pure`) their sources."""
    env = dict(os.environ)
    env.pop("ASYNCSTATE_PURE_PYTHON", None)
    if pure:
        env["ASYNCSTATE_PURE_PYTHON"] = "1"
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


# -- event loops ------------------------------------------------------------------------------

# Every async test runs once per loop (tests/conftest.py). A hypothesis test that starts its
# own loops draws one per example instead (`st.sampled_from(LOOP_NAMES)`), so both loops are
# covered without running each example twice.
LOOP_FACTORIES: Mapping[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}
LOOP_NAMES = tuple(LOOP_FACTORIES)
_T = TypeVar("_T")


def run_on_loop(loop_name: str, main: Coroutine[Any, Any, _T]) -> _T:
    """Run `main` on a new event loop of the kind `loop_name` names (a key of
    LOOP_FACTORIES), as asyncio.run does on asyncio's own."""
    with asyncio.Runner(loop_factory=LOOP_FACTORIES[loop_name]) as runner:
        return runner.run(main)


# -- waiting without sleeping ----------------------------------------------------------------


async def let_loop_run(rounds: int = 20) -> None:
    """Let the callbacks the loop has ready run, and those they schedule, for `rounds`
    iterations. What has not happened by then waits for something the test controls (an
    event, a gate), not for time to pass."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class Reached:
    """How many records reached a point of their code: a record calls `mark()` there (before
    it waits on a gate, say) and the test awaits `at_least(n)` instead of sleeping."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = asyncio.Event()

    def mark(self) -> None:
        self.count += 1
        self._changed.set()

    async def at_least(self, n: int, timeout: float = 10) -> None:
        async with asyncio.timeout(timeout):
            while self.count < n:
                self._changed.clear()
                await self._changed.wait()


# -- keyed functions -------------------------------------------------------------------------


def by_key(key: Any, n: int, record: Any) -> Any:
    return (key, n)


def with_tag(key: Any, n: int, record: Any) -> Any:
    """(key, n, tag) for a record ``(key, tag)``."""
    return (key, n, record[1])


def tag_only(key: Any, n: int, record: Any) -> Any:
    """(tag, n) for a record ``(key, tag)``."""
    return (record[1], n)


class Counter(ast.KeyedProcessFunction):
    """async def style: counts the records of each key in ValueState `state` (read,
    increment, write) and emits ``output(key, n, record)``, by default (key, n). Logs its
    open and close calls in `calls`."""

    def __init__(self, state: str = "count",
                 output: Callable[[Any, int, Any], Any] = by_key) -> None:
        self.state = state
        self.output = output
        self.calls: list[str] = []

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.calls.append("open")
        self.count = ctx.get_state(ast.ValueStateDescriptor(self.state))

    async def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
        n = (await self.count.value() or 0) + 1
        await self.count.update(n)
        ctx.emit(self.output(ctx.current_key, n, value))

    def close(self) -> None:
        self.calls.append("close")


class Ledger(ast.KeyedProcessFunction):
    """Records: ("w", key, amount, tag) writes; ("r", key) emits the key's whole state.

    Keyed: a running sum (ValueState), the amounts (ListState), counts per tag (MapState).
    Operator: "offsets" (even split) and "seen" (union), used by the test code directly."""

    def __init__(self, split: str | None = "offsets", union: str | None = "seen") -> None:
        self.split_name = split
        self.union_name = union

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.sum = ctx.get_state(ast.ValueStateDescriptor("sum"))
        self.values = ctx.get_list_state(ast.ListStateDescriptor("values"))
        self.tags = ctx.get_map_state(ast.MapStateDescriptor("tags"))
        self.split = (ctx.get_operator_list_state(self.split_name)
                      if self.split_name is not None else None)
        self.union = (ctx.get_union_list_state(self.union_name)
                      if self.union_name is not None else None)

    async def process_element(self, value: Any, ctx: Any) -> None:
        if value[0] == "w":
            _, _key, amount, tag = value
            await asyncio.sleep(0)  # let records overlap
            await self.sum.update((await self.sum.value() or 0) + amount)
            await self.values.add(amount)
            await self.tags.put(tag, (await self.tags.get(tag) or 0) + 1)
        else:
            total = await self.sum.value()
            values = await (await self.values.get()).to_list()
            tags = dict(await (await self.tags.entries()).to_list())
            ctx.emit((value[1], total, values, tags))


class Sum(ast.AggregateFunction):
    """Sums numbers; the accumulator is the running total."""

    def create_accumulator(self) -> int:
        return 0

    def add(self, value: int, acc: int) -> int:
        return acc + value

    def get_result(self, acc: int) -> int:
        return acc

    def merge(self, a: int, b: int) -> int:
        return a + b


class Step(ast.KeyedProcessFunction):
    """async def process_element awaiting the record's own step: record = (key, step) and
    ``await step(self, ctx)``; ValueStates `v` and `w` are declared."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))
        self.w = ctx.get_state(ast.ValueStateDescriptor("w"))

    async def process_element(self, record: Any, ctx: Any) -> None:
        await record[1](self, ctx)


class Dynamic(ast.KeyedProcessFunction):
    """Runs the coroutine function a record carries, ``(key, step)``, as ``await step(self,
    ctx)``: the driver's code scan cannot see it. One ValueState, `v`."""

    needs_task = None

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        await value[1](self, ctx)


_GETTERS: dict[type, str] = {
    ast.ValueStateDescriptor: "get_state",
    ast.ListStateDescriptor: "get_list_state",
    ast.MapStateDescriptor: "get_map_state",
    ast.ReducingStateDescriptor: "get_reducing_state",
    ast.AggregatingStateDescriptor: "get_aggregating_state",
}


class Script(ast.KeyedProcessFunction):
    """Plain-def function: a record is ``(key, step)`` and ``step(states, ctx)`` runs as the
    body of process_element; its result (None or a StateFuture) is returned as is.

    `states` has one attribute per keyword descriptor given to the constructor.
    """

    def __init__(self, **descriptors: Any) -> None:
        self.descriptors = descriptors

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.s = types.SimpleNamespace(**{name: getattr(ctx, _GETTERS[type(d)])(d)
                                          for name, d in self.descriptors.items()})

    def process_element(self, record: Any, ctx: Any) -> Any:
        return record[1](self.s, ctx)


class AsyncScript(Script):
    """Like Script, but process_element is an ``async def`` awaiting ``step(states, ctx)``
    (an ``async def`` step)."""

    async def process_element(self, record: Any, ctx: Any) -> Any:  # type: ignore[override]
        await record[1](self.s, ctx)


class StepFn(ast.KeyedProcessFunction):
    """Records are ``(key, step)``; ``step(self, ctx)`` is awaited when it is a coroutine
    function's result, else returned (plain-def style). States: list `l`, map `m`, value `v`;
    `saved` is a list a step may keep things in."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.l = ctx.get_list_state(ast.ListStateDescriptor("l"))
        self.m = ctx.get_map_state(ast.MapStateDescriptor("m"))
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))
        self.saved: list[Any] = []

    def process_element(self, record: Any, ctx: Any) -> Any:
        return record[1](self, ctx)


def run_steps(kind: str, chunk: int, records: list[Any]) -> list[Any]:
    """Run StepFn records through `ast.run` on a fresh backend of `kind`, iterators loading
    `chunk` items at a time."""
    with tempfile.TemporaryDirectory(prefix="asyncstate-steps-") as d:
        return ast.run(StepFn(), records, key_selector=first, backend=new_backend(kind, d),
                       config=ast.AsyncStateConfig(iterator_chunk_size=chunk))


class Declares(ast.KeyedProcessFunction):
    """A function whose open() runs `declare(ctx)` and keeps what it returned."""

    def __init__(self, declare: Callable[[ast.RuntimeContext], Any]) -> None:
        self.declare = declare
        self.declared: Any = None

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.declared = self.declare(ctx)

    def process_element(self, value: Any, ctx: Any) -> None:
        return None


async def open_declaring(declare: Callable[[ast.RuntimeContext], Any]) -> Any:
    """Start and close a KeyedOperator (HeapBackend) whose open() runs `declare(ctx)`;
    return what it returned. Errors raised by `declare` escape `async with`."""
    fn = Declares(declare)
    async with ast.KeyedOperator(fn, key_selector=ident, backend=ast.HeapBackend()):
        pass
    return fn.declared


async def items_of(iterator: Any, limit: int) -> list[Any]:
    """The items of a StateIterator through `async for`, failing once more than `limit`
    came: an iteration that never ends fails its test instead of stalling the suite."""
    items: list[Any] = []
    async for item in iterator:
        items.append(item)
        if len(items) > limit:
            raise AssertionError(f"the iteration goes on past {limit} items")
    return items


async def to_list(future: Any) -> list[Any]:
    """Every item of the iterator a state read (`future`) yields."""
    return list(await (await future).to_list())


# -- names and errors ------------------------------------------------------------------------


def config_error_pattern(option: str, value: Any, rule: str) -> str:
    """The anchored regex of ConfigError's message: ``<option> must be <rule>, got <value!r>``."""
    return rf"^{re.escape(option)} must be {re.escape(rule)}, got {re.escape(repr(value))}$"


# State names RocksDB column families and checkpoints cannot store, with the rule the
# refusal names.
UNSTORABLE_NAMES = [
    pytest.param("a\x00b", "a str without NUL characters", id="nul"),
    pytest.param("\x00", "a str without NUL characters", id="only-nul"),
    pytest.param("count\ud800", "a str that encodes to UTF-8 (it holds a lone surrogate)",
                 id="lone-surrogate"),
]


class StrNames(enum.StrEnum):
    COUNT = "count"


# -- values ----------------------------------------------------------------------------------


def canon(key: Any) -> bytes:
    """The canonical bytes of a key (what every backend identifies keys by)."""
    return bytes(msgpack.packb(key, use_bin_type=True))


def by_key_bytes(entries: list[Any], key: Callable[[Any], Any] = lambda e: e[0]) -> list[Any]:
    """Map entries sorted by the canonical bytes of their user key (order is unspecified)."""
    return sorted(entries, key=lambda e: canon(key(e)))


def normalize(value: Any) -> Any:
    """What a value reads back as: tuples become lists (dict keys excepted)."""
    if isinstance(value, (list, tuple)):
        return [normalize(v) for v in value]
    if isinstance(value, dict):
        return {k: normalize(v) for k, v in value.items()}
    return value


def _float_bits(x: float) -> bytes:
    return struct.pack(">d", x)


def strict_eq(a: Any, b: Any, *, dict_order: bool = True) -> bool:
    """Equality that tells 1, 1.0 and True apart and lists from tuples, and compares floats by
    their bits (-0.0 != 0.0, NaN == NaN). Dicts compare their items in order (msgpack keeps
    it), or by key whatever the order with ``dict_order=False``."""
    if type(a) is not type(b):
        return False
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(strict_eq(x, y, dict_order=dict_order)
                                        for x, y in zip(a, b, strict=True))
    if type(a) is dict:
        if len(a) != len(b):
            return False
        if dict_order:
            return all(strict_eq(ka, kb) and strict_eq(va, vb)
                       for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True))
        by_bits = {canon(k): (k, v) for k, v in b.items()}
        for k, v in a.items():
            other = by_bits.get(canon(k))
            if other is None or not strict_eq(k, other[0]) or \
                    not strict_eq(v, other[1], dict_order=False):
                return False
        return True
    if type(a) is float:
        return _float_bits(a) == _float_bits(b)
    return bool(a == b)
