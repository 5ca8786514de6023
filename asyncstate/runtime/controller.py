"""AsyncExecutionController: orders records per key and batches their state requests.

The controller wires a request buffer, a key accounting unit and an epoch manager around a
`StateExecutor`:

1. A record context becomes *in flight* with its first request or sync point, if capacity
   allows (`max_in_flight`); otherwise its requests wait for capacity, in order.
2. An in-flight context that holds its key sends requests to the active queue (or, with an
   immediate executor, completes them at once; with a caching executor, its cache answers
   the reads it can at once, and writes complete at once while they wait for the store:
   *buffered writes*, at most `max_in_flight` of them); one that does not hold its key
   parks them in the key's blocking queue.
3. The active queue goes out as a batch when it reaches `batch_size`, on the buffer
   timeout, or at once while anyone waits for progress (`wait_until`, drains).
4. When a context's references drop to zero it is disposed: its key passes to the next
   blocked context of that key, its epoch count drops, capacity frees up.

Everything runs on the loop thread. Work that runs user code after a state change (starting
an unblocked record, completing a batch) goes through a trampoline (`post`): one active drain
of pending work at a time, so long same-key queues never grow the stack, and never inside
another asyncio Task's step (work posted from a Task runs from a loop callback).
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final

from asyncstate.backends.base import (
    CachingBackend,
    ExecutorBinding,
    ImmediateExecutor,
    PacedExecutor,
    StateExecutor,
)
from asyncstate.backends.cache import BUFFERED, MISS, StateCache
from asyncstate.config import (
    DEFAULT_ITERATOR_CHUNK_SIZE,
    MAX_ITERATOR_CHUNK_SIZE,
    MAX_MAX_PARALLELISM,
    check_int,
)
from asyncstate.errors import InvalidStateError, RecordTimeoutError
from asyncstate.log import get_logger
from asyncstate.runtime.batch_stats import BatchStats
from asyncstate.runtime.buffer import StateRequestBuffer, TimeoutScheduler
from asyncstate.runtime.context import (
    _CURRENT,
    RecordContext,
    current_context,
    set_current_context,
)
from asyncstate.runtime.epoch import EpochManager
from asyncstate.runtime.future import _DONE, StateFuture, failed_future
from asyncstate.runtime.key_accounting import KeyAccountingUnit
from asyncstate.runtime.occupancy import Occupancy
from asyncstate.runtime.requests import StateRequest, StateRequestType
from asyncstate.serde import NONE_BYTES, canonical_key, key_group_of_bytes

__all__ = ["AsyncExecutionController"]


_set_current: Final = _CURRENT.set  # compiled: Final alias


def _what(state: Any) -> str:
    """How an error message names `state` (None: no particular state)."""
    return "state" if state is None else f"state {getattr(state, 'name', state)!r}"


def _enter_and_run(ctx: RecordContext, run: Callable[[RecordContext], Any]) -> Any:
    _set_current(ctx)
    return run(ctx)


# compiled: Final alias (passed as a value on the hot path)
_ENTER_AND_RUN: Final = _enter_and_run

log = get_logger("asyncstate.controller")

_SYNC_POINT: Final = StateRequestType.SYNC_POINT  # compiled: Final alias
_MISS: Final = MISS  # compiled: Final alias
_BUFFERED: Final = BUFFERED  # compiled: Final alias
_current_task: Final = asyncio.current_task  # compiled: Final alias
_monotonic: Final = time.monotonic  # compiled: Final alias
_get_running_loop: Final = asyncio._get_running_loop  # compiled: Final alias


class AsyncExecutionController:
    """Per-operator coordinator between user code and a `StateExecutor` (see module doc)."""

    def __init__(self, executor: StateExecutor, *, batch_size: object,
                 buffer_timeout_ms: object, max_in_flight: object, max_parallelism: object = 128,
                 iterator_chunk_size: object = DEFAULT_ITERATOR_CHUNK_SIZE,
                 timeout_scheduler: TimeoutScheduler | None = None,
                 time_records: bool = False, record_timeout_ms: object = None) -> None:
        # compiled: typed as object (the limits and the record timeout are ints), so both
        # builds raise check_int's ConfigError.
        self.batch_size = check_int("batch_size", batch_size, 1)
        timeout_ms = check_int("buffer_timeout_ms", buffer_timeout_ms, 0)
        self.max_in_flight = check_int("max_in_flight", max_in_flight, 1)
        self.max_parallelism = check_int("max_parallelism", max_parallelism, 1,
                                         MAX_MAX_PARALLELISM)
        chunk_size = check_int("iterator_chunk_size", iterator_chunk_size, 1,
                               MAX_ITERATOR_CHUNK_SIZE)
        if not isinstance(executor, StateExecutor):
            raise TypeError(f"executor must be a StateExecutor (a state backend), got "
                            f"{type(executor).__name__}")
        timeout_limit = None if record_timeout_ms is None \
            else check_int("record_timeout_ms", record_timeout_ms, 1)
        if timeout_scheduler is not None \
                and not callable(getattr(timeout_scheduler, "call_later", None)):
            raise TypeError(f"timeout_scheduler must have call_later(delay, callback) (an "
                            f"event loop), got {type(timeout_scheduler).__name__}")
        loop = _get_running_loop()
        self._loop = loop
        self._executor = executor
        # Checked once: an immediate executor completes requests at issue time.
        immediate = executor if isinstance(executor, ImmediateExecutor) \
            and executor.completes_at_issue else None
        self._immediate = immediate
        self._immediate_ops = immediate.immediate_ops if immediate is not None else None
        # A cache in front of the executor answers at issue time what it can (checked once).
        cache = executor.state_cache if immediate is None \
            and isinstance(executor, CachingBackend) else None
        if cache is not None:
            cache.serve_at_issue()
        self._cache: StateCache | None = cache
        self._buffered_writes = 0
        # Pacing (checked once): the store's I/O slots' full batches plus one more, in
        # requests; 0 when the executor declares no slots (`store_backlogged`).
        slots = 0
        if immediate is None and isinstance(executor, PacedExecutor):
            io_slots: Callable[[], object] = executor.io_slots  # any object: checked here
            slots = check_int("io_slots", io_slots(), 1)
        self._pace_limit = (slots + 1) * self.batch_size if slots else 0
        self._requests_in_executor = 0
        self._buffer = StateRequestBuffer(timeout_ms, self._on_buffer_timeout,
                                          timeout_scheduler)
        self._kau = KeyAccountingUnit()
        # Note when each context takes its key; with a record timeout, a record that took
        # longer fails the run when it finishes, also if it blocked the loop meanwhile (so
        # the watchdog, which looks at the records still running, never saw it overdue).
        self._time_records = time_records or timeout_limit is not None
        self._record_timeout_ms = timeout_limit
        self._overrun_s = math.inf if timeout_limit is None else timeout_limit / 1000.0
        self._epochs = EpochManager()
        self._in_flight = 0
        self._parked: dict[RecordContext, list[StateRequest]] = {}
        self._pending: deque[tuple[Callable[[Any], Any], Any]] = deque()
        self._running = False
        self._scheduled = False
        # Calls waiting for a predicate; each future's result is None, or the error to raise
        # (passed as a result: compiled code awaiting a failed future loses its traceback).
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future[BaseException | None]]] = []
        self._failure: BaseException | None = None
        # The failure's traceback when it failed the run (down to the user's frame): raised
        # again with it, since compiled code re-raising an awaited exception starts anew.
        self._failure_tb: TracebackType | None = None
        self._failure_listeners: list[Callable[[BaseException], None]] = []
        self._closed = False
        self._in_executor: dict[int, list[StateRequest]] = {}
        # metrics
        self.in_flight_peak = 0
        self.records_done = 0
        self.batches = 0
        self.requests = 0
        self.max_batch_size = 0
        self.batches_in_executor = 0
        self.batch_stats = BatchStats(loop)
        # When measured (KeyedOperator.measure_occupancy): stepped down per finished context.
        self.occupancy: Occupancy | None = None
        executor.open(ExecutorBinding(loop=loop, deliver=self._deliver,
                                      iterator_chunk_size=chunk_size,
                                      max_parallelism=self.max_parallelism))
        log.debug("controller.created", batch_size=self.batch_size,
                  buffer_timeout_ms=timeout_ms, max_in_flight=self.max_in_flight,
                  max_parallelism=self.max_parallelism, executor=type(executor).__name__)

    def __repr__(self) -> str:
        return (f"<AsyncExecutionController in_flight={self._in_flight}/{self.max_in_flight} "
                f"active={self._buffer.active_size} blocking={self._buffer.blocking_size} "
                f"blocked_keys={self._buffer.blocking_key_num} "
                f"occupied_keys={self._kau.occupied_count()}>")

    # -- contexts --------------------------------------------------------------------------

    def build_context(self, record: Any, key: Any, *, key_bytes: bytes | None = None,
                      key_group: int | None = None, timestamp: int | None = None,
                      base_vars: contextvars.Context | None = None,
                      priority: int = 0) -> RecordContext:
        """Wrap a record and its key in a new RecordContext (not yet in flight).

        The context gets its own copy of the contextvars context (of `base_vars`, or of the
        caller's), in which it is the current record context.
        """
        if key_bytes is None:
            key_bytes = canonical_key(key)
        if key_group is None:
            key_group = key_group_of_bytes(key_bytes, self.max_parallelism)
        ctx = RecordContext(record, key, key_bytes, key_group, self.dispose_context, timestamp,
                            priority)
        ctx_vars = base_vars.copy() if base_vars is not None else contextvars.copy_context()
        ctx_vars.run(set_current_context, ctx)
        ctx.vars = ctx_vars
        return ctx

    def set_current_context(self, ctx: RecordContext | None) -> None:
        """Make `ctx` the current record context of the calling code."""
        set_current_context(ctx)

    # -- requests --------------------------------------------------------------------------

    def current(self, state: Any = None) -> RecordContext:
        """The current record context. Outside a record, InvalidStateError; in a record that
        already finished (a task or callback outlived it), InvalidStateError naming the state
        and the key, which also fails the run: the call would otherwise be lost silently."""
        ctx = current_context()
        if ctx is None:
            raise InvalidStateError(
                f"{_what(state)} accessed outside a record: state can only be used while a "
                "record or timer is processed (not in open(), not in a task the record did "
                "not await)")
        if ctx.finished:
            exc = InvalidStateError(
                f"{_what(state)} accessed for the record with key {ctx.key!r} after that record "
                "finished (a task or callback outlived its record): await the task inside "
                "process_element, or do the state calls there")
            self.fail(exc)
            raise exc
        return ctx

    def handle_request(self, state: Any, request_type: StateRequestType, payload: Any,
                       ctx: RecordContext | None = None, ns: bytes | None = None
                       ) -> StateFuture[Any]:
        """Issue a state request; returns its future. It belongs to the current record
        context and uses the namespace that context set for `state`, unless `ctx` and `ns`
        are given (read-modify-write states keep both across their two requests)."""
        if ctx is None:
            ctx = current_context()
            if ctx is None or ctx.finished:
                ctx = self.current(state)
        if ns is None:
            ns = NONE_BYTES if ctx.namespaces is None else ctx.namespaces.get(state, NONE_BYTES)

        if self._closed:
            raise InvalidStateError("state accessed after the operator closed")
        self.requests += 1
        if ctx.key_occupied:
            if self._immediate is not None:
                # Immediate executor: no request object, no pending future.
                try:
                    result = self._execute_now(state, request_type, payload, ctx.key_bytes, ns)
                except Exception as exc:  # noqa: BLE001 - a backend failure fails the run
                    self.fail(exc)
                    return failed_future(exc)
                fut: StateFuture[Any] = StateFuture()  # completed_future, inlined
                fut._state = _DONE
                fut._result = result
                return fut
            cache = self._cache
            if cache is not None:
                try:
                    result = cache.answer(state, request_type, payload, ctx.key_bytes, ns,
                                          ctx.key_group)
                except Exception as exc:  # noqa: BLE001 - a cache failure fails the run
                    self.fail(exc)
                    return failed_future(exc)
                if cache.evicted:
                    self._send_evicted(cache, ctx)
                if result is _BUFFERED:
                    if self._buffered_writes < self.max_in_flight:
                        # The write completes now and goes to the store without holding up
                        # its record (its request's future has no context); it reaches the
                        # store before any later request of its state (see cache.py).
                        self._buffered_writes += 1
                        self._enqueue_active(StateRequest(state, request_type, payload, ns,
                                                          ctx, StateFuture()))
                        result = None
                    else:
                        result = _MISS  # enough writes wait already: this one holds its record
                if result is not _MISS:  # a hit: no request, as with an immediate executor
                    fut = StateFuture()
                    fut._state = _DONE
                    fut._result = result
                    return fut
            fut = StateFuture(ctx)
            self._enqueue_active(StateRequest(state, request_type, payload, ns, ctx, fut))
            return fut
        fut = StateFuture(ctx)
        self._admit(StateRequest(state, request_type, payload, ns, ctx, fut), False)
        return fut

    def namespace_of(self, ctx: RecordContext, state: Any) -> bytes:
        """The namespace bytes `ctx` currently uses for `state`."""
        return NONE_BYTES if ctx.namespaces is None else ctx.namespaces.get(state, NONE_BYTES)

    def sync_point(self, callback: Callable[[], Any], *,
                   allow_overdraft: bool = False) -> StateFuture[Any]:
        """Run callback() once the current context holds its key; a future of its result."""
        ctx = self.current()
        fut: StateFuture[Any] = StateFuture(ctx)
        result = fut.then_apply(lambda _: callback())
        self._admit(StateRequest(None, _SYNC_POINT, None, NONE_BYTES, ctx, fut), allow_overdraft)
        return result

    def start_record(self, ctx: RecordContext, run: Callable[[RecordContext], Any], *,
                     allow_overdraft: bool = False) -> None:
        """Start a record: run(ctx) once it is in flight and holds its key (now, if it can).

        The cheap path of a sync point for operators: when capacity and the key are free,
        run(ctx) is called at once inside the record's contextvars context (where it becomes
        the current record), with no future or request created. `run` is called with a
        reference held on `ctx`.
        """
        if not ctx.in_flight and ctx.epoch is None and not self._parked \
                and self._failure is None and (
                allow_overdraft or self._in_flight < self.max_in_flight):
            self._enter_flight(ctx)
            if self._occupy(ctx):
                ctx.ref_count += 1
                ctx.entered = True
                try:
                    ctx.vars.run(_ENTER_AND_RUN, ctx, run)  # type: ignore[union-attr]
                finally:
                    # Also when KeyboardInterrupt or SystemExit leaves `run`: the record's
                    # code is over, so its reference goes (its failure was noted).
                    ctx.entered = False
                    ctx.ref_count -= 1
                    if ctx.ref_count == 0:
                        self.dispose_context(ctx)
                return
        self._start_later(ctx, run, allow_overdraft)

    def _start_later(self, ctx: RecordContext, run: Callable[[RecordContext], Any],
                     allow_overdraft: bool) -> None:
        # Apart from start_record: a compiled function allocates the closure of its lambda
        # at every call, also when the lambda is not reached.
        # The sync-point future holds a reference while its hook runs. It fails only when
        # the controller closes first: then the record never starts.
        fut: StateFuture[Any] = StateFuture(ctx)
        fut._add_hook(lambda f: _enter_and_run(ctx, run) if f._state == _DONE else None)
        self._admit(StateRequest(None, _SYNC_POINT, None, NONE_BYTES, ctx, fut), allow_overdraft)

    def set_namespace(self, state: Any, namespace: Any) -> None:
        """Set the namespace the current record uses for `state` (None: the default)."""
        ctx = self.current(state)
        ns_bytes = canonical_key(namespace, "namespace", getattr(state, "name", None))
        if ctx.namespaces is None:
            ctx.namespaces = {}
        ctx.namespaces[state] = ns_bytes

    def _admit(self, request: StateRequest, allow_overdraft: bool) -> None:
        ctx = request.context
        if not ctx.in_flight:
            if ctx.epoch is None:
                # A context belongs to the epoch of its first request, parked or not.
                ctx.epoch = self._epochs.on_record()
            parked = self._parked.get(ctx)
            if parked is not None:
                parked.append(request)
                return
            if not allow_overdraft and (self._parked or self._in_flight >= self.max_in_flight):
                # Parked contexts are admitted first come, first served.
                self._parked[ctx] = [request]
                return
            self._enter_flight(ctx)
        if ctx.key_occupied or self._occupy(ctx):
            self._insert_active(request)
        else:
            self._buffer.enqueue_to_blocking(request)

    def _enter_flight(self, ctx: RecordContext) -> None:
        ctx.in_flight = True
        if ctx.epoch is None:
            ctx.epoch = self._epochs.on_record()
        in_flight = self._in_flight = self._in_flight + 1
        if in_flight > self.in_flight_peak:
            self.in_flight_peak = in_flight

    def _occupy(self, ctx: RecordContext) -> bool:
        if self._kau.occupy(ctx, ctx.key_bytes):
            ctx.key_occupied = True
            if self._time_records:
                ctx.started_at = _monotonic()
            return True
        return False

    def _overran(self, ctx: RecordContext, elapsed: float) -> None:
        timeout_ms = self._record_timeout_ms
        assert timeout_ms is not None
        self.fail(RecordTimeoutError(ctx.key, timeout_ms, round(elapsed * 1000),
                                     finished=True))

    def overdue_context(self, started_before: float) -> RecordContext | None:
        """A context that has held its key since before `started_before` (a time.monotonic()
        value), or None; only with `time_records`."""
        for ctx in self._kau.holders():
            if ctx.started_at < started_before:
                return ctx  # type: ignore[no-any-return]
        return None

    def _insert_active(self, request: StateRequest) -> None:
        if request.request_type is _SYNC_POINT:
            failure = self._failure
            if failure is None:
                request.future._complete(None)
            else:
                # Once the run failed no record or timer firing starts: its start fails.
                request.future._observed = True
                request.future._fail(failure)
            return
        if self._immediate is not None:
            try:
                result = self._execute_now(request.state, request.request_type, request.payload,
                                           request.context.key_bytes, request.namespace)
            except Exception as exc:  # noqa: BLE001 - a backend failure fails the run
                self.fail(exc)
                request.future._fail(exc)
                return
            request.future._complete(result)
            return
        cache = self._cache
        if cache is not None:
            try:
                result = cache.answer(request.state,  # type: ignore[arg-type]
                                      request.request_type, request.payload,
                                      request.context.key_bytes, request.namespace,
                                      request.context.key_group)
            except Exception as exc:  # noqa: BLE001 - a cache failure fails the run
                self.fail(exc)
                request.future._fail(exc)
                return
            if cache.evicted:
                self._send_evicted(cache, request.context)
            if result is not _MISS and result is not _BUFFERED:
                request.future._complete(result)
                return
        self._enqueue_active(request)

    def _execute_now(self, state: Any, request_type: StateRequestType, payload: Any,
                     key_bytes: bytes, ns: bytes) -> Any:
        """Run one request on the immediate executor (its operation table when it has one)."""
        op = self._immediate_ops[request_type] if self._immediate_ops is not None else None
        if op is not None:
            return op(state.handle, key_bytes, ns, payload)
        assert self._immediate is not None  # only called for an immediate executor
        return self._immediate.execute_one(state, request_type, payload, key_bytes, ns)

    def _send_evicted(self, cache: StateCache, ctx: RecordContext) -> None:
        """Send the writes of the dirty entries a write-back cache evicted, ahead of the
        request being issued. Each completes without holding up a record while fewer than
        max_in_flight such writes wait; beyond that it holds `ctx`'s record until applied."""
        for request in cache.take_evicted():
            if self._buffered_writes < self.max_in_flight:
                self._buffered_writes += 1
            else:
                request.future = StateFuture(ctx)
            self._enqueue_active(request)

    def writes_applied(self) -> bool:
        """True once the store has applied every buffered write and a write-back cache
        holds none back; else sends what the cache holds back (they complete like buffered
        writes) and returns False."""
        cache = self._cache
        if cache is not None and cache.dirty:
            for request in cache.take_writes():
                self._buffered_writes += 1
                self._enqueue_active(request)
        return self._buffered_writes == 0

    def _enqueue_active(self, request: StateRequest) -> None:
        """Queue a request of a key-holding record; send a batch when it is full."""
        if self._buffer.enqueue_to_active(request) >= self.batch_size:
            self._trigger()
        elif self._waiters and not self._running and not self._scheduled:
            # Issued outside the trampoline (from a record's Task) while someone waits for
            # progress: a trampoline pass sends it, together with its neighbours.
            self._ensure_run()

    # -- batches ---------------------------------------------------------------------------

    def trigger_if_needed(self, force: bool) -> bool:
        """Send a batch if the active queue reached batch_size (or, forced, if non-empty)."""
        size = self._buffer.active_size
        if not size or (not force and size < self.batch_size):
            return False
        self._trigger()
        return True

    def _trigger(self) -> None:
        buffer = self._buffer
        batch = buffer.pop_active(self.batch_size)
        buffer.advance_seq()
        self.batches += 1
        self.batches_in_executor += 1
        self._requests_in_executor += len(batch)
        self._in_executor[id(batch)] = batch
        if len(batch) > self.max_batch_size:
            self.max_batch_size = len(batch)
        self.batch_stats.sent(batch)
        try:
            self._executor.execute_batch(batch)
        except Exception as exc:  # noqa: BLE001 - a broken executor fails the run
            self._fail_batch(batch, exc)

    def store_backlogged(self, incoming: int) -> bool:
        """True while a `PacedExecutor`'s store has enough to do: the requests in the
        executor and waiting to be sent, plus `incoming` (records admitted and not yet
        started, one request each), fill its I/O slots with full batches and one more.
        Records admitted beyond that would wait for a slot (their objects going cold in the
        CPU caches meanwhile) and add no throughput. Always False for other executors."""
        limit = self._pace_limit
        return limit > 0 and (self._requests_in_executor + self._buffer.active_size
                              + incoming >= limit)

    def _fail_batch(self, batch: list[StateRequest], exc: BaseException) -> None:
        """Fail the run with `exc` and every request of `batch` with it."""
        if id(batch) in self._in_executor:
            self._left_executor(batch)
        self.batch_stats.dropped(batch)
        self.fail(exc)
        for request in batch:
            fut = request.future
            if fut._ctx is None:  # a buffered write
                self._buffered_writes -= 1
            if not fut.done():
                fut._observed = True
                fut._fail(exc)

    def _left_executor(self, batch: list[StateRequest]) -> None:
        """`batch`, under way, is no longer: delivered, or failed."""
        del self._in_executor[id(batch)]
        self.batches_in_executor -= 1
        self._requests_in_executor -= len(batch)

    def _flush(self) -> None:
        # Send what waits, but while every I/O slot is busy keep a partial batch back: it
        # grows until a slot frees, and the delivery that frees it runs this again.
        buffer = self._buffer
        while buffer.active_size and (buffer.active_size >= self.batch_size
                                      or not self._executor.fully_loaded()):
            self._trigger()

    def _on_buffer_timeout(self, seq: int) -> None:
        if seq == self._buffer.current_seq and self._failure is None:
            self.trigger_if_needed(True)

    def _deliver(self, batch: list[StateRequest], results: list[Any] | None,
                 error: BaseException | None) -> None:
        self.post(self._complete_batch, (batch, results, error))

    def _complete_batch(self, outcome: tuple[list[StateRequest], list[Any] | None,
                                             BaseException | None]) -> None:
        batch, results, error = outcome
        if self._in_executor.get(id(batch)) is not batch:
            if not self._closed:  # after close, its futures were already failed
                self.fail(error if error is not None else InvalidStateError(
                    "the executor delivered a batch that is not under way (one it was never "
                    "given, or one delivered twice)"))
            return
        if error is not None or results is None:
            self._fail_batch(batch, error if error is not None else InvalidStateError(
                "executor delivered no results"))
            return
        if len(results) != len(batch):
            self._fail_batch(batch, InvalidStateError(
                f"executor delivered {len(results)} results for a batch of {len(batch)}"))
            return
        self._left_executor(batch)
        self.batch_stats.delivered(batch)
        escaped: BaseException | None = None
        for i in range(len(batch)):  # compiled: index loop (lengths checked above)
            fut = batch[i].future
            if fut._ctx is None:  # only buffered writes have no context
                self._buffered_writes -= 1
            try:
                fut._complete(results[i])
            except BaseException as exc:  # noqa: BLE001 - raised below, after the rest
                # A callback let a BaseException through: the batch's other futures still
                # complete, so no record waits forever for its result.
                if escaped is None:
                    escaped = exc
        if escaped is not None:
            raise escaped

    # -- disposal --------------------------------------------------------------------------

    def dispose_context(self, ctx: RecordContext) -> None:
        """A context's references reached zero while it held its key: the record is done.
        Its key passes to the next blocked context, its epoch counts it done, and its
        capacity frees up (Flink's disposeContext)."""
        if self._time_records:
            elapsed = _monotonic() - ctx.started_at
            if elapsed > self._overrun_s:
                self._overran(ctx, elapsed)
        ctx.key_occupied = False
        ctx.finished = True
        # The context and its contextvars copy refer to each other; breaking the cycle
        # here frees both by reference counting instead of the cyclic GC.
        ctx.vars = None
        if ctx.failures is not None:
            failure = ctx.unobserved_failure()
            if failure is not None:
                self.fail(failure)
        key = ctx.key_bytes
        self._kau.release(ctx, key)
        self._in_flight -= 1
        ctx.in_flight = False
        if ctx.time_domain is None:  # a record, not a timer firing
            self.records_done += 1
            occupancy = self.occupancy
            if occupancy is not None:
                occupancy.step(-1)
        buffer = self._buffer
        # Hand the key to the next blocked context now, so nobody can jump the queue, and
        # run its work from the trampoline. It takes the key with all its blocked requests,
        # also those queued behind another context's (it may need them to finish at all).
        nxt = buffer.peek_blocked(key)
        if nxt is not None:
            holder = nxt.context
            self._occupy(holder)
            self.post(self._activate, buffer.unblock_all_of(key, holder))
        if self._parked and self._in_flight < self.max_in_flight:
            self.post(self._admit_parked, None)
        epoch = ctx.epoch
        if epoch is not None:
            self._epochs.complete_one_record(epoch)
        if not self._running and not self._scheduled:
            self._ensure_run()

    def _activate(self, requests: list[StateRequest]) -> None:
        for request in requests:
            self._insert_active(request)

    def _admit_parked(self, _: Any) -> None:
        parked = self._parked
        while parked and self._in_flight < self.max_in_flight:
            ctx = next(iter(parked))
            requests = parked.pop(ctx)
            self._enter_flight(ctx)
            for request in requests:
                self._admit(request, True)

    # -- trampoline ------------------------------------------------------------------------

    def post(self, fn: Callable[[Any], Any], arg: Any) -> None:
        """Run fn(arg) from the trampoline: now if nothing runs and we are not inside a Task
        step, otherwise after the current work (or from a loop callback)."""
        self._pending.append((fn, arg))
        if not self._running and not self._scheduled:
            self._ensure_run()

    def _ensure_run(self) -> None:
        loop = _get_running_loop()
        if loop is not None and _current_task(loop) is not None:
            self._schedule_run(loop)
        else:
            self._run()

    def _schedule_run(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._run_scheduled)

    def _run_scheduled(self) -> None:
        self._scheduled = False
        if not self._running:
            self._run()

    def _run(self) -> None:
        self._running = True
        pending = self._pending
        try:
            while True:
                while pending:
                    fn, arg = pending.popleft()
                    try:
                        fn(arg)
                    except BaseException as exc:
                        # Raised by user code (a callback), CancelledError included: that is
                        # not a cancellation of this loop callback, and it fails the run as
                        # an async def record's exceptions do. KeyboardInterrupt and
                        # SystemExit also propagate; the run has failed all the same, so if
                        # the loop goes on nobody waits for the record they interrupted.
                        self.fail(exc)
                        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                            raise
                if self._waiters:
                    self._check_waiters()
                if not pending:
                    break
        finally:
            self._running = False
            if pending:
                # KeyboardInterrupt or SystemExit propagates; what is left runs later, if
                # the loop goes on, instead of waiting for the next post.
                loop = _get_running_loop()
                if loop is not None:
                    self._schedule_run(loop)

    # -- waiting ---------------------------------------------------------------------------

    def _check_waiters(self) -> None:
        remaining = []
        for predicate, fut in self._waiters:
            if fut.done():
                continue
            if self._failure is not None:
                fut.set_result(self._failure)
            elif predicate():
                fut.set_result(None)
            else:
                remaining.append((predicate, fut))
        self._waiters = remaining
        if remaining and self._failure is None:
            self._flush()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until predicate() holds, sending partial batches meanwhile; raises the
        run's failure if there is one."""
        failure = self._failure
        if failure is not None:
            raise failure.with_traceback(self._failure_tb)  # as it failed, from user code
        if not self._pending and predicate():
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[BaseException | None] = loop.create_future()
        self._waiters.append((predicate, fut))
        self._flush()
        if not self._running and self._pending:
            self._ensure_run()
        elif not self._running:
            self._check_waiters()
        error = await fut
        if error is not None:
            if error is self._failure:
                error = error.with_traceback(self._failure_tb)  # as it failed, from user code
            raise error

    async def drain_inflight_records(self, target: int) -> None:
        """Wait until at most `target` (>= 0) contexts are in flight."""
        check_int("target", target, 0)
        await self.wait_until(lambda: self._in_flight <= target)

    # -- failure ---------------------------------------------------------------------------

    @property
    def failure(self) -> BaseException | None:
        """The first failure of the run, or None."""
        return self._failure

    def add_failure_listener(self, listener: Callable[[BaseException], None]) -> None:
        """Call listener(exc) once when the run fails."""
        self._failure_listeners.append(listener)

    def fail(self, exc: BaseException) -> None:
        """Fail the run with `exc` (the first failure wins) and wake every waiter."""
        if self._failure is not None:
            return
        self._failure = exc
        self._failure_tb = exc.__traceback__
        log.debug("controller.failed", error=repr(exc))
        for _, fut in self._waiters:
            if not fut.done():
                fut.set_result(exc)
        self._waiters = []
        for listener in self._failure_listeners:
            listener(exc)

    def close(self) -> None:
        """Cancel the buffer timeout and fail every request still outstanding (queued,
        blocked, parked or in the executor) so that nothing waits on them forever. The
        executor is closed by its owner. A KeyboardInterrupt or SystemExit that a record
        resumed by a failed future raises is raised once every future is failed."""
        if self._closed:
            return
        self._closed = True
        self._buffer.close()
        exc = self._failure if self._failure is not None else InvalidStateError(
            "the operator closed while this state request was outstanding")
        requests = self._buffer.drain_active()
        for batch in self._in_executor.values():
            requests.extend(batch)
        self._in_executor.clear()
        self._requests_in_executor = 0
        self.batch_stats.clear()
        for parked in self._parked.values():
            requests.extend(parked)
        self._parked.clear()
        requests.extend(self._buffer.drain_blocked())
        # Failing a future resumes the records waiting on it at once: one that raises a
        # KeyboardInterrupt or SystemExit (as from an asyncio Task's step) is raised after
        # every other future and waiter has been failed too.
        raised: BaseException | None = None
        for request in requests:
            fut = request.future
            if not fut.done():
                fut._observed = True
                try:
                    fut._fail(exc)
                except BaseException as interrupt:  # noqa: BLE001 - raised below
                    if raised is None:
                        raised = interrupt
        # Calls still waiting in other tasks (a drain, a watermark) end now rather than wait
        # for records that will never finish.
        waiters, self._waiters = self._waiters, []
        for _, waiter in waiters:
            if not waiter.done():
                waiter.set_result(self._failure if self._failure is not None else
                                     InvalidStateError("the operator closed before this call "
                                                       "returned"))
        if raised is not None:
            raise raised

    # -- gauges ----------------------------------------------------------------------------

    @property
    def in_flight_record_num(self) -> int:
        """Contexts in flight (from their first request until their references reach 0)."""
        return self._in_flight

    @property
    def active_queue_size(self) -> int:
        """Requests waiting in the active queue for the next batch."""
        return self._buffer.active_size

    @property
    def blocking_queue_size(self) -> int:
        """Requests waiting for their key."""
        return self._buffer.blocking_size

    @property
    def blocking_key_num(self) -> int:
        """Keys with waiting requests."""
        return self._buffer.blocking_key_num

    @property
    def occupied_key_num(self) -> int:
        """Keys held by a record."""
        return self._kau.occupied_count()

    @property
    def buffered_writes(self) -> int:
        """Writes completed at issue time that the store has not applied yet (see step 2)."""
        return self._buffered_writes

    @property
    def state_cache(self) -> StateCache | None:
        """The executor's cache when it answers at issue time, else None."""
        return self._cache

    @property
    def parked_context_num(self) -> int:
        """Contexts waiting for capacity."""
        return len(self._parked)

    @property
    def epoch_manager(self) -> EpochManager:
        """The epoch manager (non-record events)."""
        return self._epochs

    @property
    def buffer(self) -> StateRequestBuffer:
        """The request buffer."""
        return self._buffer
