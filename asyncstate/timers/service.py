"""TimerService: an operator's event-time and processing-time timers, fired under their keys.

Each firing is a record of its own: a context for the timer's key (its record is the timer,
its timestamp the timer's, `time_domain` says which), started as a sync point on the key with
overdraft (Flink's timer firing), so one key's timers run one after another and in order
with that key's records, while timers of different keys overlap; `on_timer` may use state,
emit, and register or delete timers.

- Event time: `fire_event_time(watermark)` (the trigger action of a watermark's epoch) starts
  every timer due at the watermark, in timestamp order; they join the finishing epoch, so the
  advance returns once they (and their state work) are done. A timer that a firing
  registers for a time the watermark already covers fires within the same advance; one a
  record registers behind the watermark fires at the next advance.
- Processing time: with a ManualClock, `fire_processing_time(now)` on the advance; with the
  wall clock, a loop timer wakes the service when the earliest timer is due.

The operator's own timers (TTL cleanup, `register_internal`) share the queues, the firing order
and the checkpoints with the user's. Their namespaces are msgpack maps, which no user
namespace can be (dicts are not keys), so they never collide with user timers; the record
runner hands their firings to the operator instead of `on_timer` (`is_internal_namespace`).

Timers go into checkpoints per key group (sections `SECTION_EVENT_TIMERS` and
`SECTION_PROCESSING_TIMERS`, each timer in its byte form) and come back with their key group
on restore, whatever the parallelism.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

from asyncstate.clock import Clock, ManualClock
from asyncstate.errors import InvalidStateError
from asyncstate.function import TimeDomain
from asyncstate.keygroups import KeyGroupRange
from asyncstate.runtime.context import RecordContext
from asyncstate.runtime.epoch import Epoch
from asyncstate.serde import NONE_BYTES, canonical_key, decode_key
from asyncstate.timers.base import KeyGroupedInternalPriorityQueue
from asyncstate.timers.heap_set import HeapPriorityQueueSet
from asyncstate.timers.partitioned import KeyGroupPartitionedPriorityQueue
from asyncstate.timers.timer import InternalTimer, decode_timer, encode_timer

__all__ = [
    "SECTION_EVENT_TIMERS",
    "SECTION_PROCESSING_TIMERS",
    "TimerService",
    "TimerServiceView",
    "is_internal_namespace",
    "timer_namespace",
    "timer_queue",
]

SECTION_EVENT_TIMERS: Final = 1
SECTION_PROCESSING_TIMERS: Final = 2

# The first byte of a msgpack map of up to 15 entries: what internal namespaces start with.
_FIXMAP_FIRST: Final = 0x80
_FIXMAP_LAST: Final = 0x8F

TimerQueue = KeyGroupedInternalPriorityQueue[InternalTimer]
StartTimer = Callable[[RecordContext], None]


class TimerService:
    """The timers of one operator (see the module docstring).

    `event_queue` and `processing_queue` hold the timers; `make_context(timer, domain)`
    builds the firing's context and `start(ctx)` starts it under its key; `watermark()` is the
    operator's current watermark."""

    __slots__ = ("_clock", "_due_event", "_due_processing", "_event", "_firing", "_loop",
                 "_make_context", "_owner", "_processing", "_start", "_wake_at", "_wakeup",
                 "_watermark")

    def __init__(self, event_queue: TimerQueue, processing_queue: TimerQueue, *,
                 make_context: Callable[[InternalTimer, TimeDomain], RecordContext],
                 start: StartTimer, watermark: Callable[[], int], clock: Clock,
                 loop: asyncio.AbstractEventLoop, owner: str | None) -> None:
        self._owner = owner  # the function's class name when it has no on_timer, else None
        self._event = event_queue
        self._processing = processing_queue
        self._make_context = make_context
        self._start = start
        self._watermark = watermark
        self._clock = clock
        self._loop = loop
        self._wakeup: asyncio.TimerHandle | None = None
        self._wake_at: int | None = None
        self._firing = False  # inside _fire: it picks up timers registered meanwhile
        # Timers taken off their queue to fire whose on_timer has not begun (a firing waits
        # for its key): to registering and deleting they are still pending, as they would
        # be in a synchronous timer service, which takes a timer off only to fire it.
        self._due_event: set[InternalTimer] = set()
        self._due_processing: set[InternalTimer] = set()

    def __repr__(self) -> str:
        return (f"<TimerService event={len(self._event)} processing={len(self._processing)} "
                f"watermark={self._watermark()}>")

    # -- registering (through a record's ctx.timer_service) -------------------------------

    def register(self, ctx: RecordContext, domain: TimeDomain, timestamp: object,
                 namespace: object) -> None:
        """Register a timer for `ctx`'s key; an equal one registered before is kept once."""
        if self._owner is not None:
            raise InvalidStateError(
                f"{self._owner} registers a timer but has no on_timer(timestamp, ctx) to fire "
                "it; define on_timer (plain or async def)")
        self._add(ctx, domain, self._timer(ctx, timestamp, namespace))

    def register_internal(self, ctx: RecordContext, domain: TimeDomain, timestamp: int,
                          namespace_bytes: bytes) -> None:
        """Register an operator's own timer (see the module docstring) for `ctx`'s key:
        `namespace_bytes` must satisfy `is_internal_namespace`. It needs no on_timer."""
        assert is_internal_namespace(namespace_bytes)
        self._add(ctx, domain, InternalTimer(timestamp, ctx.key, ctx.key_bytes,
                                             namespace_bytes, ctx.key_group))

    def _add(self, ctx: RecordContext, domain: TimeDomain, timer: InternalTimer) -> None:
        """Queue `timer`, registered by `ctx`, unless its firing is on its way. Registered by
        a firing of an advance under way (a watermark's, or a ManualClock's), for a time the
        advance covers, after it started its due timers: it starts now, and the advance waits
        for it as for the firing that registered it (with the wall clock the wakeup fires a
        due processing-time timer)."""
        if timer in self._due(domain):
            return
        if domain is TimeDomain.EVENT_TIME:
            self._event.add(timer)
            if (ctx.time_domain is TimeDomain.EVENT_TIME and not self._firing
                    and timer.timestamp <= self._watermark()):
                self._fire(self._event, self._watermark(), domain, ctx.epoch)
        elif self._processing.add(timer):
            clock = self._clock
            if (isinstance(clock, ManualClock) and ctx.time_domain is domain
                    and not self._firing and timer.timestamp <= clock.now_ms()):
                self._fire(self._processing, clock.now_ms(), domain, ctx.epoch)
            self._schedule_wakeup()

    def delete(self, ctx: RecordContext, domain: TimeDomain, timestamp: object,
               namespace: object) -> None:
        """Delete `ctx`'s key's timer of that time and namespace (nothing if there is none)."""
        timer = self._timer(ctx, timestamp, namespace)
        due = self._due(domain)
        if timer in due:
            due.discard(timer)  # its firing, on its way, runs no on_timer (see `claim`)
            return
        if domain is TimeDomain.EVENT_TIME:
            self._event.remove(timer)
        elif self._processing.remove(timer):
            self._schedule_wakeup()

    def _timer(self, ctx: RecordContext, timestamp: object,
               namespace: object) -> InternalTimer:
        ns = NONE_BYTES if namespace is None else canonical_key(namespace, "timer namespace")
        return InternalTimer(timestamp, ctx.key, ctx.key_bytes, ns, ctx.key_group)

    # -- firing ----------------------------------------------------------------------------

    def fire_event_time(self, watermark: int) -> None:
        """Start every event-time timer due at `watermark`, in timestamp order."""
        self._fire(self._event, watermark, TimeDomain.EVENT_TIME)

    def fire_processing_time(self, now: int) -> None:
        """Start every processing-time timer due at `now`, in timestamp order."""
        self._fire(self._processing, now, TimeDomain.PROCESSING_TIME)
        self._schedule_wakeup()

    def _fire(self, queue: TimerQueue, time: int, domain: TimeDomain,
              epoch: Epoch | None = None) -> None:
        # One timer at a time, from the head: a firing that runs at once (its key is free)
        # and registers a due timer has it started next, in timestamp order, as a
        # synchronous timer service would. `epoch`: the epoch of the firing that registered
        # the due timers, while it finishes: the firings join it (its advance waits for them).
        if self._firing:
            return
        self._firing = True
        try:
            while True:
                head = queue.peek()
                if head is None or head.timestamp > time:
                    return
                queue.poll()
                self._due(domain).add(head)
                ctx = self._make_context(head, domain)
                if epoch is not None and epoch.join_while_finishing():
                    ctx.epoch = epoch  # counted in it: the controller keeps it
                self._start(ctx)
        finally:
            self._firing = False

    def _due(self, domain: TimeDomain) -> set[InternalTimer]:
        return self._due_event if domain is TimeDomain.EVENT_TIME else self._due_processing

    def claim(self, timer: InternalTimer, domain: TimeDomain) -> bool:
        """A firing of `timer` begins (its key is held): True to run it, False when the timer
        was deleted since it was taken off its queue. From now on, registering an equal
        timer registers a new one."""
        due = self._due(domain)
        if timer in due:
            due.discard(timer)
            return True
        return False

    def _schedule_wakeup(self) -> None:
        """With the wall clock, wake up when the earliest processing-time timer is due."""
        clock = self._clock
        if isinstance(clock, ManualClock):
            return  # advance_processing_time fires them
        head = self._processing.peek()
        due = None if head is None else head.timestamp
        if due == self._wake_at:
            return
        if self._wakeup is not None:
            self._wakeup.cancel()
            self._wakeup = None
        self._wake_at = due
        if due is not None:
            delay = max(0.0, (due - clock.now_ms()) / 1000.0)
            self._wakeup = self._loop.call_later(delay, self._wake)

    def _wake(self) -> None:
        self._wakeup = None
        self._wake_at = None
        self.fire_processing_time(self._clock.now_ms())

    def current_watermark(self) -> int:
        """The operator's current event-time watermark."""
        return self._watermark()

    def current_processing_time(self) -> int:
        """The operator clock's time in milliseconds."""
        return self._clock.now_ms()

    def close(self) -> None:
        """Stop waking up for processing-time timers (those pending are dropped)."""
        if self._wakeup is not None:
            self._wakeup.cancel()
            self._wakeup = None

    # -- checkpoints -----------------------------------------------------------------------

    def snapshot_sections(self, key_group: int) -> list[tuple[int, Sequence[Any]]]:
        """The timers of `key_group`, as checkpoint sections."""
        return [(tag, [encode_timer(t) for t in sorted(
                    queue.get_subset_for_key_group(key_group), key=encode_timer)])
                for tag, queue in ((SECTION_EVENT_TIMERS, self._event),
                                   (SECTION_PROCESSING_TIMERS, self._processing))]

    def section_handlers(self) -> dict[int, Callable[[int, list[Any]], None]]:
        """Restore handlers of the timer sections."""
        return {SECTION_EVENT_TIMERS: self._restore_event,
                SECTION_PROCESSING_TIMERS: self._restore_processing}

    def _restore_event(self, key_group: int, records: list[Any]) -> None:
        self._event.add_all(_decoded(key_group, records))

    def _restore_processing(self, key_group: int, records: list[Any]) -> None:
        self._processing.add_all(_decoded(key_group, records))
        self._schedule_wakeup()


def timer_queue(store: Any, key_groups: KeyGroupRange, max_parallelism: int) -> TimerQueue:
    """The queue of one time domain over `key_groups`: a heap set in memory when `store` is
    None, else one RocksDB set per key group in `store`, joined by their heads."""
    if store is None:
        return HeapPriorityQueueSet(key_groups, max_parallelism)
    # Imported here: it needs rocksdict, an optional dependency (a store comes only from
    # RocksDBBackend, which needs it too).
    from asyncstate.timers.rocksdb_set import RocksDBPriorityQueueSet

    return KeyGroupPartitionedPriorityQueue(
        lambda key_group: RocksDBPriorityQueueSet(store, key_group), key_groups,
        max_parallelism)


def _decoded(key_group: int, records: Iterable[Any]) -> list[InternalTimer]:
    timers = [decode_timer(r) for r in records]
    for timer in timers:
        if timer.key_group != key_group:
            raise ValueError(f"a timer of key group {timer.key_group} in the section of key "
                             f"group {key_group}")
    return timers


class TimerServiceView:
    """`ctx.timer_service`: the timers of the current record's key. Timestamps are typed as
    object, so that the compiled build raises the errors naming them (an int, not a bool,
    of milliseconds), not its own."""

    __slots__ = ("_ctx", "_service")

    def __init__(self, service: TimerService, ctx: RecordContext) -> None:
        self._service = service
        self._ctx = ctx

    def __repr__(self) -> str:
        return f"<TimerService of key {self._ctx.key!r}>"

    def _live(self) -> RecordContext:
        ctx = self._ctx
        if ctx.finished:
            raise InvalidStateError(
                f"the timer service of the record with key {ctx.key!r} was used after that "
                "record finished; use ctx.timer_service only inside its own process_element "
                "or on_timer")
        return ctx

    def register_event_time_timer(self, timestamp: object, namespace: Any = None) -> None:
        """Fire on_timer for this key once the watermark reaches `timestamp` (ms)."""
        self._service.register(self._live(), TimeDomain.EVENT_TIME, timestamp, namespace)

    def register_processing_time_timer(self, timestamp: object, namespace: Any = None) -> None:
        """Fire on_timer for this key once processing time reaches `timestamp` (ms)."""
        self._service.register(self._live(), TimeDomain.PROCESSING_TIME, timestamp, namespace)

    def delete_event_time_timer(self, timestamp: object, namespace: Any = None) -> None:
        """Delete this key's event-time timer for `timestamp` (nothing if there is none)."""
        self._service.delete(self._live(), TimeDomain.EVENT_TIME, timestamp, namespace)

    def delete_processing_time_timer(self, timestamp: object, namespace: Any = None) -> None:
        """Delete this key's processing-time timer for `timestamp` (nothing if none)."""
        self._service.delete(self._live(), TimeDomain.PROCESSING_TIME, timestamp, namespace)

    def current_watermark(self) -> int:
        """The operator's current event-time watermark (-2**63 before the first)."""
        return self._service.current_watermark()

    def current_processing_time(self) -> int:
        """The operator clock's time in milliseconds."""
        return self._service.current_processing_time()


def is_internal_namespace(namespace_bytes: bytes) -> bool:
    """True for the namespace of an operator's own timer (a msgpack map: never a user's)."""
    return len(namespace_bytes) > 0 and \
        _FIXMAP_FIRST <= namespace_bytes[0] <= _FIXMAP_LAST


def timer_namespace(ctx: RecordContext) -> Any:
    """The namespace of the timer `ctx` fires (None for the default namespace)."""
    timer = ctx.record
    if not isinstance(timer, InternalTimer):
        return None
    return None if timer.namespace_bytes == NONE_BYTES \
        else decode_key(timer.namespace_bytes, True)

