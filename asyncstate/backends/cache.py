"""StateCache: a bounded, write-through cache of decoded state in front of an executor.

A backend with `cache_entries > 0` (`SimulatedRemoteBackend`, `RocksDBBackend`) keeps one.
The cache holds, per (state, key, namespace), what it knows exactly:

- value, reducing and aggregating state: the stored value, or that there is none;
- list state: every element (only once a read loaded the whole list, or a write set it);
- map state: some user keys' values or absence, or every entry (`complete`).

Every request passes through `answer` once, in the order the key's requests take effect: a
write updates the cache and goes on to the backend (write-through: `BUFFERED`); a read that
the cache can answer exactly is answered (a hit: no backend call); any other read goes on
to the backend (a miss: `MISS`), and its result fills the cache when it comes back, unless
a write to the same entry was answered meanwhile (the result would be stale). So the cache
never answers other than the backend would, and each executor's ordering promise holds.

Where `answer` runs:

1. At issue time, when the controller talks to the caching backend directly (it finds the
   cache through `CachingBackend` and calls `serve_at_issue`): a hit completes the request
   there, as the heap backend does, and only writes and misses become batch requests. The
   controller may also complete a write at once (`BUFFERED`) and send it on without holding
   up its record: every later request of the same state passes this cache first and
   reaches the backend after that write, so nobody can tell, except by the time it takes
   (the operator's drain waits until the backend has applied every write).
   At trigger time, a value write that a later write of the same entry in the batch
   replaces (with no read of it between them) is left out of what goes to the backend.
2. Otherwise at trigger time, inside `execute_batch`: hits are answered, the rest of the
   batch goes to the backend in its order, and the batch is delivered once that part is.

Bounded by entries, least recently used first out: a value entry counts 1, a list or map
entry 1 plus its elements. Once full, the cache admits a new entry only for a key it turned
away before (`_admit`): keys that come once (a scan, a stream of new keys) neither push the
hot entries out nor pay for an insertion and an eviction each. Values are kept in stored
form (scalars as they are, containers packed), so every hit hands out a fresh copy.
`invalidate()` empties it (a restore calls it).

Write-back (`write_back=True`, at issue time only): a write of a value, reducing or
aggregating state (or its clear) completes in the cache alone and marks the entry dirty;
nothing goes to the backend then (a write the full cache does not admit writes through). A
dirty entry reaches the backend as one write when it is evicted (the controller sends
`take_evicted()` before any later request, so a read that misses after the eviction finds it
in the backend) or when the operator drains (`take_writes()`: every dirty entry, which stays
cached, clean), which a snapshot and a clean close do first. So a hot key's writes cost one
backend write per eviction or drain, not one per record. List and map writes stay
write-through.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final

import msgpack

from asyncstate.backends.base import BatchDelivery, ExecutorBinding
from asyncstate.errors import ConfigError
from asyncstate.packed import Packed
from asyncstate.runtime.context import RecordContext
from asyncstate.runtime.future import StateFuture
from asyncstate.runtime.requests import (
    IteratorChunk,
    RequestState,
    StateKind,
    StateRequest,
    StateRequestType,
)
from asyncstate.serde import canonical_key, decode_key, decode_value

__all__ = ["BUFFERED", "MISS", "StateCache", "backend_cache"]


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


MISS: Final = _Marker("MISS")  # `answer`: a read the backend answers
BUFFERED: Final = _Marker("BUFFERED")  # `answer`: a write, cached, that goes on to the backend
_ABSENT: Final = _Marker("ABSENT")  # a cached entry, or map user key, known to hold nothing
_UNKNOWN: Final = _Marker("UNKNOWN")  # dict.get default: nothing cached

_Packed: Final = Packed  # compiled: Final alias
_decode_value: Final = decode_value  # compiled: Final alias
_packb: Final = msgpack.Packer(use_bin_type=True, autoreset=True).pack  # compiled: Final alias
_SCALARS: Final = frozenset({type(None), bool, int, float, str, bytes})
# The full cache remembers at least this many of the keys it turned away (see `_admit`).
_SEEN_MIN: Final = 1024

_T = StateRequestType
_VALUE_GET: Final = _T.VALUE_GET  # compiled: Final alias
_VALUE_UPDATE: Final = _T.VALUE_UPDATE  # compiled: Final alias
_REDUCING_GET: Final = _T.REDUCING_GET  # compiled: Final alias
_REDUCING_ADD: Final = _T.REDUCING_ADD  # compiled: Final alias
_AGGREGATING_GET: Final = _T.AGGREGATING_GET  # compiled: Final alias
_AGGREGATING_ADD: Final = _T.AGGREGATING_ADD  # compiled: Final alias
_CLEAR: Final = _T.CLEAR  # compiled: Final alias
_LIST_GET: Final = _T.LIST_GET  # compiled: Final alias
_LIST_ADD: Final = _T.LIST_ADD  # compiled: Final alias
_LIST_UPDATE: Final = _T.LIST_UPDATE  # compiled: Final alias
_LIST_ADD_ALL: Final = _T.LIST_ADD_ALL  # compiled: Final alias
_MAP_GET: Final = _T.MAP_GET  # compiled: Final alias
_MAP_CONTAINS: Final = _T.MAP_CONTAINS  # compiled: Final alias
_MAP_PUT: Final = _T.MAP_PUT  # compiled: Final alias
_MAP_PUT_ALL: Final = _T.MAP_PUT_ALL  # compiled: Final alias
_MAP_REMOVE: Final = _T.MAP_REMOVE  # compiled: Final alias
_MAP_ITER: Final = _T.MAP_ITER  # compiled: Final alias
_MAP_ITER_KEY: Final = _T.MAP_ITER_KEY  # compiled: Final alias
_MAP_ITER_VALUE: Final = _T.MAP_ITER_VALUE  # compiled: Final alias
_MAP_IS_EMPTY: Final = _T.MAP_IS_EMPTY  # compiled: Final alias
_LOADING: Final = _T.ITERATOR_LOADING  # compiled: Final alias

_VALUE_KINDS: Final = frozenset({StateKind.VALUE, StateKind.REDUCING, StateKind.AGGREGATING})
# Reads: answered by the cache when it knows, else filled from the backend's answer.
_READS: Final = frozenset({_VALUE_GET, _REDUCING_GET, _AGGREGATING_GET, _LIST_GET, _MAP_GET,
                           _MAP_CONTAINS, _MAP_ITER, _MAP_ITER_KEY, _MAP_ITER_VALUE,
                           _MAP_IS_EMPTY})

# An entry's key: 4 bytes numbering its state, then its key bytes and namespace bytes (each
# one canonical msgpack object, so the three parts never run into each other). One bytes
# object caches its hash, so the several dict operations of a request hash it once.
EntryKey = bytes
# A dirty entry's state, key group, the request type that writes its value back, key bytes
# and namespace bytes.
_Dirty = tuple[RequestState, int, StateRequestType, bytes, bytes]


def _to_stored(value: Any) -> Any:
    """The stored form of a value the backend returned (scalars as they are)."""
    return value if type(value) in _SCALARS else _Packed(_packb(value))


def _from_stored(stored: Any) -> Any:
    return _decode_value(stored) if type(stored) is _Packed else stored


class _MapEntry:
    """What the cache knows of one map: `items` maps user key bytes to a stored value or
    `_ABSENT`; with `complete`, it holds every entry (and no `_ABSENT`)."""

    __slots__ = ("complete", "items")

    def __init__(self, complete: bool, items: dict[bytes, Any]) -> None:
        self.complete = complete
        self.items = items


class _Cursor:
    """Continuation of an iteration the cache answered: a copy of the items, the offset."""

    __slots__ = ("items", "offset", "request_type")

    def __init__(self, request_type: StateRequestType, items: list[Any], offset: int) -> None:
        self.request_type = request_type
        self.items = items
        self.offset = offset


class _Split:
    """A batch answered in part by the cache (trigger time): the requests sent on, the
    results so far and, for each request sent on, its position in the batch."""

    __slots__ = ("batch", "results", "sent", "slots")

    def __init__(self, batch: list[StateRequest], sent: list[StateRequest], results: list[Any],
                 slots: list[int]) -> None:
        self.batch = batch
        self.sent = sent
        self.results = results
        self.slots = slots


def backend_cache(cache_entries: int, cache_write_back: object) -> StateCache | None:
    """The state cache of a backend's `cache_entries` (checked by the backend: an int >= 0)
    and `cache_write_back`; None without entries. ConfigError when `cache_write_back` is no
    bool, or True without a cache."""
    if type(cache_write_back) is not bool:
        raise ConfigError("cache_write_back", cache_write_back, "True or False")
    if not cache_entries:
        if cache_write_back:
            raise ConfigError("cache_write_back", True, "False when cache_entries is 0 "
                              "(write-back is a mode of the state cache: give cache_entries "
                              "> 0 too)")
        return None
    return StateCache(cache_entries, write_back=cache_write_back)


class StateCache:
    """The cache of one backend, `capacity` entries (see the module docstring).

    The backend calls `open(binding, execute)` from its own `open`, sends every batch to
    `execute_batch` and gives its own batches to `execute` (it delivers them through the
    binding `open` returned).
    """

    __slots__ = ("_absorb", "_bypass", "_chunk", "_deliver", "_dirty", "_entries", "_execute",
                 "_get", "_issue_time", "_last_key", "_last_key_bytes", "_last_name",
                 "_last_namespace", "_mru", "_prefixes", "_read_seen", "_reading",
                 "_seen_limit", "_splits", "_stale", "_touch", "_weight", "_write_seen",
                 "capacity", "evicted", "evictions", "hits", "misses", "refused", "write_back",
                 "write_backs")

    def __init__(self, capacity: int, *, write_back: bool = False) -> None:
        if capacity < 1:
            raise ValueError(f"a StateCache holds at least 1 entry, not {capacity}")
        self.capacity = capacity
        self.write_back = write_back
        self._absorb = False  # write_back, and answering at issue time
        # Dirty entries (write-back): written in the cache, not yet sent to the backend.
        self._dirty: dict[EntryKey, _Dirty] = {}
        self._prefixes: dict[str, bytes] = {}  # state name -> the first 4 bytes of its keys
        # The last key built and what it was built from (compared by identity).
        self._last_name = ""
        self._last_key_bytes = b""
        self._last_namespace = b""
        self._last_key: EntryKey = b""
        # The key last inserted or moved to the most recent end, while it is cached (else
        # b"": an entry key is never empty): using it again needs no move. A record's read
        # and write of one entry are mostly consecutive, and on a large cache each move
        # touches nodes all over memory.
        self._mru: EntryKey = b""
        # The writes of dirty entries evicted since the controller last took them.
        self.evicted: list[StateRequest] = []
        self.write_backs = 0  # writes of dirty entries handed on
        self._entries: OrderedDict[EntryKey, Any] = OrderedDict()
        # compiled: the OrderedDict's methods bound once; called through a name, each call
        # would look the method up again (an OrderedDict is not a dict to mypyc's fast path).
        self._get: Callable[[EntryKey, Any], Any] = self._entries.get
        self._touch: Callable[[EntryKey], None] = self._entries.move_to_end
        self._weight = 0
        # Hashes of the keys a full cache turned away (see `_admit`), by how they came.
        self._read_seen: set[int] = set()
        self._write_seen: set[int] = set()
        self._seen_limit = max(capacity, _SEEN_MIN)
        # Reads of each entry on their way to the backend, and the entries written since one
        # of them was sent (their answers must not fill the cache).
        self._reading: dict[EntryKey, int] = {}
        self._stale: set[EntryKey] = set()
        self._splits: dict[int, _Split] = {}
        self._bypass: set[str] = set()  # states never cached (see `bypass`)
        self._issue_time = False
        self._chunk = 1000
        self._deliver: BatchDelivery | None = None
        self._execute: Callable[[list[StateRequest]], None] | None = None
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.refused = 0  # new entries the full cache did not admit

    def __repr__(self) -> str:
        mode = "issue time" if self._issue_time else "trigger time"
        writes = f", write-back, {len(self._dirty)} dirty" if self._absorb else ""
        return (f"<StateCache {len(self._entries)} entries, weight {self._weight}/"
                f"{self.capacity}, hits={self.hits} misses={self.misses} ({mode}{writes})>")

    # -- wiring ----------------------------------------------------------------------------

    def open(self, binding: ExecutorBinding,
             execute: Callable[[list[StateRequest]], None]) -> ExecutorBinding:
        """Bind to the operator's delivery; returns the binding the backend delivers its
        batches through (they come back here first)."""
        self._deliver = binding.deliver
        self._execute = execute
        self._chunk = binding.iterator_chunk_size
        return ExecutorBinding(loop=binding.loop, deliver=self._delivered,
                               iterator_chunk_size=binding.iterator_chunk_size,
                               max_parallelism=binding.max_parallelism)

    def serve_at_issue(self) -> None:
        """From now on the controller calls `answer` for every request at issue time, and
        batches hold only writes and misses (call before the first request). A write-back
        cache holds value writes back from here on (trigger-time answers write through)."""
        self._issue_time = True
        self._absorb = self.write_back

    def bypass(self, name: str) -> None:
        """Never cache state `name`: its requests all go to the backend, as without a cache
        (a TTL state: whether an entry has expired is the backend's answer, at its time)."""
        self._bypass.add(name)

    @property
    def size(self) -> int:
        """Entries cached."""
        return len(self._entries)

    @property
    def hit_rate(self) -> float:
        """Hits over reads answered or sent on (0.0 before any read)."""
        reads = self.hits + self.misses
        return self.hits / reads if reads else 0.0

    @property
    def dirty(self) -> int:
        """Entries written in the cache and not yet handed on to the backend."""
        return len(self._dirty) + len(self.evicted)

    def invalidate(self) -> None:
        """Forget everything (the backend's state was replaced, as by a restore), dirty
        entries included. Reads on their way fill nothing."""
        self._entries.clear()
        self._mru = b""
        self._weight = 0
        self._dirty.clear()
        self.evicted.clear()
        self._stale.update(self._reading)

    def take_evicted(self) -> list[StateRequest]:
        """The writes of the dirty entries evicted so far, in eviction order (each has a
        future without a context); the caller sends them before any later request."""
        evicted = self.evicted
        self.evicted = []
        return evicted

    def take_writes(self) -> list[StateRequest]:
        """`take_evicted()`, then the writes of every dirty entry still cached, which stay
        cached, clean."""
        writes = self.take_evicted()
        dirty = self._dirty
        if dirty:
            entries = self._entries
            for key, item in dirty.items():
                writes.append(self._write_back(key, item, entries[key]))
            dirty.clear()
        return writes

    def _write_back(self, key: EntryKey, item: _Dirty, stored: Any) -> StateRequest:
        """The request that writes dirty entry `key` (`stored`) to the backend."""
        state, key_group, t, key_bytes, namespace = item
        if stored is _ABSENT:
            t, stored = _CLEAR, None
        self.write_backs += 1
        return StateRequest(state, t, stored, namespace,
                            RecordContext(None, None, key_bytes, key_group, None), StateFuture())

    # -- batches ---------------------------------------------------------------------------

    def execute_batch(self, batch: list[StateRequest]) -> None:
        """Send `batch` to the backend; at trigger time, answer what the cache can first."""
        execute = self._execute
        assert execute is not None, "open() the backend first"
        results: list[Any] = [None] * len(batch)
        sent: list[StateRequest] = []
        slots: list[int] = []
        if self._issue_time:
            if self._coalesce(batch, sent, slots):
                self._send_part(batch, sent, results, slots)
            else:
                execute(batch)
            return
        try:
            for i in range(len(batch)):  # compiled: index loop
                request = batch[i]
                result = self.answer(request.state, request.request_type,  # type: ignore[arg-type]
                                     request.payload, request.context.key_bytes,
                                     request.namespace, request.context.key_group)
                if result is MISS or result is BUFFERED:
                    sent.append(request)
                    slots.append(i)
                else:
                    results[i] = result
        except Exception as exc:  # noqa: BLE001 - reported through deliver
            self._unregister(sent)
            self._deliver(batch, None, exc)  # type: ignore[misc]
            return
        if not sent:
            self._deliver(batch, results, None)  # type: ignore[misc]
            return
        if len(sent) == len(batch):
            execute(batch)
            return
        self._send_part(batch, sent, results, slots)

    def _send_part(self, batch: list[StateRequest], sent: list[StateRequest],
                   results: list[Any], slots: list[int]) -> None:
        """Send the requests `sent` of `batch` (at positions `slots`) to the backend; the
        batch is delivered with `results` once they come back."""
        execute = self._execute
        assert execute is not None
        self._splits[id(sent)] = _Split(batch, sent, results, slots)
        try:
            execute(sent)
        except BaseException:
            self._splits.pop(id(sent), None)
            self._unregister(sent)
            raise

    @staticmethod
    def _coalesce(batch: list[StateRequest], sent: list[StateRequest],
                  slots: list[int]) -> bool:
        """Leave out the value writes a later write of the same entry in `batch` replaces,
        with no read of it between them (their result is None either way); the requests
        kept go into `sent`, their positions into `slots`. False (nothing filled in) when
        every request is kept."""
        later: set[tuple[Any, ...]] = set()  # entries written further on, no read between
        dropped: list[int] = []
        for i in range(len(batch) - 1, -1, -1):  # compiled: index loop
            request = batch[i]
            t = request.request_type
            if t is _VALUE_UPDATE or t is _REDUCING_ADD or t is _AGGREGATING_ADD or (
                    t is _CLEAR and request.state.kind in _VALUE_KINDS):  # type: ignore[union-attr]
                key = (request.state.name,  # type: ignore[union-attr]
                       request.context.key_bytes, request.namespace)
                if key in later:
                    dropped.append(i)
                else:
                    later.add(key)
            elif t is _VALUE_GET or t is _REDUCING_GET or t is _AGGREGATING_GET:
                later.discard((request.state.name,  # type: ignore[union-attr]
                               request.context.key_bytes, request.namespace))
        if not dropped:
            return False
        dropped.reverse()
        d = 0
        for i in range(len(batch)):  # compiled: index loop
            if d < len(dropped) and dropped[d] == i:
                d += 1
                continue
            sent.append(batch[i])
            slots.append(i)
        return True

    def _delivered(self, batch: list[StateRequest], results: list[Any] | None,
                   error: BaseException | None) -> None:
        """The backend delivered one of its batches: fill the cache, deliver the batch."""
        deliver = self._deliver
        assert deliver is not None
        split = self._splits.pop(id(batch), None)
        if split is not None and split.sent is batch:
            if error is not None or results is None:
                self._unregister(batch)
                deliver(split.batch, None, error)
                return
            if len(results) != len(batch):
                self._unregister(batch)
                deliver(split.batch, results, None)  # the controller names the mismatch
                return
            self._fill_all(batch, results)
            merged = split.results
            slots = split.slots
            for i in range(len(slots)):  # compiled: index loop
                merged[slots[i]] = results[i]
            deliver(split.batch, merged, None)
            return
        if error is not None or results is None or len(results) != len(batch):
            self._unregister(batch)
        else:
            self._fill_all(batch, results)
        deliver(batch, results, error)

    def _fill_all(self, batch: list[StateRequest], results: list[Any]) -> None:
        reads = _READS
        for i in range(len(batch)):  # compiled: index loop
            request = batch[i]
            if request.request_type in reads:
                self._fill(request, results[i])

    def _unregister(self, batch: list[StateRequest]) -> None:
        reads = _READS
        for request in batch:
            if request.request_type in reads:
                self._done_reading(self._key_of(request))

    def _key_of(self, request: StateRequest) -> EntryKey:
        return self._entry_key(request.state.name,  # type: ignore[union-attr]
                               request.context.key_bytes, request.namespace)

    def _entry_key(self, name: str, key_bytes: bytes, namespace: bytes) -> EntryKey:
        if key_bytes is self._last_key_bytes and name is self._last_name and \
                namespace is self._last_namespace:
            return self._last_key  # a record's read and write of one state: the same objects
        prefix = self._prefixes.get(name)
        if prefix is None:
            prefix = self._prefixes[name] = len(self._prefixes).to_bytes(4, "big")
        key = prefix + key_bytes + namespace
        self._last_name = name
        self._last_key_bytes = key_bytes
        self._last_namespace = namespace
        self._last_key = key
        return key

    # -- the entries -----------------------------------------------------------------------

    def _put(self, key: EntryKey, entry: Any, weight: int, filled: bool = False) -> bool:
        """Cache `entry` (replacing what was there) as the most recently used; `filled`: it
        is a read's answer, else a write's effect. False when it is not cached: too large,
        or a new entry the full cache does not admit (see `_admit`)."""
        old = self._get(key, _UNKNOWN)
        if weight > self.capacity:  # too large to keep: forget it
            self._drop(key)
            return False
        if old is _UNKNOWN:
            if self._weight + weight > self.capacity and not self._admit(key, filled):
                return False
            self._entries[key] = entry
            self._weight += weight
        else:
            self._entries[key] = entry
            if key is not self._mru:
                self._touch(key)
            self._weight += weight - self._weight_of(old)
        self._mru = key
        if self._weight > self.capacity:
            self._evict()
        return True

    def _put_value(self, key: EntryKey, entry: Any, filled: bool = False) -> bool:
        """`_put` of a value kind's entry (weight 1, as any entry of its key)."""
        if key is self._mru:
            self._entries[key] = entry  # cached, at the most recent end already
            return True
        return self._put(key, entry, 1, filled)

    def _admit(self, key: EntryKey, filled: bool) -> bool:
        """Whether a new entry may push older ones out of the full cache: only when its key
        was turned away before in the same way (a read's answer, or a write) and is still
        remembered. Up to `capacity` (at least `_SEEN_MIN`) keys are remembered each way,
        all forgotten at once when that many are. So a key that comes once, read and then
        written by its record, displaces nothing; a key that comes again is cached from its
        second read (or second write without a read) on. Keys are remembered by hash: a
        collision only admits a key early."""
        seen = self._read_seen if filled else self._write_seen
        marker = hash(key)
        if marker in seen:
            seen.discard(marker)
            return True
        if len(seen) >= self._seen_limit:
            seen.clear()
        seen.add(marker)
        self.refused += 1
        return False

    def _grew(self, key: EntryKey, by: int) -> None:
        """The entry `key` (just used) grew by `by` elements."""
        self._weight += by
        if self._weight_of(self._entries[key]) > self.capacity:
            self._drop(key)
        self._evict()

    def _drop(self, key: EntryKey) -> None:
        old = self._entries.pop(key, _UNKNOWN)
        if old is not _UNKNOWN:
            if key == self._mru:
                self._mru = b""
            self._weight -= self._weight_of(old)
            self._hand_on(key, old)

    def _evict(self) -> None:
        entries = self._entries
        dirty = self._dirty
        while self._weight > self.capacity and entries:
            key, old = entries.popitem(last=False)
            if key == self._mru:  # the only entry left (compared by value: the dict's key
                self._mru = b""     # object may be another than the one last used)
            self._weight -= self._weight_of(old)
            self.evictions += 1
            if dirty:
                self._hand_on(key, old)

    def _hand_on(self, key: EntryKey, old: Any) -> None:
        """`key` (holding `old`) left the cache: if it was dirty, its write goes to
        `evicted`, never lost."""
        item = self._dirty.pop(key, None)
        if item is not None:
            self.evicted.append(self._write_back(key, item, old))

    @staticmethod
    def _weight_of(entry: Any) -> int:
        if type(entry) is list:
            return 1 + len(entry)
        if type(entry) is _MapEntry:
            return 1 + len(entry.items)
        return 1

    def _known(self, key: EntryKey) -> Any:
        """The cached entry of `key` as the most recently used, or `_UNKNOWN`."""
        entry = self._get(key, _UNKNOWN)
        if entry is not _UNKNOWN and key is not self._mru:
            self._touch(key)
            self._mru = key
        return entry

    def _miss(self, key: EntryKey) -> Any:
        """Count a read sent to the backend; its answer may fill `key`."""
        self.misses += 1
        reading = self._reading
        reading[key] = reading.get(key, 0) + 1
        return MISS

    def _written(self, key: EntryKey) -> None:
        """A write to `key`: answers of reads sent before it are stale."""
        if self._reading and key in self._reading:
            self._stale.add(key)

    def _done_reading(self, key: EntryKey) -> bool:
        """One read of `key` came back; whether its answer may fill the cache."""
        reading = self._reading
        count = reading.get(key, 0)
        if count <= 0:
            return False
        stale = key in self._stale
        if count == 1:
            del reading[key]
            if stale:
                self._stale.discard(key)
        else:
            reading[key] = count - 1
        return not stale

    def _map_entry(self, key: EntryKey, filled: bool = False) -> _MapEntry:
        """The cached map of `key`, created (knowing nothing) if missing; the one created is
        not cached when the cache does not admit it (`key not in self._entries`)."""
        entry = self._known(key)
        if type(entry) is _MapEntry:
            return entry
        created = _MapEntry(False, {})
        self._put(key, created, 1, filled)
        return created

    # -- answering -------------------------------------------------------------------------

    def answer(self, state: RequestState, request_type: StateRequestType, payload: Any,
               key_bytes: bytes, namespace: bytes, key_group: int) -> Any:
        """Apply one request to the cache: the result of a read it can answer, `MISS` for
        a read it cannot, `BUFFERED` for a write that must go on to the backend (the cache
        holds its effect), None for a write held back (write-back, value kinds). Every
        request of a state the cache bypasses is a `MISS`."""
        t = request_type
        name = state.name
        if name in self._bypass:
            return MISS  # sent on as it is; its answer fills nothing (no read registered)
        if t is _LOADING:
            continuation = payload[1]
            if type(continuation) is _Cursor:
                self.hits += 1
                return self._chunk_of(continuation.request_type, continuation.items,
                                      continuation.offset, copy=False)
            self.misses += 1  # a further chunk the store loads: a read sent to it
            return MISS
        key = self._entry_key(name, key_bytes, namespace)
        if t is _VALUE_GET or t is _REDUCING_GET or t is _AGGREGATING_GET:
            entry = self._known(key)
            if entry is _UNKNOWN:
                return self._miss(key)
            self.hits += 1
            return None if entry is _ABSENT else _from_stored(entry)
        if t is _VALUE_UPDATE or t is _REDUCING_ADD or t is _AGGREGATING_ADD:
            self._written(key)
            cached = self._put_value(key, _ABSENT if payload is None else payload)
            if self._absorb and cached:
                dirty = self._dirty
                item = dirty.get(key)
                if item is None or item[2] is not t or item[0] is not state:
                    dirty[key] = (state, key_group, t, key_bytes, namespace)  # else kept
                return None
            return BUFFERED
        if t in _READS:
            return self._answer_read(key, t, payload)
        self._written(key)
        if self._absorb and t is _CLEAR and state.kind in _VALUE_KINDS:
            if self._put_value(key, _ABSENT):
                self._dirty[key] = (state, key_group, _CLEAR, key_bytes, namespace)
                return None
            return BUFFERED
        self._write(key, t, payload, state.kind)
        return BUFFERED

    def _answer_read(self, key: EntryKey, t: StateRequestType, payload: Any) -> Any:
        entry = self._known(key)
        if entry is _UNKNOWN:
            return self._miss(key)
        if t is _LIST_GET:
            if type(entry) is not list:
                return self._miss(key)
            self.hits += 1
            return self._chunk_of(t, entry, 0)
        if type(entry) is not _MapEntry:
            return self._miss(key)
        items = entry.items
        if t is _MAP_GET or t is _MAP_CONTAINS:
            stored = items.get(payload, _UNKNOWN)
            if stored is _UNKNOWN and not entry.complete:
                return self._miss(key)
            self.hits += 1
            present = stored is not _UNKNOWN and stored is not _ABSENT
            if t is _MAP_CONTAINS:
                return present
            return _from_stored(stored) if present else None
        if t is _MAP_IS_EMPTY:
            if entry.complete:
                self.hits += 1
                return not items
            for stored in items.values():
                if stored is not _ABSENT:
                    self.hits += 1
                    return False
            return self._miss(key)
        # MAP_ITER, MAP_ITER_KEY, MAP_ITER_VALUE
        if not entry.complete:
            return self._miss(key)
        self.hits += 1
        return self._chunk_of(t, list(items.items()), 0, copy=False)

    def _write(self, key: EntryKey, t: StateRequestType, payload: Any,
               kind: StateKind) -> None:
        if t is _CLEAR:
            if kind is StateKind.LIST:
                self._put(key, [], 1)
            elif kind is StateKind.MAP:
                self._put(key, _MapEntry(True, {}), 1)
            else:
                self._put(key, _ABSENT, 1)
        elif t is _LIST_ADD or t is _LIST_ADD_ALL:
            entry = self._known(key)
            if type(entry) is list:  # else the list is not known whole: nothing to update
                added = [payload] if t is _LIST_ADD else list(payload)
                entry.extend(added)
                self._grew(key, len(added))
        elif t is _LIST_UPDATE:
            elements = list(payload) if payload else []
            self._put(key, elements, 1 + len(elements))
        elif t is _MAP_PUT or t is _MAP_REMOVE or t is _MAP_PUT_ALL:
            pairs = [payload] if t is _MAP_PUT else \
                [(payload, None)] if t is _MAP_REMOVE else payload
            entry = self._map_entry(key)
            items = entry.items
            before = len(items)
            for user_key, stored in pairs:
                if stored is not None:
                    items[user_key] = stored
                elif entry.complete:
                    items.pop(user_key, None)
                else:
                    items[user_key] = _ABSENT
            if key in self._entries:
                self._grew(key, len(items) - before)
        else:
            # A request type the cache does not model: forget the entry, never guess.
            self._drop(key)

    def _chunk_of(self, t: StateRequestType, items: list[Any], offset: int, *,
                  copy: bool = True) -> IteratorChunk:
        """One chunk of an iteration over `items` (list elements or map (user key, stored)
        pairs) from `offset`; a longer iteration continues over a copy taken now."""
        end = offset + self._chunk
        part = items[offset:end]
        if t is _LIST_GET:
            decoded = [_from_stored(x) for x in part]
        elif t is _MAP_ITER:
            decoded = [(decode_key(k), _from_stored(v)) for k, v in part]
        elif t is _MAP_ITER_KEY:
            decoded = [decode_key(k) for k, _v in part]
        else:
            decoded = [_from_stored(v) for _k, v in part]
        if end >= len(items):
            return IteratorChunk(decoded, None)
        return IteratorChunk(decoded, _Cursor(t, list(items) if copy else items, end))

    # -- filling ---------------------------------------------------------------------------

    def _fill(self, request: StateRequest, result: Any) -> None:
        """A read sent to the backend came back with `result`: cache what it tells."""
        key = self._key_of(request)
        if not self._done_reading(key):
            return
        t = request.request_type
        if t is _VALUE_GET or t is _REDUCING_GET or t is _AGGREGATING_GET:
            self._put_value(key, _ABSENT if result is None else _to_stored(result), True)
        elif t is _LIST_GET:
            if type(result) is IteratorChunk and result.continuation is None:
                elements = [_to_stored(x) for x in result.items]
                self._put(key, elements, 1 + len(elements), True)
        elif t is _MAP_GET or t is _MAP_CONTAINS:
            if t is _MAP_CONTAINS and result:
                return  # present, but its value is not known
            entry = self._map_entry(key, True)
            if key not in self._entries:
                return
            # Absent: a get's None, or a contains' False (a get's False is a stored value).
            absent = result is None or t is _MAP_CONTAINS
            before = len(entry.items)
            if entry.complete:
                if not absent:
                    entry.items[request.payload] = _to_stored(result)
            else:
                entry.items[request.payload] = _ABSENT if absent else _to_stored(result)
            self._grew(key, len(entry.items) - before)
        elif t is _MAP_ITER:
            if type(result) is IteratorChunk and result.continuation is None:
                items = {canonical_key(k): _to_stored(v) for k, v in result.items}
                self._put(key, _MapEntry(True, items), 1 + len(items), True)
        elif t is _MAP_IS_EMPTY and result is True:
            self._put(key, _MapEntry(True, {}), 1, True)
