"""What RocksDB's write path costs on the loop thread, and what some of it costs later.

Memtable inserts happen inside `Rdict.write`, which holds the GIL, so on the event loop's
thread (docs/backends.md). For the keyed counter's pattern (per batch of 500 keys, a
multi-get of the keys, then a WriteBatch putting them) this probe compares, at two write
buffer sizes:
- RocksDB's default skiplist memtable, as `RocksDBOptions` configures it;
- the same with the write-ahead log on (`disable_wal=False`, no fsync);
- a hash-linked-list memtable keyed by the whole key (a hash lookup per insert instead of a
  skiplist search);
- a hash-skiplist memtable keyed by the 2-byte key group (one smaller skiplist per key
  group; a key group's iteration stays inside one bucket).

For each it prints:
- ns per put and ns per multi-get key while loading 1 M keys in random order;
- the first iteration of one key group (a bounded total-order seek, as snapshots and the
  state iterators do) while the last memtable is still unflushed;
- the flush of that memtable.

    .venv/bin/python scripts/probe_rocksdict_writes.py

Keys are shaped like RocksDBBackend's: 2-byte key group, msgpack key, msgpack namespace.
It takes ~1 min; run it on a quiet machine.
"""

from __future__ import annotations

import random
import tempfile
import time

import msgpack
import rocksdict

from asyncstate import RocksDBOptions

KEYS = 1_000_000
PER_BATCH = 500
KEY_GROUPS = 128
VALUE = msgpack.packb(12345)
WRITE_BUFFERS = (4 * 2**20, 64 * 2**20)  # scripts/bench.py rocksdb; the default
VARIANTS = ("skiplist (default)", "skiplist, WAL on", "hash linked list",
            "hash skiplist")
HASH_PREFIX_BYTES = 128  # longer keys share a bucket with those of the same first bytes


def probe(path: str, write_buffer_bytes: int, variant: str, keys: list[bytes]) -> str:
    hashed = variant == "hash linked list"
    per_key_group = variant == "hash skiplist"
    options, write_options = RocksDBOptions(
        write_buffer_bytes=write_buffer_bytes, disable_wal=variant != "skiplist, WAL on"
    ).to_rocksdict()
    options.set_allow_concurrent_memtable_write(False)  # hash memtables need a single writer
    if hashed:
        # The bucket array is allocated in the memtable: 1/16 of the write buffer.
        # The stub declares no parameters; at runtime it takes the bucket count.
        options.set_memtable_factory(rocksdict.MemtableFactory.hash_link_list(
            write_buffer_bytes // 128))  # type: ignore[call-arg]
        options.set_prefix_extractor(
            rocksdict.SliceTransform.create_max_len_prefix(HASH_PREFIX_BYTES))
    elif per_key_group:
        # Bucket count, skiplist height, branching factor (the stub declares no parameters).
        options.set_memtable_factory(rocksdict.MemtableFactory.hash_skip_list(
            4 * KEY_GROUPS, 4, 4))  # type: ignore[call-arg]
        options.set_prefix_extractor(rocksdict.SliceTransform.create_fixed_prefix(2))
    db = rocksdict.Rdict(path, options)
    try:
        read_seconds = write_seconds = 0.0
        for start in range(0, len(keys), PER_BATCH):
            chunk = keys[start:start + PER_BATCH]
            began = time.perf_counter()
            db.get(chunk)  # type: ignore[arg-type]
            read_seconds += time.perf_counter() - began
            batch = rocksdict.WriteBatch(raw_mode=True)
            for key in chunk:
                batch.put(key, VALUE)
            began = time.perf_counter()
            db.write(batch, write_options)
            write_seconds += time.perf_counter() - began
        lower, upper = (5).to_bytes(2, "big"), (6).to_bytes(2, "big")
        read = rocksdict.ReadOptions()
        read.set_total_order_seek(True)
        read.set_iterate_lower_bound(lower)
        read.set_iterate_upper_bound(upper)
        began = time.perf_counter()
        found = sum(1 for _ in db.keys(from_key=lower, read_opt=read))
        iterate_seconds = time.perf_counter() - began
        expected = sum(1 for key in keys if key[:2] == lower)
        if found != expected:
            raise AssertionError(f"key group iteration found {found} keys, want {expected}")
        began = time.perf_counter()
        db.flush(True)
        flush_seconds = time.perf_counter() - began
    finally:
        db.close()
    return (f"{write_buffer_bytes >> 20:3d} MiB  {variant:18s}  "
            f"put {write_seconds / len(keys) * 1e9:5.0f} ns  "
            f"multi-get {read_seconds / len(keys) * 1e9:5.0f} ns/key  "
            f"first key-group iteration {iterate_seconds * 1e3:7.1f} ms  "
            f"flush {flush_seconds:5.2f} s")


def main() -> None:
    rng = random.Random(1)
    keys = [(k % KEY_GROUPS).to_bytes(2, "big") + msgpack.packb(k) + b"\xc0"
            for k in rng.sample(range(KEYS), KEYS)]
    with tempfile.TemporaryDirectory(prefix="asyncstate-probe-") as tmp:
        for write_buffer_bytes in WRITE_BUFFERS:
            for number, variant in enumerate(VARIANTS):
                path = f"{tmp}/{write_buffer_bytes}-{number}"
                print(probe(path, write_buffer_bytes, variant, keys), flush=True)


if __name__ == "__main__":
    main()
