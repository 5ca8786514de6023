"""Bounded scans of one column family, for the RocksDB backend modules.

rocksdict keeps no copy of iteration bounds: the native read options point into the bytes
objects given to `ReadOptions.set_iterate_lower_bound` / `set_iterate_upper_bound`, which only
the `ReadOptions` object holds. Compiled code frees a local right after its last use, so a
compiled caller would free the options, and the bounds, while the iterator still reads
through them (the scan then stops at whatever the freed memory holds). These functions keep
the options, both bounds and the iterator in one interpreted frame until the scan is done:
this module is deliberately not in `asyncstate._compiled.COMPILED_MODULES`.

No iterator outlives a call (a live iterator keeps RocksDB's LOCK after close), also when the
scan fails: the iterator is dropped before the error leaves the frame.

An iterator that meets damaged data (a block checksum mismatch) just stops, as if the range
ended there; only its `status()` tells, and rocksdict's fast `items()` does not expose it.
So a scan that ends seeks a fresh iterator to where it stopped and asks that one: damage
raises (rocksdict's bare Exception, which the backend reports as BackendError) instead of
reading as fewer entries, or as none. One extra seek per scan, not per entry.
"""

from __future__ import annotations

import itertools
from typing import Any

import rocksdict

__all__: list[str] = []


def _read_options(lower: bytes, upper: bytes) -> rocksdict.ReadOptions:
    read = rocksdict.ReadOptions()
    read.set_iterate_lower_bound(lower)
    read.set_iterate_upper_bound(upper)
    return read


def _scan_items(cf: rocksdict.Rdict, lower: bytes, upper: bytes,
                limit: int | None = None) -> list[tuple[bytes, bytes]]:
    """Up to `limit` (key, value) pairs of `cf` in [lower, upper), in key order."""
    out: list[tuple[bytes, bytes]] = _scan_range(cf, lower, upper, limit, False)
    return out


def _scan_keys(cf: rocksdict.Rdict, lower: bytes, upper: bytes,
               limit: int | None = None) -> list[bytes]:
    """Up to `limit` keys of `cf` in [lower, upper), in key order; the values are not
    read (an iterator reads them without the lock an in-place write holds)."""
    out: list[bytes] = _scan_range(cf, lower, upper, limit, True)
    return out


def _scan_range(cf: rocksdict.Rdict, lower: bytes, upper: bytes, limit: int | None,
                keys_only: bool) -> Any:
    read = _read_options(lower, upper)
    try:
        found: Any = (cf.keys(from_key=lower, read_opt=read) if keys_only
                      else cf.items(from_key=lower, read_opt=read))
        try:
            out = list(found if limit is None else itertools.islice(found, limit))
        finally:
            del found
        if limit is None or len(out) < limit:
            # The scan ended: at the bound, or at damage (rocksdict's iteration cannot tell).
            last = (out[-1] if keys_only else out[-1][0]) if out else None
            _check_end(cf, read, last + b"\x00" if last is not None else lower)
        return out
    finally:
        del read


def _check_end(cf: rocksdict.Rdict, read: rocksdict.ReadOptions, after: bytes) -> None:
    """Raise unless `cf` holds nothing from `after` to the upper bound of `read`: a fresh
    iterator seeks where the scan stopped and reports the damage that stopped it."""
    it: Any = cf.iter(read)
    try:
        it.seek(after)
        if it.valid():
            # rocksdict's kind of error, which the backend translates to BackendError
            raise Exception("Corruption: a scan stopped before the end of its range")
        it.status()  # damage raises here
    finally:
        del it


def _scan_is_empty(cf: rocksdict.Rdict, lower: bytes, upper: bytes) -> bool:
    """True if `cf` holds no key in [lower, upper)."""
    read = _read_options(lower, upper)
    it: Any = cf.iter(read)
    try:
        it.seek(lower)
        if it.valid():
            return False
        it.status()  # not valid: an empty range, or damage, which raises here
        return True
    finally:
        del it, read
