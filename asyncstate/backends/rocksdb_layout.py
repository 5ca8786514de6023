"""How RocksDBBackend lays keyed state out in RocksDB, and how it reads the layout back.

Each state has its own column family, ``state:<name>``. The default column family holds
metadata: each state's kind, the time domain of the timestamps of each TTL state (``migrating``
while its entries are being rewritten), the list sequence counter, the max_parallelism the
state is cut by (2 bytes, big-endian), and a marker while a restore is under way. Keys are
raw bytes::

    key group (2 bytes, big-endian) | key bytes | namespace bytes [| suffix]

Key and namespace bytes are canonical msgpack. Msgpack is self-delimiting, so the
concatenation is unambiguous, and one (key, namespace) prefix never starts another. The
suffix is the user key's canonical bytes (map state), an 8-byte big-endian sequence number
(list state), or empty. Values are msgpack bytes (`asyncstate.serde.stored_to_bytes`), and
those of a TTL state timestamped (`asyncstate.state.ttl.layout`).

Everything here is internal to the RocksDB backend modules.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterator
from typing import Any

from asyncstate.errors import BackendError
from asyncstate.runtime.requests import StateKind

__all__: list[str] = []

_CF_PREFIX = "state:"
_TIMER_CF_PREFIX = "timers:"
_KIND_PREFIX = b"state-kind:"
_TTL_PREFIX = b"state-ttl:"  # + name -> time domain of a timestamped state
_TTL_MIGRATING = b"migrating"  # the value while a state's entries are rewritten
_SEQ_KEY = b"list-sequence"
_MAX_P_KEY = b"max-parallelism"
_RESTORING_KEY = b"restore-pending"  # present from a restore's discard until it completes
_SEQ = struct.Struct(">Q")


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key that starts with `prefix` (an exclusive
    upper bound)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        raise ValueError(f"prefix {prefix!r} has no upper bound")
    return stripped[:-1] + bytes((stripped[-1] + 1,))


def _fixed_sizes() -> tuple[int, ...]:
    sizes = [0] * 256
    for b in itertools.chain(range(0x00, 0x80), range(0xE0, 0x100), (0xC0, 0xC2, 0xC3)):
        sizes[b] = 1  # fixints, nil, false, true
    for b in range(0xA0, 0xC0):
        sizes[b] = 1 + (b & 0x1F)  # fixstr
    for b, size in ((0xCC, 2), (0xD0, 2), (0xCD, 3), (0xD1, 3), (0xCA, 5), (0xCE, 5),
                    (0xD2, 5), (0xCB, 9), (0xCF, 9), (0xD3, 9), (0xD4, 3), (0xD5, 4),
                    (0xD6, 6), (0xD7, 10), (0xD8, 18)):
        sizes[b] = size
    return tuple(sizes)


_FIXED_SIZES = _fixed_sizes()
# header byte -> (bytes of the length field, bytes before the payload) for str/bin/ext
_SIZED = {0xC4: (1, 2), 0xD9: (1, 2), 0xC5: (2, 3), 0xDA: (2, 3), 0xC6: (4, 5), 0xDB: (4, 5),
          0xC7: (1, 3), 0xC8: (2, 4), 0xC9: (4, 6)}
# header byte -> (bytes of the count field, objects per counted element) for arrays and maps
_COUNTED = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


def _skip(data: bytes, pos: int) -> int:
    """Return where the msgpack object that starts at `pos` ends."""
    b = data[pos]
    size = _FIXED_SIZES[b]
    if size:
        return pos + size
    if 0x80 <= b <= 0x9F:  # fixmap, fixarray
        count = (b & 0x0F) * (2 if b < 0x90 else 1)
        pos += 1
    elif b in _SIZED:
        width, header = _SIZED[b]
        return pos + header + int.from_bytes(data[pos + 1:pos + 1 + width], "big")
    elif b in _COUNTED:
        width, per = _COUNTED[b]
        count = int.from_bytes(data[pos + 1:pos + 1 + width], "big") * per
        pos += 1 + width
    else:
        raise BackendError(f"stored key {data!r} is damaged: byte 0x{b:02x} at offset {pos} "
                           f"starts no msgpack object")
    for _ in range(count):
        pos = _skip(data, pos)
    return pos


def _split_prefix(prefix: bytes) -> tuple[bytes, bytes]:
    """(key bytes, namespace bytes) of a ``key group | key | namespace`` prefix."""
    end = _skip(prefix, 2)
    return prefix[2:end], prefix[end:]


def _snapshot_entries(loaded: list[tuple[str, StateKind, list[tuple[bytes, bytes]]]]
                      ) -> Iterator[tuple[str, bytes, bytes, Any]]:
    """Group each state's stored items (of one key group, in key order) into the entries
    `RocksDBBackend.snapshot_key_group` yields."""
    fixed = _FIXED_SIZES
    for name, kind, items in loaded:
        if kind is StateKind.LIST:
            prefix = b""
            values: list[bytes] = []
            for key, value in items:
                if key[:-8] != prefix:
                    if values:
                        yield (name, *_split_prefix(prefix), values)
                    prefix, values = key[:-8], []
                values.append(value)
            if values:
                yield (name, *_split_prefix(prefix), values)
        elif kind is StateKind.MAP:
            prefix = b"\xff"  # starts no key (key groups are < 0x8000)
            entries: list[tuple[bytes, bytes]] = []
            skip = 0
            for key, value in items:
                # msgpack is prefix-free: a key that starts with the previous prefix
                # belongs to the same (key, namespace).
                if not key.startswith(prefix):
                    if entries:
                        yield (name, *_split_prefix(prefix), entries)
                    skip = _skip(key, _skip(key, 2))
                    prefix, entries = key[:skip], []
                entries.append((key[skip:], value))
            if entries:
                yield (name, *_split_prefix(prefix), entries)
        else:
            for key, value in items:
                size = fixed[key[2]]
                end = 2 + size if size else _skip(key, 2)
                yield (name, key[2:end], key[end:], value)
