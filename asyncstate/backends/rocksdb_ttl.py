"""RocksDB's side of TTL states: their reads in phase 3, incremental cleanup steps, layout
changes and full snapshot filtering.

Every stored value of a TTL state is timestamped (`asyncstate.state.ttl.layout`): a value
of a value-kind state, each list element, each map entry. A read carries a `TtlRead` and
follows `layout.outcome`; what it changes (a refresh with ON_READ_AND_WRITE, the removal of
an expired entry it found) goes into a WriteBatch written at the read's place in the lane:

- point reads answered from the multi-get (`apply_points`): before the batch's own writes,
  in issue order (a second read of the same key sees what the first one changed);
- iterations, `is_empty` and late point reads (`load`): at their own step.

A refresh found by a point read is not written at once but kept as a *deferred refresh* on
the state's handle: a record that reads and then writes a key (a counter) writes it again in
a later batch, and that write makes the refresh pointless. The read's `_TtlPoint` is the
deferred refresh (its bytes are made only if it is written). It waits for the jobs that were
in the lane when its read was delivered, then `_GENERATIONS` more: the record's write comes
in a batch triggered after that delivery. Every read of a TTL state in phase 3 looks at the
deferred refreshes first (`_current`), a job's own writes drop the refreshes they overwrite
(`RocksTtl.settle`), and the rest are written when they grow old, before the job's own
writes; everything else that reads the column family (snapshots, layout changes, closing)
writes them all first (`flush`).

A refresh that grows old is written by whichever job is applied then, a job that need not
touch its key, so the jobs behind it in the lane do not wait for it: their multi-gets may
have read the key already, without the refresh. It therefore stays on the handle, *shown*
(still found by `_current`, no longer written again), until every job that was in the lane
when it was written has been applied (`RocksTtl.shown`). Without that, a read whose multi-get
ran before the write would find the timestamp from before the refresh, and could find a live
entry expired (and remove it, with cleanup on read).

Later batches do not wait for a job's point reads either (their refreshes are kept back on
the handle): an expired entry such a read removes (cleanup on read) is written with the
job's effects, and is shown removed on its handle to the jobs behind it in the lane in the
same way (`_Effects.show_removal`). Without that, a read whose multi-get ran before the
removal, issued at an earlier "now" (the wall clock stepped back) or returning expired
entries, would find the removed entry (and, refreshing it, store it again).

Incremental cleanup runs as a job of the backend's own in the lane (`RocksTtl.run_steps`),
so it is ordered with the batches around it; its cursor is a remembered key, and every scan
is a bounded one (`asyncstate.backends.rocksdb_scan`): no iterator outlives a step. The
background cleaner's removals are such jobs too. What a cleanup job removes is known only
when it runs, so the multi-gets of the jobs behind it do not wait for it and may have read
a removed key before the removal was written. Its removals are therefore shown on their
handles like written refreshes (`RocksTtl.show_removals`): `_current` finds the key empty.
Without that, such a read would find the removed entry (fresh, if it was issued before the
entry expired) and, with ON_READ_AND_WRITE, its refresh would store the entry again.

Everything here is internal to the RocksDB backend modules.
"""

from __future__ import annotations

from typing import Any, Final

import rocksdict

from asyncstate.backends.rocksdb_batch import _Cursor, _Job, _StateHandle, _TtlPoint
from asyncstate.backends.rocksdb_scan import _scan_items
from asyncstate.errors import BackendError, InvalidStateError
from asyncstate.runtime.requests import IteratorChunk, StateKind, StateRequestType
from asyncstate.serde import decode_key, decode_value
from asyncstate.state.ttl.layout import (
    EXPIRED_HIDDEN,
    EXPIRED_RETURNED,
    FRESH,
    HEADER_SIZE,
    TtlPolicy,
    TtlRead,
    encode,
    expiration,
    outcome,
    timestamp_of,
)
from asyncstate.state.ttl.tracker import CleanupPass, TtlTracker

__all__: list[str] = []

_T: Final = StateRequestType  # compiled: Final alias
_FRESH: Final = FRESH  # compiled: Final alias
_HIDDEN: Final = EXPIRED_HIDDEN  # compiled: Final alias
_RETURNED: Final = EXPIRED_RETURNED  # compiled: Final alias
_HEADER_SIZE: Final = HEADER_SIZE  # compiled: Final alias
_ABSENT: Final = -1
# Every stored key of a state's column family starts with a 2-byte key group (< 0x8000).
_ALL_LOWER: Final = b""
_ALL_UPPER: Final = b"\xff\xff\xff"
# Entries scanned per slice by `is_empty` and layout changes.
_SLICE: Final = 1000
_MIGRATE_SLICE: Final = 10_000
# The read of a removal shown on a handle (`RocksTtl.show_removals`): there is none, its point
# is never answered.
_REMOVAL: Final = TtlRead(TtlPolicy(1, False, False, False), 0, 0, None)
# Jobs a deferred refresh waits for a write that overwrites it, after those that were in the
# lane when its read was delivered: the record's write comes in the next batch triggered, or
# in the one after it when the requests buffered by then fill more than one batch.
_GENERATIONS: Final = 2


def _timestamp(raw: bytes, name: str) -> int:
    try:
        return timestamp_of(raw)
    except ValueError as exc:
        raise BackendError(f"a stored value of TTL state {name!r} is damaged: {exc}") from None


def _refreshed(point: _TtlPoint) -> bytes:
    """The bytes a deferred refresh writes: what its read found, stamped with its access
    time."""
    raw = point.raw
    assert raw is not None
    return encode(point.read.access, raw[_HEADER_SIZE:])


def _current(handle: _StateHandle, key: bytes, raw: bytes | None) -> bytes | None:
    """What `key` holds: its deferred refresh, if it has one (nothing, for a removal shown),
    else `raw` (what is stored)."""
    refreshes = handle.refreshes
    if refreshes is not None:
        refreshed = refreshes.get(key)
        if refreshed is not None:
            return None if refreshed.raw is None else _refreshed(refreshed)
    return raw


def _forget(handle: _StateHandle, key: bytes) -> None:
    """Drop the deferred refresh of `key`, if any (it is overwritten or removed)."""
    refreshes = handle.refreshes
    if refreshes is not None:
        # `get` and `del`: native dict operations in the compiled build (`pop` is a method
        # call).
        point = refreshes.get(key)
        if point is not None:
            del refreshes[key]
            # Nothing to write: its age then passes it over without looking it up.
            point.raw = None


class _Effects:
    """What reads of TTL states change: one WriteBatch (made on first use), the bytes each
    changed key holds afterwards, by state and key (None: removed; a deferred refresh is
    found through the state's handle instead: states of one key and namespace share key
    bytes, each in its column family), and, with `young` (the backend's list of this job's
    deferred refreshes), point reads whose refreshes are kept back instead of written, and
    whose removals are shown (`removals`)."""

    __slots__ = ("latest", "removals", "wb", "young")

    def __init__(self, young: list[_TtlPoint] | None = None) -> None:
        self.wb: rocksdict.WriteBatch | None = None
        self.latest: dict[tuple[_StateHandle, bytes], bytes | None] = {}
        self.young = young
        self.removals: list[_TtlPoint] | None = None

    def defer(self, point: _TtlPoint) -> None:
        """Keep back the refresh of `point`'s read (`point.raw` is what it found)."""
        handle = point.handle
        refreshes = handle.refreshes
        if refreshes is None:
            refreshes = handle.refreshes = {}
        refreshes[point.key] = point
        young = self.young
        assert young is not None
        young.append(point)

    def show_removal(self, key: bytes, handle: _StateHandle) -> None:
        """Show the removal of `key` (a point read's, just deleted) on its handle: the
        multi-gets of the jobs behind this one did not wait for it (`RocksTtl.settle` keeps
        it shown while they are applied)."""
        removals = self.removals
        if removals is None:
            removals = self.removals = []
        removals.append(_show_removal(handle, key))

    def put(self, key: bytes, value: bytes, handle: _StateHandle) -> None:
        self.latest[handle, key] = value
        _forget(handle, key)  # this write is newer than a deferred refresh of the key
        if self.wb is None:
            self.wb = rocksdict.WriteBatch(raw_mode=True)
        self.wb.put(key, value, handle.cf_handle)

    def delete(self, key: bytes, handle: _StateHandle) -> None:
        self.latest[handle, key] = None
        _forget(handle, key)
        if self.wb is None:
            self.wb = rocksdict.WriteBatch(raw_mode=True)
        self.wb.delete(key, handle.cf_handle)


def _point(read: TtlRead, raw: bytes | None, key: bytes, handle: _StateHandle,
           effects: _Effects | None, deferred: _TtlPoint | None = None) -> int:
    """What `read` finds in the bytes `raw` of `key` (_ABSENT when there are none), noting
    its refresh or removal in `effects` (None: look only). With `deferred` (the read's
    point), a refresh is kept back instead of written."""
    if raw is None:
        return _ABSENT
    ts = _timestamp(raw, handle.name)
    found = outcome(read, ts)
    if effects is None:
        return found
    policy = read.policy
    if found == _FRESH:
        if policy.update_on_read and read.access != ts:
            if deferred is not None:
                deferred.raw = raw
                effects.defer(deferred)
            else:
                effects.put(key, encode(read.access, raw[_HEADER_SIZE:]), handle)
    elif policy.cleanup_on_read:
        effects.delete(key, handle)
        if deferred is not None:
            effects.show_removal(key, handle)
    return found


def _answer(found: int, raw: bytes | None, contains: bool) -> Any:
    visible = found in (_FRESH, _RETURNED)
    if contains:
        return visible
    return decode_value(raw[_HEADER_SIZE:]) if visible and raw is not None else None


def apply_points(points: list[_TtlPoint], results: list[Any], effects: _Effects) -> None:
    """Answer the TTL point reads of a job from their multi-get bytes, in issue order, noting
    what they change in `effects` (written before the job's own writes, refreshes kept
    back)."""
    latest = effects.latest
    try:
        for p in points:
            key = p.key
            changed = (p.handle, key) if latest else None
            raw = latest[changed] if changed is not None and changed in latest \
                else _current(p.handle, key, p.raw)
            found = _point(p.read, raw, key, p.handle, effects, p)
            results[p.index] = _answer(found, raw, p.contains)
    except BaseException:
        # The job fails before its effects are written: the removals its reads showed on
        # their handles never happen, so later reads must find the stored entries again.
        for removal in effects.removals or ():
            _unshow(removal)
        effects.removals = None
        raise


def _open_cf(handle: _StateHandle) -> rocksdict.Rdict:
    """`handle`'s column family; InvalidStateError once the backend closed it. Use it in
    an expression, not a local (a stored error's traceback would keep the family)."""
    cf = handle.cf
    if cf is None:
        raise InvalidStateError(f"the RocksDB state {handle.name!r} is closed")
    return cf


def _scan(handle: _StateHandle, lower: bytes, upper: bytes, limit: int
          ) -> list[tuple[bytes, bytes]]:
    return _scan_items(_open_cf(handle), lower, upper, limit)


def _get(handle: _StateHandle, key: bytes) -> bytes | None:
    raw: bytes | None = _open_cf(handle).get(key)
    return _current(handle, key, raw)


def load(cursor: _Cursor, chunk: int, effects: _Effects) -> Any:
    """The answer of a TTL state's iteration (one chunk), `is_empty` or late point read at
    `cursor`; what it changes goes into `effects`."""
    read = cursor.ttl
    assert read is not None
    handle = cursor.handle
    t = cursor.request_type
    if t is _T.MAP_IS_EMPTY:
        return _is_empty(cursor, read, effects)
    if not (t is _T.LIST_GET or t is _T.MAP_ITER or t is _T.MAP_ITER_KEY
            or t is _T.MAP_ITER_VALUE):
        raw = _get(handle, cursor.prefix)
        found = _point(read, raw, cursor.prefix, handle, effects)
        return _answer(found, raw, t is _T.MAP_CONTAINS)
    prefix = cursor.prefix
    skip = len(prefix)
    lower = prefix if cursor.after is None else cursor.after + b"\x00"
    items: list[Any] = []
    last: bytes | None = None
    while True:
        entries = _scan(handle, lower, cursor.upper, chunk + 1)
        for k, stored in entries:
            v = stored if not handle.refreshes else _current(handle, k, stored)
            assert v is not None
            # One more entry a read returns (looked at, not changed): the next chunk starts
            # after the last one taken.
            if len(items) == chunk and _point(read, v, k, handle, None) != _HIDDEN:
                return IteratorChunk(items, _Cursor(t, handle, prefix, last, cursor.upper,
                                                    read))
            found = _point(read, v, k, handle, effects)
            if found == _HIDDEN:
                continue
            last = k
            if t is _T.LIST_GET or t is _T.MAP_ITER_VALUE:
                items.append(decode_value(v[_HEADER_SIZE:]))
            elif t is _T.MAP_ITER:
                items.append((decode_key(k[skip:]), decode_value(v[_HEADER_SIZE:])))
            else:
                items.append(decode_key(k[skip:]))
        if len(entries) <= chunk:
            return IteratorChunk(items, None)
        lower = entries[-1][0] + b"\x00"


def _is_empty(cursor: _Cursor, read: TtlRead, effects: _Effects) -> bool:
    """True when the map at `cursor` holds no entry a read returns; the expired entries met
    before the first one it returns are removed (not that one, expired or not: no read
    returned it)."""
    handle = cursor.handle
    cleanup = read.policy.cleanup_on_read
    lower = cursor.prefix
    while True:
        entries = _scan(handle, lower, cursor.upper, _SLICE)
        for k, v in entries:
            if _point(read, _current(handle, k, v), k, handle, None) != _HIDDEN:
                return False
            if cleanup:
                effects.delete(k, handle)
        if len(entries) < _SLICE:
            return True
        lower = entries[-1][0] + b"\x00"


# -- the backend's TTL bookkeeping ----------------------------------------------------------

class _StepCursor:
    """Where incremental cleanup of one state stands: the key to scan from next (None:
    the start of a pass) and the pass under way."""

    __slots__ = ("after", "pass_")

    def __init__(self) -> None:
        self.after: bytes | None = None
        self.pass_: CleanupPass | None = None


class RocksTtl:
    """Which states of a RocksDB backend are timestamped (and in which time domain), their
    trackers, incremental cleanup cursors and the steps waiting for their job in the lane."""

    __slots__ = ("ages", "applied", "cursors", "deadlines", "layouts", "pending", "shown",
                 "shown_until", "trackers", "waiting")

    def __init__(self) -> None:
        self.layouts: dict[str, str] = {}
        self.trackers: dict[str, TtlTracker] = {}
        self.cursors: dict[str, _StepCursor] = {}
        # The deferred refreshes each of the last jobs made, oldest first, and after which
        # of the jobs counted in `applied` each list is written.
        self.ages: list[list[_TtlPoint]] = []
        self.deadlines: list[int] = []
        self.applied = 0  # jobs whose point reads had their effects (see `effects`)
        # The jobs behind the one being applied (see `effects`).
        self.waiting = 0
        # Refreshes written out as they grew old (and removals written by cleanup jobs) but
        # still shown on their handles, oldest first, and the value of `applied` from which
        # each list may go (see `settle`, `show_removals`).
        self.shown: list[list[_TtlPoint]] = []
        self.shown_until: list[int] = []
        # name -> [budget, now] of the steps the queued cleanup job will run (empty: no job
        # queued). Steps coalesce: budgets add up, and the earliest "now" is kept.
        self.pending: dict[str, list[int]] = {}

    def __repr__(self) -> str:
        return f"<RocksTtl layouts={self.layouts}>"

    def track(self, name: str, tracker: TtlTracker | None) -> None:
        """`TtlBackend.track_ttl`."""
        self.cursors.pop(name, None)
        self.pending.pop(name, None)
        if tracker is None:
            self.trackers.pop(name, None)
        else:
            self.trackers[name] = tracker

    def add_step(self, name: str, budget: int, now: int) -> bool:
        """Note an incremental cleanup step; True when the caller must queue a job to run
        the noted steps (none is queued yet)."""
        if name not in self.trackers:
            return False
        first = not self.pending
        noted = self.pending.get(name)
        if noted is None:
            self.pending[name] = [budget, now]
        else:
            noted[0] += budget
            if now < noted[1]:
                noted[1] = now
        return first

    def run_steps(self, handles: dict[str, _StateHandle],
                  removed: list[tuple[_StateHandle, bytes]]) -> rocksdict.WriteBatch | None:
        """The cleanup job: run the noted steps (at the head of the lane); the WriteBatch
        of the removals, whose keys go into `removed`."""
        pending, self.pending = self.pending, {}
        wb: rocksdict.WriteBatch | None = None
        for name, (budget, now) in pending.items():
            tracker = self.trackers.get(name)
            handle = handles.get(name)
            if tracker is None or handle is None:
                continue
            cursor = self.cursors.get(name)
            if cursor is None:
                cursor = self.cursors[name] = _StepCursor()
            wb = _step(handle, tracker, cursor, budget, now, wb, removed)
        return wb

    def show_removals(self, removed: list[tuple[_StateHandle, bytes]], behind: int) -> None:
        """A cleanup job has written the removal of the `removed` keys, with `behind` jobs
        (batches) behind it in the lane, whose multi-gets did not wait for it. Until they
        are applied, the keys are shown removed on their handles, as written refreshes are
        shown (see `settle`). List elements are left out: only iterations read them, and
        those read the column family when the lane applies them."""
        if not behind:
            return
        shown = [_show_removal(handle, key) for handle, key in removed
                 if handle.kind is not StateKind.LIST]
        if shown:
            self._show(shown, self.applied + behind)

    def _show(self, points: list[_TtlPoint], until: int) -> None:
        """Keep `points` shown on their handles until `applied` reaches `until` (`settle`
        takes them off then)."""
        self.shown.append(points)
        self.shown_until.append(until)

    @property
    def deferred(self) -> bool:
        """True while some refresh is deferred, or shown after it was written, or a removal
        by cleanup is shown (every job counts in `applied` then)."""
        return bool(self.ages) or bool(self.shown)

    def effects(self, waiting: int) -> _Effects:
        """The effects of a job's point reads, refreshes deferred; `waiting` jobs were
        triggered before it and are not applied yet (its results are delivered after them
        in the lane: a write they lead to comes later)."""
        self.applied += 1
        self.waiting = waiting
        young: list[_TtlPoint] = []
        self.ages.append(young)
        self.deadlines.append(self.applied + waiting + _GENERATIONS)
        return _Effects(young)

    def settle(self, job: _Job, effects: _Effects) -> None:
        """Before a job's own writes: drop the deferred refreshes its writes overwrite, put
        those of keys it rewrites by range (a list or map it clears or replaces) and those
        that grew old into `effects`, and show the removals of its point reads."""
        touched_all = job.touched
        for handle, touched in touched_all.items():
            if handle.refreshes is None:
                continue
            for key in touched.values:  # value kinds: puts and deletes of these keys
                _forget(handle, key)
            iterated = touched.ttl_iterated
            for prefix, overlay in touched.maps.items():
                # An iteration of the job may reach an entry before the job's write of it
                # does: it must judge the entry by its refreshed timestamp, so the refreshes
                # are written first, as for a map the job clears.
                if overlay.cleared or (iterated is not None and prefix in iterated):
                    _flush_prefix(handle, prefix, effects)
                for user_key in overlay.entries:
                    _forget(handle, prefix + user_key)
            if handle.kind is StateKind.LIST:
                for prefix, segment in touched.written.items():
                    if segment >= 0:
                        _flush_prefix(handle, prefix, effects)
        applied = self.applied
        if effects.removals is not None:
            # Removed by this job's point reads: shown to the jobs behind it, whose multi-gets
            # did not wait for this job (see `_Effects.show_removal`).
            self._show(effects.removals, applied + self.waiting)
            effects.removals = None
        shown = self.shown
        if shown:
            # The jobs that were in the lane when these were written have all been applied
            # (this one too: its reads are answered). The multi-gets of those behind them
            # started after the write, so they read the refreshes (or find the removed keys
            # gone) in the database.
            until = self.shown_until
            while shown and until[0] <= applied:
                until.pop(0)
                for p in shown.pop(0):
                    _unshow(p)
        ages = self.ages
        deadlines = self.deadlines
        if ages and (deadlines[0] < applied or not ages[0]):
            written: list[_TtlPoint] = []
            while ages and (deadlines[0] < applied or not ages[0]):
                deadlines.pop(0)
                for p in ages.pop(0):
                    if _write_shown(effects, p):
                        written.append(p)
            if written:
                # The refreshes are written by this job, which need not touch their keys, so
                # the jobs behind it did not wait for it: a multi-get of theirs may have read
                # a key before its refresh was written (it started once the job that read
                # the key was applied). Each such job is in the lane now, and is counted in
                # `applied` when it is applied (`deferred` stays True meanwhile): until then
                # the refreshes stay shown on their handles, where `_current` finds them.
                self._show(written, applied + self.waiting)

    def flush(self) -> rocksdict.WriteBatch | None:
        """Every deferred refresh, as a WriteBatch (None: there are none); they are no longer
        deferred, nor shown (callers flush while no job is under way, that a multi-get of
        could have read a key before its refresh is written)."""
        effects = _Effects()
        for age in self.ages:
            for p in age:
                _write_deferred(effects, p)
        for written in self.shown:
            for p in written:
                _unshow(p)
        self.ages = []
        self.deadlines = []
        self.shown = []
        self.shown_until = []
        return effects.wb

    def drop(self) -> None:
        """Forget every deferred refresh (their states are dropped)."""
        for age in self.ages + self.shown:
            for p in age:
                p.handle.refreshes = None
        self.ages = []
        self.deadlines = []
        self.shown = []
        self.shown_until = []

    def filter_snapshot(self, name: str, items: list[tuple[bytes, bytes]]
                        ) -> list[tuple[bytes, bytes]]:
        """`items` of state `name` without the expired ones, when its tracker asks for full
        snapshot cleanup."""
        tracker = self.trackers.get(name)
        if tracker is None or not tracker.full_snapshot or name not in self.layouts:
            return items
        now = tracker.now()
        ttl = tracker.ttl_ms
        return [(k, v) for k, v in items if expiration(_timestamp(v, name), ttl) > now]


def _write(effects: _Effects, key: bytes, value: bytes, handle: _StateHandle) -> None:
    if effects.wb is None:
        effects.wb = rocksdict.WriteBatch(raw_mode=True)
    effects.wb.put(key, value, handle.cf_handle)


def _write_deferred(effects: _Effects, point: _TtlPoint) -> None:
    """Put the deferred refresh of `point` into `effects`, unless the key was overwritten,
    removed or refreshed again since; it is no longer deferred."""
    if _write_shown(effects, point):
        _unshow(point)


def _write_shown(effects: _Effects, point: _TtlPoint) -> bool:
    """Put the deferred refresh of `point` into `effects`, unless the key was overwritten,
    removed or refreshed again since, and leave it shown on its handle; True if it was
    written."""
    if point.raw is None:  # dropped (see `_forget`)
        return False
    refreshes = point.handle.refreshes
    if refreshes is not None and refreshes.get(point.key) is point:
        _write(effects, point.key, _refreshed(point), point.handle)
        return True
    return False


def _show_removal(handle: _StateHandle, key: bytes) -> _TtlPoint:
    """Show `key` removed on `handle` (`_current` finds it empty); the point that shows it."""
    refreshes = handle.refreshes
    if refreshes is None:
        refreshes = handle.refreshes = {}
    removal = _TtlPoint(-1, _REMOVAL, handle, key, False)
    refreshes[key] = removal  # its raw bytes stay None: the key holds nothing
    return removal


def _unshow(point: _TtlPoint) -> None:
    """Take the written refresh of `point` off its handle, unless the key was overwritten,
    removed or refreshed again since (the database holds it)."""
    refreshes = point.handle.refreshes
    if refreshes is not None and refreshes.get(point.key) is point:
        del refreshes[point.key]


def _flush_prefix(handle: _StateHandle, prefix: bytes, effects: _Effects) -> None:
    """Put the deferred refreshes of keys under `prefix` into `effects` (the job then
    rewrites that range, after them)."""
    refreshes = handle.refreshes
    if refreshes:
        for key in [k for k in refreshes if k.startswith(prefix)]:
            point = refreshes.pop(key)
            if point.raw is not None:  # else a removal shown: nothing to write
                _write(effects, key, _refreshed(point), handle)


def _step(handle: _StateHandle, tracker: TtlTracker, cursor: _StepCursor, budget: int,
          now: int, wb: rocksdict.WriteBatch | None,
          removed: list[tuple[_StateHandle, bytes]]) -> rocksdict.WriteBatch | None:
    """One incremental cleanup step of one state: up to `budget` stored entries (each list
    element and map entry counts) from the cursor on; the keys removed go into `removed`."""
    p = cursor.pass_
    if p is None:
        p = cursor.pass_ = tracker.start_pass()
        cursor.after = None
    lower = _ALL_LOWER if cursor.after is None else cursor.after + b"\x00"
    entries = _scan(handle, lower, _ALL_UPPER, budget)
    ttl = tracker.ttl_ms
    for k, stored in entries:
        v = _current(handle, k, stored)
        assert v is not None
        exp = expiration(_timestamp(v, handle.name), ttl)
        if exp <= now:
            if wb is None:
                wb = rocksdict.WriteBatch(raw_mode=True)
            wb.delete(k, handle.cf_handle)
            _forget(handle, k)
            removed.append((handle, k))
        else:
            p.keep(exp)
    if len(entries) < budget:
        tracker.end_pass(p)
        cursor.pass_ = None
        cursor.after = None
    else:
        cursor.after = entries[-1][0]
    return wb


def rewrite_layout(handle: _StateHandle, stamp: int | None,
                   write: Any) -> None:
    """Add timestamps (`stamp`) to every stored value of a state, or (None) drop them,
    slice by slice; `write(wb)` writes each slice's WriteBatch."""
    lower = _ALL_LOWER
    header = None if stamp is None else encode(stamp, b"")
    while True:
        entries = _scan(handle, lower, _ALL_UPPER, _MIGRATE_SLICE)
        if not entries:
            return
        wb = rocksdict.WriteBatch(raw_mode=True)
        for k, v in entries:
            if header is None:
                _timestamp(v, handle.name)
                wb.put(k, v[_HEADER_SIZE:], handle.cf_handle)
            else:
                wb.put(k, header + v, handle.cf_handle)
        write(wb)
        if len(entries) < _MIGRATE_SLICE:
            return
        lower = entries[-1][0] + b"\x00"
