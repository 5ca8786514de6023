"""A batch in RocksDB terms: the job that carries it through RocksDBBackend's three phases,
and phase 1, the plan, which turns its requests into point reads and WriteBatches.

The plan runs on the loop thread. A point read that follows a write of the same key in the
batch is answered from an overlay of the batch's writes; other point reads are collected per
column family. An iteration of a (key, namespace) that the batch wrote earlier is placed after
that write, so phase 3 runs it once the write is applied.

A read of a TTL state (its payload a `TtlRead`) may rewrite or remove what it reads. An
iteration therefore counts as a write of its (key, namespace) for later batches. A point read
is answered in phase 3 from the multi-get, before the batch's writes (`_TtlPoint`), and later
batches do not wait for it: its refresh is kept back on the state's handle and its removal
shown there (`asyncstate.backends.rocksdb_ttl`), where their reads find them. When the batch
wrote that key (or iterated that map with TTL) earlier, the point read becomes a step of its
own instead, run at its place among the batch's writes (a "late read", a `_Cursor` of a point
read type): the batch's write already makes later batches wait.

Everything here is internal to the RocksDB backend modules.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Final

import rocksdict

from asyncstate.backends.rocksdb_layout import _SEQ, _SEQ_KEY, _prefix_end
from asyncstate.runtime.requests import StateKind, StateRequest, StateRequestType
from asyncstate.serde import NONE_BYTES, from_stored, stored_to_bytes
from asyncstate.state.ttl.layout import TtlRead, TtlValue, to_bytes

__all__: list[str] = []

_T: Final = StateRequestType  # compiled: Final alias
# Bound once: CPython 3.11 compiles `name.method(...)` on an imported name as a plain attribute
# load (the fast path for modules), so `_SEQ.pack(seq)` would build a bound method per call.
_pack_seq: Final = _SEQ.pack  # compiled: Final alias
# States stored one entry per (key, namespace), written with puts and point deletes only.
_VALUE_KINDS: Final = frozenset({StateKind.VALUE, StateKind.REDUCING, StateKind.AGGREGATING})
_TtlRead: Final = TtlRead  # compiled: Final alias
_TtlValue: Final = TtlValue  # compiled: Final alias


def _value_bytes(stored: Any) -> bytes:
    """The bytes a write stores: timestamped for a TTL state's `TtlValue`."""
    if type(stored) is _TtlValue:
        return to_bytes(stored)
    return stored_to_bytes(stored)

# Request categories, indexed by request type: the plan dispatches on one small int.
# compiled: Final alias (the ints become C constants)
_CAT_GET: Final = 0
_CAT_MAP_GET: Final = 1
_CAT_MAP_CONTAINS: Final = 2
_CAT_PUT: Final = 3
_CAT_MAP_PUT: Final = 4
_CAT_MAP_PUT_ALL: Final = 5
_CAT_MAP_REMOVE: Final = 6
_CAT_LIST_ADD: Final = 7
_CAT_LIST_ADD_ALL: Final = 8
_CAT_LIST_UPDATE: Final = 9
_CAT_CLEAR: Final = 10
_CAT_ITER: Final = 11
_CAT_LOAD: Final = 12
_CAT_NONE: Final = 13
_CAT_LATE: Final = 14  # a late read of a TTL state (never a request's own category)
_CATEGORY_OF = {
    _T.CLEAR: _CAT_CLEAR,
    _T.VALUE_GET: _CAT_GET,
    _T.VALUE_UPDATE: _CAT_PUT,
    _T.LIST_GET: _CAT_ITER,
    _T.LIST_ADD: _CAT_LIST_ADD,
    _T.LIST_UPDATE: _CAT_LIST_UPDATE,
    _T.LIST_ADD_ALL: _CAT_LIST_ADD_ALL,
    _T.MAP_GET: _CAT_MAP_GET,
    _T.MAP_CONTAINS: _CAT_MAP_CONTAINS,
    _T.MAP_PUT: _CAT_MAP_PUT,
    _T.MAP_PUT_ALL: _CAT_MAP_PUT_ALL,
    _T.MAP_ITER: _CAT_ITER,
    _T.MAP_ITER_KEY: _CAT_ITER,
    _T.MAP_ITER_VALUE: _CAT_ITER,
    _T.MAP_REMOVE: _CAT_MAP_REMOVE,
    _T.MAP_IS_EMPTY: _CAT_ITER,
    _T.ITERATOR_LOADING: _CAT_LOAD,
    _T.REDUCING_GET: _CAT_GET,
    _T.REDUCING_ADD: _CAT_PUT,
    _T.AGGREGATING_GET: _CAT_GET,
    _T.AGGREGATING_ADD: _CAT_PUT,
}
_CATEGORY: Final = [_CATEGORY_OF.get(t, _CAT_NONE) for t in StateRequestType]


# -- handles, cursors, jobs -----------------------------------------------------------------

class _StateHandle:
    """What `register_state` returns: a state's column family. `close()` drops the
    references, because a live column family keeps RocksDB's LOCK. `refreshes`: the
    refreshes of TTL reads not written yet (or written and still shown), key to the point
    read whose refresh it is, and the removals of TTL cleanup still shown, key to a point
    without bytes (None: none; `asyncstate.backends.rocksdb_ttl`)."""

    __slots__ = ("name", "kind", "cf", "cf_handle", "refreshes")

    def __init__(self, name: str, kind: StateKind, cf: rocksdict.Rdict,
                 cf_handle: rocksdict.ColumnFamily) -> None:
        self.name = name
        self.kind = kind
        self.cf: rocksdict.Rdict | None = cf  # reads: multi-get, iteration
        self.cf_handle: rocksdict.ColumnFamily | None = cf_handle  # WriteBatch target
        self.refreshes: dict[bytes, _TtlPoint] | None = None

    def __repr__(self) -> str:
        status = "open" if self.cf is not None else "closed"
        return f"<RocksDB state {self.name!r} ({self.kind.value}, {status})>"


class _Cursor:
    """Where an iteration stands: a bounded range of one column family. `after` is the last
    key returned (the next chunk starts after it), or None before the first chunk. `ttl`:
    the TtlRead of a TTL state's iteration (its later chunks read with it too). A late read
    of a TTL state is a cursor of a point read type whose `prefix` is the key read."""

    __slots__ = ("request_type", "handle", "prefix", "after", "upper", "ttl")

    def __init__(self, request_type: StateRequestType, handle: _StateHandle, prefix: bytes,
                 after: bytes | None, upper: bytes, ttl: TtlRead | None = None) -> None:
        self.request_type = request_type
        self.handle = handle
        self.prefix = prefix
        self.after = after
        self.upper = upper
        self.ttl = ttl

    def __repr__(self) -> str:
        return f"<RocksDB cursor {self.request_type.name} state={self.handle.name!r}>"


class _MapOverlay:
    """What a batch wrote so far under one map's (key, namespace), for later reads."""

    __slots__ = ("cleared", "entries")

    def __init__(self) -> None:
        self.cleared = False  # every entry was removed earlier in this batch
        self.entries: dict[bytes, Any] = {}  # user key bytes -> stored value (None: removed)


class _TtlPoint:
    """A point read of a TTL state answered from the multi-get: the request's index, its
    TtlRead, the key read (with its column family) and, once read, the stored bytes (once
    its refresh is deferred, the bytes the read found; None again once a write of the key
    dropped the refresh, and on a point that shows a removal)."""

    __slots__ = ("contains", "handle", "index", "key", "raw", "read")

    def __init__(self, index: int, read: TtlRead, handle: _StateHandle, key: bytes,
                 contains: bool) -> None:
        self.index = index
        self.read = read
        self.handle = handle
        self.key = key
        self.contains = contains
        self.raw: bytes | None = None


class _Touched:
    """What one batch does to one column family. Prefixes are (key group, key, namespace)
    bytes."""

    __slots__ = ("keys", "slots", "read", "written", "values", "maps", "ttl_iterated")

    def __init__(self) -> None:
        # Point reads for the multi-get, and their result slots (~i: MAP_CONTAINS of request
        # i). Of a value-kind state, the keys are the prefixes read.
        self.keys: list[bytes] = []
        self.slots: list[int] = []
        # prefixes of the map entries read; only filled while an earlier batch is unapplied
        self.read: set[bytes] = set()
        # Writes of a list or map state: prefix -> WriteBatch segment of its latest write.
        # Also the prefixes a TTL iteration may rewrite (later batches wait for them).
        self.written: dict[bytes, int] = {}
        # Writes of a value-kind state: prefix -> the stored value written (None: removed),
        # also the overlay later reads of the batch are answered from.
        self.values: dict[bytes, Any] = {}
        # Overlay of a map state's writes, for later reads of the batch.
        self.maps: dict[bytes, _MapOverlay] = {}
        # Prefixes of maps a TTL iteration of the batch may have rewritten.
        self.ttl_iterated: set[bytes] | None = None


class _Job:
    """One batch travelling through the three phases."""

    __slots__ = ("batch", "results", "steps", "touched", "point_reads", "writes", "parts",
                 "raw", "remaining", "lock", "error", "started", "reads_done", "list_seq",
                 "gate", "ttl_points", "maintenance")

    def __init__(self, batch: list[StateRequest], list_seq: int) -> None:
        self.batch = batch
        self.results: list[Any] = [None] * len(batch)
        # WriteBatches and (index, cursor) iterations, in the order phase 3 runs them
        self.steps: list[rocksdict.WriteBatch | tuple[int, _Cursor]] = []
        self.touched: dict[_StateHandle, _Touched] = {}
        self.point_reads = 0  # keys the multi-gets read
        self.writes = False  # the batch writes something
        self.parts: list[tuple[_StateHandle, list[bytes], list[int]]] = []
        self.raw: list[list[bytes | None] | None] = []
        self.remaining = 0
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.started = False
        self.reads_done = False
        # the next list sequence number; the plan takes one per list element it writes
        self.list_seq = list_seq
        # released by the pool thread that starts the multi-get (see RocksDBBackend)
        self.gate: threading.Lock | None = None
        # point reads of TTL states answered from the multi-get, in issue order
        self.ttl_points: list[_TtlPoint] | None = None
        # set on a job of the backend's own (TTL cleanup), which has no batch to deliver
        self.maintenance: Callable[[], None] | None = None


def _overlaps(job: _Job, earlier: _Job) -> bool:
    """True if `job` reads a (state, key, namespace) that `earlier` writes."""
    earlier_touched = earlier.touched
    for handle, touched in job.touched.items():
        other = earlier_touched.get(handle)
        if other is None:
            continue
        if handle.kind in _VALUE_KINDS:
            values = other.values
            if values and any(key in values for key in touched.keys):
                return True
            continue
        read = touched.read
        written = other.written
        if not read or not written:
            continue
        if len(read) <= len(written):
            if any(p in written for p in read):
                return True
        elif any(w in read for w in written):
            return True
    return False


# -- phase 1: plan (loop thread) -----------------------------------------------------------

def _plan(job: _Job, kg_prefix: list[bytes], track: bool) -> None:
    """Phase 1: plan `job.batch` into `job`, advancing `job.list_seq`. `track`: record the
    prefixes read, because an earlier batch with writes is still unapplied."""
    batch = job.batch
    results = job.results
    all_touched = job.touched
    steps = job.steps
    point_reads = 0
    category = _CATEGORY
    last_handle: _StateHandle | None = None
    touched: _Touched  # set at the first request (last_handle is None until then)
    wb: rocksdict.WriteBatch | None = None
    segment = 0
    seq_start = job.list_seq
    for i, request in enumerate(batch):
        cat = category[request.request_type]
        if cat == _CAT_LOAD:
            cursor: _Cursor = request.payload[1]
            handle = cursor.handle
            prefix = cursor.prefix
        elif cat == _CAT_NONE:
            raise ValueError(f"RocksDBBackend cannot execute {request.request_type.name}")
        else:
            handle = request.state.handle  # type: ignore[union-attr]
            ctx = request.context
            namespace = request.namespace
            if namespace is NONE_BYTES:
                # Every request of a record in the default namespace shares one key object
                # (its hash is computed once too).
                cached = ctx.storage_key
                if cached is None:
                    cached = ctx.storage_key = kg_prefix[ctx.key_group] + ctx.key_bytes \
                        + namespace
                prefix = cached
            else:
                prefix = kg_prefix[ctx.key_group] + ctx.key_bytes + namespace
        if handle is not last_handle:  # a batch's requests mostly share one state
            found = all_touched.get(handle)
            if found is None:
                found = all_touched[handle] = _Touched()
            touched = found
            last_handle = handle
        if cat <= _CAT_MAP_CONTAINS and type(request.payload) is _TtlRead:
            late = _plan_ttl_point(job, i, cat, handle, touched, prefix, request.payload)
            if late is None:
                continue
            # Read at this place in phase 3, once the writes before it are applied.
            cursor = late
            cat = _CAT_LATE
        if cat <= _CAT_MAP_CONTAINS:
            payload = request.payload
            if cat == _CAT_GET:
                key = prefix
                values = touched.values
                if values and prefix in values:
                    results[i] = from_stored(values[prefix])
                    continue
            else:
                user_key = payload
                key = prefix + user_key
                overlay = touched.maps.get(prefix)
                if overlay is not None and (overlay.cleared or user_key in overlay.entries):
                    stored = overlay.entries.get(user_key)
                    results[i] = (stored is not None) if cat == _CAT_MAP_CONTAINS \
                        else from_stored(stored)
                    continue
            touched.keys.append(key)
            touched.slots.append(~i if cat == _CAT_MAP_CONTAINS else i)
            point_reads += 1
            if track and cat != _CAT_GET:
                touched.read.add(prefix)
            continue
        if cat >= _CAT_ITER:
            if cat == _CAT_ITER:
                t = request.request_type
                # A list iteration never reaches elements appended after it started.
                upper = prefix + _pack_seq(job.list_seq) if t is _T.LIST_GET \
                    else _prefix_end(prefix)
                read = request.payload
                cursor = _Cursor(t, handle, prefix, None, upper,
                                 read if type(read) is _TtlRead else None)
            if wb is not None and (cat == _CAT_LATE or touched.written.get(prefix) == segment):
                # This iteration must see the batch's writes so far. The list sequence goes
                # with them: if the iteration fails, no element is left above the counter.
                if job.list_seq != seq_start:
                    wb.put(_SEQ_KEY, _pack_seq(job.list_seq))
                steps.append(wb)
                wb = None
                segment += 1
            steps.append((i, cursor))
            if cursor.ttl is not None:
                # It may rewrite or remove entries: later reads of the batch come after it,
                # later batches wait for it.
                touched.written[prefix] = segment
                if touched.ttl_iterated is None:
                    touched.ttl_iterated = set()
                touched.ttl_iterated.add(prefix)
            continue
        # writes
        if wb is None:
            wb = rocksdict.WriteBatch(raw_mode=True)
            put = wb.put
        cf = handle.cf_handle
        payload = request.payload
        if cat == _CAT_PUT or (cat == _CAT_CLEAR and handle.kind in _VALUE_KINDS):
            # A value-kind write: one key, noted in `values` (the overlay) only.
            if cat == _CAT_CLEAR or payload is None:
                wb.delete(prefix, cf)
                payload = None
            else:
                put(prefix, _value_bytes(payload), cf)
            touched.values[prefix] = payload
            continue
        touched.written[prefix] = segment
        if cat in (_CAT_MAP_PUT, _CAT_MAP_PUT_ALL, _CAT_MAP_REMOVE):
            overlay = touched.maps.get(prefix)
            if overlay is None:
                overlay = touched.maps[prefix] = _MapOverlay()
            entries = overlay.entries
            if cat == _CAT_MAP_REMOVE:
                wb.delete(prefix + payload, cf)
                entries[payload] = None
                continue
            for user_key, value in ((payload,) if cat == _CAT_MAP_PUT else payload):
                if value is None:
                    wb.delete(prefix + user_key, cf)
                else:
                    put(prefix + user_key, _value_bytes(value), cf)
                entries[user_key] = value
        elif cat in (_CAT_LIST_ADD, _CAT_LIST_ADD_ALL, _CAT_LIST_UPDATE):
            if cat == _CAT_LIST_UPDATE:
                wb.delete_range(prefix, _prefix_end(prefix), cf)
            seq = job.list_seq
            for value in ((payload,) if cat == _CAT_LIST_ADD else payload):
                put(prefix + _pack_seq(seq), _value_bytes(value), cf)
                seq += 1
            job.list_seq = seq
        else:  # _CAT_CLEAR of a list or map
            wb.delete_range(prefix, _prefix_end(prefix), cf)
            if handle.kind is StateKind.MAP:
                overlay = touched.maps[prefix] = _MapOverlay()
                overlay.cleared = True
    if job.list_seq != seq_start:
        if wb is None:
            wb = rocksdict.WriteBatch(raw_mode=True)
        wb.put(_SEQ_KEY, _pack_seq(job.list_seq))  # default column family: metadata
    if wb is not None:
        steps.append(wb)
    job.point_reads = point_reads + (len(job.ttl_points) if job.ttl_points else 0)
    job.writes = any(touched.written or touched.values for touched in all_touched.values())


def _plan_ttl_point(job: _Job, i: int, cat: int, handle: _StateHandle, touched: _Touched,
                    prefix: bytes, read: TtlRead) -> _Cursor | None:
    """Plan the point read `i` of a TTL state: answered from the multi-get (None), or, when
    the batch wrote this key (or a TTL iteration may have rewritten it) earlier, the late
    read to run as a step of its own."""
    key = prefix if cat == _CAT_GET else prefix + read.arg
    iterated = touched.ttl_iterated
    if (touched.values and prefix in touched.values) \
            or (touched.maps and prefix in touched.maps) \
            or (iterated is not None and prefix in iterated):
        return _Cursor(job.batch[i].request_type, handle, key, None, key, read)
    points = job.ttl_points
    if points is None:
        points = job.ttl_points = []
    if cat != _CAT_GET:
        touched.read.add(prefix)  # an earlier batch writing this map is applied first
    touched.keys.append(key)
    touched.slots.append(len(job.batch) + len(points))
    points.append(_TtlPoint(i, read, handle, key, cat == _CAT_MAP_CONTAINS))
    return None
