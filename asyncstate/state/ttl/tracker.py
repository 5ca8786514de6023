"""`TtlTracker`: what a backend needs to clean one TTL state up, and a lower bound on the
expiration of every entry it stores.

The bound lets every cleanup strategy skip its work while nothing can have expired: a check
of ``now >= bound`` instead of a scan. It holds because

1. every write of the state lowers it to the write's expiration (`wrote`; a read that
   refreshes its entries counts as a write of its access time);
2. a cleanup pass (an incremental cursor or the background cleaner going once over the whole
   state) learns the smallest expiration among the entries it kept, and the smallest one
   written while it ran; when it ends, the bound rises to the smaller of the two
   (`end_pass`): every entry then stored was either seen by the pass or written during it;
3. entries the tracker cannot know about (restored from a checkpoint, migrated, left in a
   RocksDB directory by an earlier run) start it at MIN_TIMESTAMP: "anything may have
   expired", until a pass ends.
"""

from __future__ import annotations

from typing import Final, Protocol

from asyncstate.state.ttl.layout import MAX_TIMESTAMP, MIN_TIMESTAMP

__all__ = ["CleanupPass", "TimeSource", "TtlTracker"]

_MAX: Final = MAX_TIMESTAMP
_MIN: Final = MIN_TIMESTAMP


class TimeSource(Protocol):
    """"now" of a TTL state outside any record: the operator's clock (processing time) or
    its current watermark (event time). Background cleaners may call it from their thread."""

    def now(self) -> int:
        """The current time in the state's time characteristic, in milliseconds."""


class CleanupPass:
    """One pass of a cleanup strategy over a whole state: the smallest expiration among the
    entries it kept so far, and among the entries written since it began."""

    __slots__ = ("kept", "written")

    def __init__(self) -> None:
        self.kept = _MAX
        self.written = _MAX

    def keep(self, expiration: int) -> None:
        """The pass kept an entry that expires at `expiration`."""
        if expiration < self.kept:
            self.kept = expiration


class TtlTracker:
    """One TTL state as its backend's cleanup sees it (see the module docstring).

    `domain` is the time characteristic's value ("processing_time" or "event_time"), `time`
    the state's `TimeSource`, `full_snapshot` whether checkpoints leave expired entries out,
    `background_every` the background cleaner's query_time_after_num_entries (0: the cleaner
    leaves the state alone).
    """

    __slots__ = ("_passes", "background_every", "bound", "domain", "full_snapshot", "name",
                 "passing", "time", "ttl_ms")

    def __init__(self, name: str, ttl_ms: int, domain: str, time: TimeSource, *,
                 full_snapshot: bool, background_every: int, bound: int) -> None:
        self.name = name
        self.ttl_ms = ttl_ms
        self.domain = domain
        self.time = time
        self.full_snapshot = full_snapshot
        self.background_every = background_every
        self.bound = bound
        self._passes: list[CleanupPass] = []
        self.passing = False  # a pass is under way (writes must tell it)

    def __repr__(self) -> str:
        return f"<TtlTracker {self.name!r} ttl_ms={self.ttl_ms} bound={self.bound}>"

    def now(self) -> int:
        """The state's current time."""
        return self.time.now()

    def wrote(self, expiration: int) -> None:
        """An entry expiring at `expiration` was (or may have been) written. (Callers on
        the per-request path skip the call when `expiration >= bound` and not `passing`.)"""
        if expiration < self.bound:
            self.bound = expiration
        for p in self._passes:
            if expiration < p.written:
                p.written = expiration

    def due(self, now: int) -> bool:
        """True when an entry may have expired by `now`."""
        return now >= self.bound

    def forget(self) -> None:
        """Entries of unknown age were stored: anything may have expired (passes under way
        end without raising the bound: they may not see those entries)."""
        self.bound = _MIN
        self._passes.clear()
        self.passing = False

    def start_pass(self) -> CleanupPass:
        """A cleanup pass over the whole state begins."""
        p = CleanupPass()
        self._passes.append(p)
        self.passing = True
        return p

    def end_pass(self, p: CleanupPass, complete: bool = True) -> None:
        """`p` has seen every entry (or, not `complete`, was abandoned)."""
        if p in self._passes:
            self._passes.remove(p)
            self.passing = bool(self._passes)
            if complete:
                bound = p.kept if p.kept < p.written else p.written
                if bound > self.bound:
                    self.bound = bound
