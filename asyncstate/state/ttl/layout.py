"""The stored form of a TTL state's entries, shared by every backend and the checkpoint format,
and the expiry rule.

In bytes (RocksDB values, checkpoint data), a timestamped value is the msgpack array
``[last_access, value]`` with the timestamp always encoded as an int64 (``0xd3`` and 8
big-endian bytes)::

    0x92 0xd3 | last access (8 bytes, signed, big-endian) | the value's msgpack bytes

so it is at once valid msgpack (checkpoint checks read it as one value) and a fixed 10-byte
header before the value's own bytes (a backend reads the timestamp without decoding the value).
The bytes alone do not say whether a state is timestamped: a plain value could be such an
array too, so every backend and every checkpoint records which states are (`ttl_layouts`).

In memory (the heap backend, and the write requests of TTL states), an entry is a `TtlValue`:
the timestamp and the value's stored form (`asyncstate.serde.to_stored`).

Reads of TTL states carry a `TtlRead`: the state's `TtlPolicy` and the time the read was
issued, so that a backend applies expiry, visibility, refresh and cleanup on read the way the
state asked, whenever it executes the read.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any, Final

from asyncstate._compiled import mypyc_attr
from asyncstate.serde import check_value_bytes, stored_to_bytes

if TYPE_CHECKING:
    from mypy_extensions import i64

__all__ = [
    "EXPIRED_HIDDEN",
    "EXPIRED_RETURNED",
    "FRESH",
    "HEADER",
    "HEADER_SIZE",
    "MAX_TIMESTAMP",
    "MIN_TIMESTAMP",
    "TtlPolicy",
    "TtlRead",
    "TtlValue",
    "check_timestamped",
    "encode",
    "expiration",
    "is_expired",
    "outcome",
    "timestamp_of",
    "to_bytes",
]

MIN_TIMESTAMP: Final = -(2**63)
MAX_TIMESTAMP: Final = 2**63 - 1
# The largest int the compiled build keeps unboxed: comparisons with MAX_TIMESTAMP (a boxed
# int there) only run beyond it, so the common case never boxes.
_SHORT_MAX: Final = 2**62 - 1
HEADER: Final = b"\x92\xd3"  # a msgpack array of two, then an int64
HEADER_SIZE: Final = 10
_I64 = struct.Struct(">q")
_unpack_ts: Final = _I64.unpack_from  # compiled: Final alias
# The whole header in one call: one bytes object instead of the header and the timestamp.
_pack_header: Final = struct.Struct(">BBq").pack  # compiled: Final alias

# What a read of one stored entry finds (`outcome`).
FRESH: Final = 0
EXPIRED_HIDDEN: Final = 1  # expired, and reads as absent
EXPIRED_RETURNED: Final = 2  # expired, and returned all the same (RETURN_EXPIRED_IF_NOT_CLEANED_UP)


def expiration(ts: int, ttl_ms: int) -> int:
    """When an entry last accessed at `ts` expires: ``ts + ttl_ms``, clamped to 2**63 - 1."""
    exp = ts + ttl_ms
    if exp > _SHORT_MAX and exp > MAX_TIMESTAMP:
        return MAX_TIMESTAMP
    return exp


def is_expired(ts: int, ttl_ms: int, now: int) -> bool:
    """True when an entry last accessed at `ts` has expired at `now` (now <= 2**63 - 1)."""
    # The clamped sum is <= now exactly when the sum is, or when now is the largest time.
    return ts + ttl_ms <= now or (now > _SHORT_MAX and now >= MAX_TIMESTAMP)


class TtlPolicy:
    """How a TTL state's reads treat what they find: the duration, whether a read refreshes
    the timestamp of what it returns, whether it may return an expired entry, and whether it
    removes the expired entries it finds (cleanup on read)."""

    __slots__ = ("cleanup_on_read", "return_expired", "ttl_ms", "update_on_read")

    def __init__(self, ttl_ms: int, update_on_read: bool, return_expired: bool,
                 cleanup_on_read: bool) -> None:
        self.ttl_ms = ttl_ms
        self.update_on_read = update_on_read
        self.return_expired = return_expired
        self.cleanup_on_read = cleanup_on_read

    def __repr__(self) -> str:
        return (f"<TtlPolicy ttl_ms={self.ttl_ms} update_on_read={self.update_on_read} "
                f"return_expired={self.return_expired} cleanup_on_read={self.cleanup_on_read}>")


# compiled: mypyc_attr. Both classes are allocated for every TTL request. Neither can be part of
# a reference cycle (a stored form is a scalar or packed bytes, `arg` a user key's bytes or
# None): acyclic, the compiled build leaves them out of the cyclic GC (no tracking, and a heap
# table of `TtlValue`s is never walked); free_list_len=1 reuses a freed instance (a read's
# `TtlRead` and a write's `TtlValue` die with their request).
@mypyc_attr(acyclic=True, free_list_len=1)
class TtlValue:
    """A timestamped entry in memory: its last access time and its value's stored form."""

    __slots__ = ("stored", "ts")

    def __init__(self, ts: int, stored: Any) -> None:
        self.ts = ts
        self.stored = stored

    def __repr__(self) -> str:
        return f"TtlValue({self.ts}, {self.stored!r})"


@mypyc_attr(acyclic=True, free_list_len=1)
class TtlRead:
    """The payload of a TTL state's read: its policy, "now" (expiry is checked against it),
    the access time a refresh writes, and the request's own argument (a map's user key)."""

    __slots__ = ("access", "arg", "now", "policy")

    def __init__(self, policy: TtlPolicy, now: int, access: int, arg: Any) -> None:
        self.policy = policy
        self.now = now
        self.access = access
        self.arg = arg

    def __repr__(self) -> str:
        return f"<TtlRead now={self.now} access={self.access} {self.policy!r}>"


def outcome(read: TtlRead, ts: int) -> int:
    """What `read` finds in an entry last accessed at `ts`: FRESH, EXPIRED_HIDDEN or
    EXPIRED_RETURNED."""
    policy = read.policy
    now = read.now
    if ts + policy.ttl_ms > now and (now <= _SHORT_MAX or now < MAX_TIMESTAMP):
        return FRESH
    return EXPIRED_RETURNED if policy.return_expired else EXPIRED_HIDDEN


class _Header:
    """A timestamp and its header bytes; never changed once made (see `_header`)."""

    __slots__ = ("header", "ts")

    def __init__(self, ts: int, header: bytes) -> None:
        self.ts = ts
        self.header = header


class _LastHeader:
    """The header made last. The requests of one millisecond share their timestamp, and
    packing a header costs several times what the comparison does."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = _Header(0, _pack_header(0x92, 0xD3, 0))


_last_header: Final = _LastHeader()  # compiled: Final alias


def _header(ts: int) -> bytes:
    """The 10-byte header of timestamp `ts`."""
    # One reference is read and replaced as a whole, so a thread never pairs a timestamp
    # with another one's bytes.
    last = _last_header.last
    if last.ts == ts:
        return last.header
    header: bytes = _pack_header(0x92, 0xD3, ts)
    _last_header.last = _Header(ts, header)
    return header


def encode(ts: int, value_bytes: bytes) -> bytes:
    """The timestamped bytes of a value's msgpack bytes."""
    return _header(ts) + value_bytes


def to_bytes(value: TtlValue) -> bytes:
    """The timestamped bytes of an in-memory entry."""
    return _header(value.ts) + stored_to_bytes(value.stored)


def timestamp_of(data: bytes) -> int:
    """The timestamp of timestamped bytes; ValueError when `data` is not timestamped."""
    if len(data) <= HEADER_SIZE or data[0] != 0x92 or data[1] != 0xD3:
        shown = data if len(data) <= 16 else data[:16] + b"..."
        raise ValueError(f"stored bytes {shown!r} are not a timestamped value (want "
                         f"{HEADER!r}, an 8-byte timestamp, then the value's msgpack bytes)")
    if data[2] < 0x40:
        # A timestamp in [0, 2**62), all there is in practice: read the bytes one by one
        # (unpacking would build a tuple and an int object). In the compiled build `ts` is a
        # C int64 (`i64`), whose shifts cannot overflow here and are plain instructions (an
        # int's are calls that check for overflow); with constant indexes each byte is a
        # plain load.
        ts: i64 = data[2]
        ts = ts << 8 | data[3]
        ts = ts << 8 | data[4]
        ts = ts << 8 | data[5]
        ts = ts << 8 | data[6]
        ts = ts << 8 | data[7]
        ts = ts << 8 | data[8]
        return ts << 8 | data[9]
    return int(_unpack_ts(data, 2)[0])


def check_timestamped(data: object) -> None:
    """Raise ValueError (TypeError for non-bytes) unless `data` is timestamped bytes whose
    value part is the msgpack bytes of one value (restores check what they store)."""
    # compiled: typed as object (the compiled build raises this TypeError, not its own).
    if type(data) is not bytes:
        raise TypeError(f"stored value bytes must be bytes, got {type(data).__name__}")
    timestamp_of(data)
    check_value_bytes(data[HEADER_SIZE:])
