"""Internal timers: the element of every timer queue, its order and its byte form.

An `InternalTimer` is one registered timer: a timestamp (int milliseconds), the key it fires
under (with the key's canonical bytes and key group) and the canonical bytes of its namespace
(`asyncstate.serde.NONE_BYTES` for the default namespace).

Order (priority): timestamp, then key bytes, then namespace bytes, compared as unsigned
bytes. Identity (``==`` and ``hash``): the same three fields, so registering an equal timer
twice keeps one. Every queue, in memory or on RocksDB, fires equal timestamps in this one
order, so a job fires its timers in the same order on every backend.

Byte form (`encode_timer`), Flink's RocksDB timer layout::

    key group (2 bytes, big-endian) | timestamp (8 bytes, big-endian, sign bit flipped)
        | key bytes | namespace bytes

Flipping the sign bit makes unsigned byte order numeric order (as
`asyncstate.serde.encode_ordered_i64`). Msgpack is self-delimiting, so the key bytes end where
the decoder says and no key's bytes are a proper prefix of another's: for two timers of one
key group, byte order is priority order. `decode_timer` is the inverse; the RocksDB queue and
checkpoints store timers in this form.
"""

from __future__ import annotations

import struct
from typing import Final, cast

from asyncstate.backends.rocksdb_layout import _skip
from asyncstate.config import MAX_MAX_PARALLELISM
from asyncstate.errors import BackendError, SerializationError
from asyncstate.keygroups import key_group_of_bytes
from asyncstate.serde import NONE_BYTES, canonical_key, decode_key
from asyncstate.timers.heap import NOT_CONTAINED, HeapPriorityQueueElement

__all__ = [
    "MAX_TIMESTAMP",
    "MIN_TIMESTAMP",
    "InternalTimer",
    "decode_timer",
    "encode_timer",
    "key_group_prefix",
    "make_timer",
]

MIN_TIMESTAMP: Final = -(2**63)
MAX_TIMESTAMP: Final = 2**63 - 1
_SIGN: Final = 2**63
_SMALL: Final = 2**62 - 1
_HEAD: Final = struct.Struct(">HQ")  # key group, timestamp with its sign bit flipped
_HEAD_SIZE: Final = 10
_KEY_GROUP: Final = struct.Struct(">H")
_NO_HASH: Final = -1
_HASH_MASK: Final = 2**62 - 1


class InternalTimer(HeapPriorityQueueElement):
    """One timer: `timestamp`, `key`, `key_bytes` (canonical), `namespace_bytes`
    (canonical), `key_group` (of `key_bytes`).

    Read-only by convention: the queues hash and order timers by their fields. The
    constructor checks `timestamp` and the kinds of the other fields; `key_bytes` must be
    `canonical_key(key)` and `key_group` its key group (`make_timer` computes both)."""

    __slots__ = ("timestamp", "key", "key_bytes", "namespace_bytes", "key_group", "_hash")

    def __init__(self, timestamp: object, key: object, key_bytes: object,
                 namespace_bytes: object, key_group: object) -> None:
        # Typed as object, so that the compiled build raises these errors, not its own.
        if type(timestamp) is not int:
            raise TypeError(f"timer timestamp must be an int (milliseconds), got "
                            f"{type(timestamp).__name__} {timestamp!r}")
        ts: int = timestamp  # from here on a native int in the compiled build
        # The bounds of int64 do not fit the compiled build's unboxed ints, so compare with
        # them only beyond +-2**62, which do.
        if (ts < -_SMALL or ts > _SMALL) and not MIN_TIMESTAMP <= ts <= MAX_TIMESTAMP:
            raise ValueError(f"timer timestamp must be in [-2**63, 2**63 - 1], got {ts}")
        if type(key_bytes) is not bytes or type(namespace_bytes) is not bytes:
            raise TypeError(
                f"timer key_bytes and namespace_bytes must be bytes, got "
                f"{type(key_bytes).__name__} and {type(namespace_bytes).__name__}")
        if type(key_group) is not int:
            raise TypeError(f"timer key_group must be an int, got {type(key_group).__name__}")
        group: int = key_group
        if not 0 <= group < MAX_MAX_PARALLELISM:
            raise ValueError(f"timer key_group must be an int in [0, {MAX_MAX_PARALLELISM}), "
                             f"got {group}")
        self.heap_index = NOT_CONTAINED
        self.timestamp = ts
        self.key = key
        self.key_bytes: bytes = key_bytes
        self.namespace_bytes: bytes = namespace_bytes
        self.key_group = group
        self._hash = _NO_HASH

    def priority_less_than(self, other: HeapPriorityQueueElement) -> bool:
        o = cast(InternalTimer, other)
        if self.timestamp != o.timestamp:
            return self.timestamp < o.timestamp
        if self.key_bytes != o.key_bytes:
            return self.key_bytes < o.key_bytes
        return self.namespace_bytes < o.namespace_bytes

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, InternalTimer):
            return NotImplemented
        return (self.timestamp == other.timestamp and self.key_bytes == other.key_bytes
                and self.namespace_bytes == other.namespace_bytes)

    def __hash__(self) -> int:
        # Computed once: a de-duplicating set hashes a timer when it adds it and again when
        # it polls or removes it. Masked to 62 bits, so that the compiled build stores it
        # unboxed.
        h = self._hash
        if h == _NO_HASH:
            h = hash((self.timestamp, self.key_bytes, self.namespace_bytes)) & _HASH_MASK
            self._hash = h
        return h

    def __repr__(self) -> str:
        namespace = "" if self.namespace_bytes == NONE_BYTES else \
            f", namespace_bytes={self.namespace_bytes!r}"
        return (f"InternalTimer(timestamp={self.timestamp}, key={self.key!r}{namespace}, "
                f"key_group={self.key_group})")


def make_timer(timestamp: object, key: object, max_parallelism: int,
               namespace: object = None) -> InternalTimer:
    """The timer of `key` at `timestamp` in `namespace` (None: the default namespace), with
    the key's canonical bytes and its key group among `max_parallelism`."""
    key_bytes = canonical_key(key)
    namespace_bytes = NONE_BYTES if namespace is None else canonical_key(namespace, "namespace")
    return InternalTimer(timestamp, key, key_bytes, namespace_bytes,
                         key_group_of_bytes(key_bytes, max_parallelism))


def key_group_prefix(key_group: int) -> bytes:
    """The 2 bytes every encoded timer of `key_group` starts with."""
    return _KEY_GROUP.pack(key_group)


def encode_timer(timer: InternalTimer) -> bytes:
    """The byte form of `timer` (see the module docstring); byte order = priority order
    among the timers of one key group."""
    return (_HEAD.pack(timer.key_group, timer.timestamp + _SIGN) + timer.key_bytes
            + timer.namespace_bytes)


def decode_timer(encoded: object) -> InternalTimer:
    """The timer `encode_timer` encoded as `encoded`. SerializationError if it is not one
    (not bytes, too short, a key or namespace that is not exactly one msgpack value). (Typed
    as object, so that the compiled build raises these errors, not its own.)"""
    if type(encoded) is not bytes:
        raise SerializationError(f"encoded timer must be bytes, got {type(encoded).__name__}",
                                 type_name=type(encoded).__name__)
    data: bytes = encoded
    if len(data) < _HEAD_SIZE + 2:
        raise SerializationError(f"encoded timer must be at least {_HEAD_SIZE + 2} bytes, got "
                                 f"{len(data)}", type_name="bytes")
    key_group, biased = _HEAD.unpack_from(data)
    try:
        key_end = _skip(data, _HEAD_SIZE)
        end = _skip(data, key_end) if key_end < len(data) else -1
    except (BackendError, IndexError, RecursionError):
        end = -1
    if end != len(data) or key_group >= MAX_MAX_PARALLELISM:
        head = data if len(data) <= 40 else data[:40] + b"..."
        raise SerializationError(f"encoded timer {head!r} is damaged: it must be a key group "
                                 f"below {MAX_MAX_PARALLELISM} (2 bytes), a timestamp (8 bytes), "
                                 "then exactly a msgpack key and a msgpack namespace",
                                 type_name="bytes")
    key_bytes = data[_HEAD_SIZE:key_end]
    return InternalTimer(int(biased) - _SIGN, decode_key(key_bytes, True), key_bytes,
                         data[key_end:], int(key_group))
