"""HeapBackend: keyed state in Python dicts, completing requests at issue time."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final

import msgpack

from asyncstate.backends.base import ExecutorBinding
from asyncstate.backends.heap_ttl import (
    LIST,
    MAP,
    SCALAR,
    HeapTtl,
    TtlWalk,
    list_visible,
    map_contains,
    map_get,
    map_is_empty,
    map_visible,
    value_get,
    walk_chunk,
)
from asyncstate.config import check_backend_state
from asyncstate.errors import InvalidStateError, KeyGroupError
from asyncstate.keygroups import KeyGroupRange
from asyncstate.runtime.requests import (
    IteratorChunk,
    RequestState,
    StateKind,
    StateRequest,
    StateRequestType,
)
from asyncstate.serde import (
    NONE_BYTES,
    Packed,
    check_key_bytes,
    check_value_bytes,
    decode_key,
    decode_value,
    from_stored,
    key_group_of_bytes,
)
from asyncstate.state.ttl.layout import TtlRead, TtlValue
from asyncstate.state.ttl.tracker import TtlTracker

__all__ = ["HeapBackend"]

_T = StateRequestType
# Request types read per request (a compiled module reads a Final from a C static; `_T.X`
# costs a module dict lookup and an attribute lookup on the enum class, ~1 K instructions).
_ITERATOR_LOADING: Final = StateRequestType.ITERATOR_LOADING  # compiled: Final alias
_LIST_GET: Final = StateRequestType.LIST_GET  # compiled: Final alias
_MAP_ITER: Final = StateRequestType.MAP_ITER  # compiled: Final alias
_MAP_ITER_KEY: Final = StateRequestType.MAP_ITER_KEY  # compiled: Final alias
_MAP_ITER_VALUE: Final = StateRequestType.MAP_ITER_VALUE  # compiled: Final alias
_Packed: Final = Packed  # compiled: Final alias
_TtlRead: Final = TtlRead  # compiled: Final alias
_SHAPES: Final = {StateKind.LIST: LIST, StateKind.MAP: MAP}
# An entry of the default namespace is keyed by its key bytes alone; any other namespace by
# (key bytes, namespace bytes). bytes never equal tuples, so the two cannot collide, and the
# common case hashes and compares one bytes object instead of a tuple (faster on a large
# table, where each lookup's memory accesses dominate).
TableKey = bytes | tuple[bytes, bytes]
Table = dict[TableKey, Any]
Op = Callable[[Table, bytes, bytes, Any], Any]
# A snapshot entry is (state name, key bytes, namespace bytes, data); data per kind: value
# bytes (value, reducing, aggregating), a list of element bytes (list), a list of (user key
# bytes, value bytes) pairs (map). See asyncstate/checkpoint/snapshot.py.

_state_name = operator.itemgetter(0)
_unpackb = msgpack.unpackb
# First bytes of msgpack containers and ext types: values kept packed on restore (as
# `to_stored` would have); everything else is a scalar, decoded once at restore.
_PACKED_FIRST_BYTES = frozenset(
    [*range(0x80, 0xA0), 0xC7, 0xC8, 0xC9, *range(0xD4, 0xD9), *range(0xDC, 0xE0)])


def _table_key(key_bytes: bytes, ns: bytes) -> TableKey:
    """The table key of an entry (see `TableKey`); the value ops inline it."""
    return key_bytes if ns == NONE_BYTES else (key_bytes, ns)


def _encode_list(stored: list[Any], packb: Callable[[Any], bytes]) -> list[bytes]:
    return [x if type(x) is Packed else packb(x) for x in stored]


def _encode_map(stored: dict[bytes, Any],
                packb: Callable[[Any], bytes]) -> list[tuple[bytes, bytes]]:
    return [(uk, v if type(v) is Packed else packb(v)) for uk, v in stored.items()]


_ENCODE_CONTAINER: dict[StateKind, Callable[[Any, Callable[[Any], bytes]], Any]] = {
    StateKind.LIST: _encode_list,
    StateKind.MAP: _encode_map,
}


def _from_bytes(data: bytes) -> Any:
    if data[0] in _PACKED_FIRST_BYTES:
        return _checked_packed(data)
    try:
        return _unpackb(data)
    except (ValueError, TypeError, msgpack.UnpackException):
        check_value_bytes(data)  # raises, naming the bytes
        raise


def _checked_packed(data: bytes) -> Packed:
    """Restored container bytes, kept packed once they are known to decode."""
    check_value_bytes(data)
    return Packed(data)


def _checked_user_key(data: object) -> Any:
    """Restored map user key bytes, kept encoded once they are known to decode."""
    # compiled: typed as object (the compiled build raises check_key_bytes' error, not its own).
    check_key_bytes(data)
    return data


def _replace(table: Table, key: Any, container: list[Any] | dict[Any, Any]) -> None:
    """Store a restored list or map under `key`; an empty one is no entry, as RocksDB
    stores it: it replaces what was there with nothing."""
    if container:
        table[key] = container
    else:
        table.pop(key, None)


def _entry(item: tuple[bytes, Any]) -> tuple[Any, Any]:
    return (decode_key(item[0]), from_stored(item[1]))


def _key(item: tuple[bytes, Any]) -> Any:
    return decode_key(item[0])


def _value(item: tuple[bytes, Any]) -> Any:
    return from_stored(item[1])


_ITEM_DECODERS: dict[StateRequestType, Callable[[Any], Any]] = {
    _T.LIST_GET: from_stored,
    _T.MAP_ITER: _entry,
    _T.MAP_ITER_KEY: _key,
    _T.MAP_ITER_VALUE: _value,
}


class HeapBackend:
    """Keyed state in memory.

    Tables map a key and namespace (see `TableKey`) to a stored value, a list of stored
    values (list state) or a dict from user-key bytes to stored values (map state). Having no
    I/O to amortize, it completes every request when it is issued (`execute_one`); batches
    sent to `execute_batch` (when it is wrapped by another executor) are applied in order
    and delivered inline. Iteration reads a copy taken when the iteration starts.

    A TTL state's table holds `TtlValue`s instead of stored forms, and its reads carry a
    `TtlRead` payload (`asyncstate.backends.heap_ttl`).
    """

    completes_at_issue = True

    def __init__(self) -> None:
        self._tables: dict[str, Table] = {}
        self._kinds: dict[str, StateKind] = {}
        self._binding: ExecutorBinding | None = None
        self._chunk = 1000
        self._closed = False
        self._ttl = HeapTtl()  # which states are timestamped, and their cleanup
        ops: dict[StateRequestType, Op] = {
            _T.CLEAR: self._clear,
            _T.VALUE_GET: self._value_get,
            _T.VALUE_UPDATE: self._value_update,
            _T.LIST_GET: self._list_get,
            _T.LIST_ADD: self._list_add,
            _T.LIST_UPDATE: self._list_update,
            _T.LIST_ADD_ALL: self._list_add_all,
            _T.MAP_GET: self._map_get,
            _T.MAP_CONTAINS: self._map_contains,
            _T.MAP_PUT: self._map_put,
            _T.MAP_PUT_ALL: self._map_put_all,
            _T.MAP_ITER: self._map_entries,
            _T.MAP_ITER_KEY: self._map_keys,
            _T.MAP_ITER_VALUE: self._map_values,
            _T.MAP_REMOVE: self._map_remove,
            _T.MAP_IS_EMPTY: self._map_is_empty,
            _T.REDUCING_GET: self._value_get,
            _T.REDUCING_ADD: self._value_update,
            _T.AGGREGATING_GET: self._value_get,
            _T.AGGREGATING_ADD: self._value_update,
        }
        # Indexed by the int value of the request type: one list lookup per request.
        self._ops: list[Op | None] = [
            ops.get(t) for t in StateRequestType
        ]
        self.immediate_ops = self._ops

    def __repr__(self) -> str:
        return f"<HeapBackend states={sorted(self._tables)}>"

    # -- checkpoints -----------------------------------------------------------------------

    def registered_states(self) -> dict[str, StateKind]:
        """Every registered state and its kind."""
        return dict(self._kinds)

    def snapshot_key_group(self, key_group: int,
                           max_parallelism: int | None = None) -> Iterator[Sequence[Any]]:
        """The entries of one key group (a full pass over the tables: for many key groups
        use `snapshot_key_groups`). `max_parallelism` defaults to the operator's."""
        if max_parallelism is None:
            if self._binding is None:
                raise InvalidStateError("open() the backend or pass max_parallelism")
            max_parallelism = self._binding.max_parallelism
        groups = self._group(KeyGroupRange(key_group, key_group), max_parallelism, strict=False)
        if key_group not in groups:
            return iter(())
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=2**31 - 1)
        unpacker.feed(groups[key_group][1])
        return iter(list(unpacker))

    def snapshot_key_groups(self, key_groups: KeyGroupRange,
                            max_parallelism: int) -> dict[int, tuple[int, bytes]]:
        """Every entry, grouped by key group in one pass over the tables: for each non-empty
        key group, ``(number of entries, the entries msgpack-encoded back to back)``.

        Encoding while walking the tables (rather than per key group afterwards) keeps memory
        access sequential, which makes it several times faster. The result is a copy: the
        tables may change once this returns. Raises KeyGroupError when an entry lies outside
        `key_groups` (it would be missing from the checkpoint).
        """
        return self._group(key_groups, max_parallelism, strict=True)

    def _group(self, key_groups: KeyGroupRange, max_parallelism: int, *,
               strict: bool) -> dict[int, tuple[int, bytes]]:
        start, n = key_groups.start, len(key_groups)
        buckets: list[list[bytes]] = [[] for _ in range(n)]
        # A Packer per call: packers are not shared between threads.
        packb = msgpack.Packer(use_bin_type=True).pack
        for name in sorted(self._tables):
            kind = self._kinds[name]
            if name in self._ttl.layouts:
                def place(key_bytes: bytes, name: str = name) -> int:
                    i = key_group_of_bytes(key_bytes, max_parallelism) - start
                    if 0 <= i < n:
                        return i
                    if strict:
                        raise KeyGroupError(
                            f"HeapBackend holds state {name!r} of key group {i + start}, "
                            f"outside the key groups {start}..{key_groups.end} being "
                            "snapshotted", key_group=i + start)
                    return -1
                self._ttl.group(name, _SHAPES.get(kind, SCALAR), self._tables[name], place,
                                packb, buckets)
                continue
            encode = _ENCODE_CONTAINER.get(kind)
            for k, stored in self._tables[name].items():
                key_bytes, ns = k if isinstance(k, tuple) else (k, NONE_BYTES)
                i = key_group_of_bytes(key_bytes, max_parallelism) - start
                if not 0 <= i < n:
                    if strict:
                        raise KeyGroupError(
                            f"HeapBackend holds state {name!r} of key group {i + start}, "
                            f"outside the key groups {start}..{key_groups.end} being "
                            "snapshotted", key_group=i + start)
                    continue
                if encode is not None:  # list or map state
                    data: Any = encode(stored, packb)
                elif type(stored) is Packed:  # value, reducing, aggregating
                    data = stored
                else:
                    data = packb(stored)
                buckets[i].append(packb((name, key_bytes, ns, data)))
        return {i + start: (len(bucket), b"".join(bucket))
                for i, bucket in enumerate(buckets) if bucket}

    def restore_key_group(self, key_group: int, entries: Iterable[Sequence[Any]]) -> None:
        """Store snapshot entries (as produced by `snapshot_key_group`) of one key group,
        replacing what the backend holds for those (state, key, namespace). Each state must
        be registered first."""
        unpackb, packed_first = _unpackb, _PACKED_FIRST_BYTES
        for name, run in itertools.groupby(entries, _state_name):
            kind = self._kinds.get(name)
            if kind is None:
                raise KeyError(f"state {name!r} is not registered in this HeapBackend")
            table = self._tables[name]
            if name in self._ttl.layouts:
                self._ttl.restore(name, _SHAPES.get(kind, SCALAR), table, run, _from_bytes,
                                  _checked_user_key)
            elif kind is StateKind.LIST:
                for _, key_bytes, ns, data in run:
                    _replace(table, _table_key(key_bytes, ns), [_from_bytes(x) for x in data])
            elif kind is StateKind.MAP:
                for _, key_bytes, ns, data in run:
                    _replace(table, _table_key(key_bytes, ns),
                             {_checked_user_key(uk): _from_bytes(v) for uk, v in data})
            else:  # value, reducing, aggregating; _from_bytes inlined (hot loop)
                data = None
                try:
                    for _, key_bytes, ns, data in run:
                        table[_table_key(key_bytes, ns)] = (
                            _checked_packed(data) if data[0] in packed_first
                            else unpackb(data))
                except (ValueError, TypeError, msgpack.UnpackException):
                    if type(data) is bytes:
                        check_value_bytes(data)  # raises, naming the bytes, if they are bad
                    raise

    # -- TtlBackend ------------------------------------------------------------------------

    def ttl_layouts(self) -> dict[str, str]:
        """The time domain of every state stored with timestamps."""
        return dict(self._ttl.layouts)

    def set_ttl_layout(self, name: str, domain: str | None, stamp: int | None) -> None:
        """Store state `name` with timestamps of `domain` (None: without) from now on,
        rewriting its entries stored the other way (see `TtlBackend`)."""
        kind = self._kinds.get(name)
        if kind is None:
            raise KeyError(f"state {name!r} is not registered in this HeapBackend")
        self._ttl.set_layout(name, _SHAPES.get(kind, SCALAR), self._tables[name], domain,
                             stamp)

    def has_entries(self, name: str) -> bool:
        """True when state `name` stores any entry."""
        return bool(self._tables.get(name))

    def track_ttl(self, name: str, tracker: TtlTracker | None) -> None:
        """Clean state `name` up as `tracker` asks (or no longer)."""
        self._ttl.track(name, tracker)

    def ttl_cleanup_step(self, name: str, budget: int, now: int) -> None:
        """Incremental cleanup of state `name`: up to `budget` table entries from its cursor
        on. The heap applies every request when it is issued, so the step runs now."""
        kind = self._kinds.get(name)
        if kind is not None:
            self._ttl.step(name, _SHAPES.get(kind, SCALAR), self._tables[name], budget, now)

    # -- StateExecutor ---------------------------------------------------------------------

    def open(self, binding: ExecutorBinding) -> None:
        if self._binding is not None:
            raise InvalidStateError(
                "this HeapBackend is already bound to an operator; create one backend per operator")
        self._binding = binding
        self._chunk = binding.iterator_chunk_size

    def register_state(self, name: object, kind: object) -> Table:
        # compiled: typed as object (the compiled build raises these errors, not its own).
        name, kind = check_backend_state(name, kind)
        known = self._kinds.get(name)
        if known is None:
            self._kinds[name] = kind
            self._tables[name] = {}
        elif known is not kind:
            raise ValueError(
                f"state {name!r} is already registered as {known.value} state, "
                f"cannot register it again as {kind.value} state")
        return self._tables[name]

    def execute_one(self, state: RequestState, request_type: StateRequestType, payload: Any,
                    key_bytes: bytes, namespace: bytes) -> Any:
        if request_type is _ITERATOR_LOADING:
            return self._next_chunk(payload)
        op = self._ops[request_type]
        if op is None:
            raise ValueError(f"HeapBackend cannot execute {request_type.name}")
        return op(state.handle, key_bytes, namespace, payload)

    def execute_batch(self, batch: list[StateRequest]) -> None:
        assert self._binding is not None, "open() the backend first"
        try:
            # compiled: a direct native call per request (a bound method is a Python call)
            results = [self.execute_one(r.state, r.request_type,  # type: ignore[arg-type]
                                        r.payload, r.context.key_bytes, r.namespace)
                       for r in batch]
        except Exception as exc:  # noqa: BLE001 - reported through deliver
            self._binding.deliver(batch, None, exc)
            return
        self._binding.deliver(batch, results, None)

    def fully_loaded(self) -> bool:
        return False

    def close(self) -> None:
        self._closed = True

    # -- storage operations ----------------------------------------------------------------

    @staticmethod
    def _clear(table: Table, key: bytes, ns: bytes, payload: Any) -> None:
        table.pop(key if ns == NONE_BYTES else (key, ns), None)

    @staticmethod
    def _value_get(table: Table, key: bytes, ns: bytes, payload: Any) -> Any:
        if payload is not None:  # a TtlRead
            return value_get(table, key if ns == NONE_BYTES else (key, ns), payload)
        stored = table.get(key if ns == NONE_BYTES else (key, ns))
        return decode_value(stored) if type(stored) is _Packed else stored

    @staticmethod
    def _value_update(table: Table, key: bytes, ns: bytes, payload: Any) -> None:
        if payload is None:
            table.pop(key if ns == NONE_BYTES else (key, ns), None)
        elif type(payload) is TtlValue:
            # A TTL state's write updates the entry it replaces in place: the stored entry
            # lives as long as its key, and freeing it instead would unlink it from the
            # cyclic GC's list, whose neighbours are other keys' entries (cache misses).
            k = key if ns == NONE_BYTES else (key, ns)
            entry = table.get(k)
            if type(entry) is TtlValue:
                entry.ts = payload.ts
                entry.stored = payload.stored
            else:
                table[k] = payload
        else:
            table[key if ns == NONE_BYTES else (key, ns)] = payload

    def _chunk_of(self, request_type: StateRequestType, items: list[Any],
                  offset: int) -> IteratorChunk:
        end = offset + self._chunk
        decode = _ITEM_DECODERS[request_type]
        chunk = [decode(x) for x in items[offset:end]]
        return IteratorChunk(chunk, (request_type, items, end) if end < len(items) else None)

    def _walk_chunk(self, request_type: StateRequestType, walk: TtlWalk,
                    offset: int) -> IteratorChunk:
        items, end = walk_chunk(walk, offset, self._chunk)
        decode = _ITEM_DECODERS[request_type]
        chunk = [decode(x) for x in items]
        return IteratorChunk(chunk, (request_type, walk, end) if end < len(walk.entries)
                             else None)

    def _ttl_iteration(self, request_type: StateRequestType, shape: int, table: Table, k: Any,
                       read: Any) -> IteratorChunk:
        """The first chunk of a TTL read of the list or map stored under `k`."""
        stored = table.get(k)
        if not stored:
            return IteratorChunk([], None)
        if len(stored) > self._chunk:  # the read goes chunk by chunk
            entries = list(stored) if shape == LIST else list(stored.items())
            return self._walk_chunk(request_type, TtlWalk(shape, table, k, entries, read), 0)
        # One chunk holds every item the read returns: a fresh list of them.
        visible = list_visible(table, k, stored, read) if shape == LIST \
            else map_visible(table, k, stored, read)
        return self._chunk_of(request_type, visible, 0) if visible else IteratorChunk([], None)

    def _next_chunk(self, payload: Any) -> IteratorChunk:
        _original_type, continuation = payload
        request_type, items, offset = continuation
        if type(items) is TtlWalk:
            return self._walk_chunk(request_type, items, offset)
        return self._chunk_of(request_type, items, offset)

    def _list_get(self, table: Table, key: bytes, ns: bytes, payload: Any) -> IteratorChunk:
        if payload is not None:  # a TtlRead
            return self._ttl_iteration(_LIST_GET, LIST, table, _table_key(key, ns), payload)
        items = table.get(_table_key(key, ns))
        if not items:
            return IteratorChunk([], None)
        if len(items) > self._chunk:
            items = list(items)  # the iteration reads a copy
        return self._chunk_of(_LIST_GET, items, 0)

    @staticmethod
    def _list_add(table: Table, key: bytes, ns: bytes, payload: Any) -> None:
        k = _table_key(key, ns)
        items = table.get(k)
        if items is None:
            table[k] = [payload]
        else:
            items.append(payload)

    @staticmethod
    def _list_update(table: Table, key: bytes, ns: bytes, payload: Any) -> None:
        if payload:
            table[_table_key(key, ns)] = list(payload)
        else:
            table.pop(_table_key(key, ns), None)

    @staticmethod
    def _list_add_all(table: Table, key: bytes, ns: bytes, payload: Any) -> None:
        if payload:
            k = _table_key(key, ns)
            items = table.get(k)
            if items is None:
                table[k] = list(payload)
            else:
                items.extend(payload)

    @staticmethod
    def _map_get(table: Table, key: bytes, ns: bytes, payload: Any) -> Any:
        if type(payload) is _TtlRead:
            return map_get(table, _table_key(key, ns), payload)
        entries = table.get(_table_key(key, ns))
        return None if entries is None else from_stored(entries.get(payload))

    @staticmethod
    def _map_contains(table: Table, key: bytes, ns: bytes, payload: Any) -> bool:
        if type(payload) is _TtlRead:
            return map_contains(table, _table_key(key, ns), payload)
        entries = table.get(_table_key(key, ns))
        return entries is not None and payload in entries

    @staticmethod
    def _map_put(table: Table, key: bytes, ns: bytes, payload: Any) -> None:
        user_key, value = payload
        k = _table_key(key, ns)
        entries = table.get(k)
        if value is None:
            if entries is not None:
                entries.pop(user_key, None)
                if not entries:
                    del table[k]
        elif entries is None:
            table[k] = {user_key: value}
        else:
            entries[user_key] = value

    @staticmethod
    def _map_put_all(table: Table, key: bytes, ns: bytes, payload: Any) -> None:
        for item in payload:
            HeapBackend._map_put(table, key, ns, item)

    @staticmethod
    def _map_remove(table: Table, key: bytes, ns: bytes, payload: Any) -> None:
        k = _table_key(key, ns)
        entries = table.get(k)
        if entries is not None:
            entries.pop(payload, None)
            if not entries:
                del table[k]

    @staticmethod
    def _map_is_empty(table: Table, key: bytes, ns: bytes, payload: Any) -> bool:
        if payload is not None:  # a TtlRead
            return map_is_empty(table, _table_key(key, ns), payload)
        return not table.get(_table_key(key, ns))

    def _map_iter(self, request_type: StateRequestType, table: Table,
                  key: bytes, ns: bytes, payload: Any) -> IteratorChunk:
        if payload is not None:  # a TtlRead
            return self._ttl_iteration(request_type, MAP, table, _table_key(key, ns), payload)
        entries = table.get(_table_key(key, ns))
        if not entries:
            return IteratorChunk([], None)
        return self._chunk_of(request_type, list(entries.items()), 0)

    def _map_entries(self, table: Table, key: bytes, ns: bytes, payload: Any) -> IteratorChunk:
        return self._map_iter(_MAP_ITER, table, key, ns, payload)

    def _map_keys(self, table: Table, key: bytes, ns: bytes, payload: Any) -> IteratorChunk:
        return self._map_iter(_MAP_ITER_KEY, table, key, ns, payload)

    def _map_values(self, table: Table, key: bytes, ns: bytes, payload: Any) -> IteratorChunk:
        return self._map_iter(_MAP_ITER_VALUE, table, key, ns, payload)
