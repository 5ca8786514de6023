"""RocksDBBackend: keyed state in RocksDB (rocksdict), with batches executed off the loop.

`asyncstate.backends.rocksdb_layout` describes how states are stored; `RocksDBOptions`
(`asyncstate.backends.rocksdb_options`) tunes the database.

A batch runs in three phases:

1. Plan (loop thread, inside `execute_batch`): encode keys and put writes into WriteBatches.
   A point read that follows a write of the same key in the batch is answered from an
   overlay of the batch's writes. Other point reads are collected per column family
   (`asyncstate.backends.rocksdb_batch`).
2. Read (pool): one multi-get per column family, split over the I/O slots when it is large.
   Multi-get releases the GIL. When an I/O thread is idle, the loop thread hands it the GIL
   right away so that the read starts at once. The last part to finish wakes the loop once
   per batch.
3. Apply (loop thread, one serial lane in trigger order): decode the values read, apply the
   WriteBatches, run iterations, then deliver the results. An iteration of a (key,
   namespace) that the batch wrote earlier runs after that write is applied.

A batch's multi-get starts at once, unless it reads a (state, key, namespace) that an
earlier, unapplied batch writes. In that case it waits until that batch is applied.

TTL states (`asyncstate.backends.rocksdb_ttl`) store timestamped values; their reads apply
expiry, refresh and cleanup on read in phase 3. Their cleanup runs as jobs of the backend's
own in the lane (no batch to deliver): incremental cleanup steps, and the removals of the
background cleaner (`asyncstate.backends.rocksdb_cleaner`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import threading
import traceback
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import rocksdict

from asyncstate.backends.base import ExecutorBinding
from asyncstate.backends.cache import StateCache, backend_cache
from asyncstate.backends.rocksdb_batch import (
    _VALUE_KINDS,
    _Cursor,
    _Job,
    _overlaps,
    _plan,
    _StateHandle,
)
from asyncstate.backends.rocksdb_cleaner import BackgroundCleaner
from asyncstate.backends.rocksdb_layout import (
    _CF_PREFIX,
    _KIND_PREFIX,
    _MAX_P_KEY,
    _RESTORING_KEY,
    _SEQ,
    _SEQ_KEY,
    _TIMER_CF_PREFIX,
    _TTL_MIGRATING,
    _TTL_PREFIX,
    _prefix_end,
    _snapshot_entries,
)
from asyncstate.backends.rocksdb_options import (
    DEFAULT_BLOCK_CACHE_BYTES as DEFAULT_BLOCK_CACHE_BYTES,
)
from asyncstate.backends.rocksdb_options import (
    DEFAULT_BLOOM_FILTER_BITS as DEFAULT_BLOOM_FILTER_BITS,
)
from asyncstate.backends.rocksdb_options import (
    DEFAULT_MEMTABLE_BLOOM_RATIO as DEFAULT_MEMTABLE_BLOOM_RATIO,
)
from asyncstate.backends.rocksdb_options import (
    DEFAULT_WRITE_BUFFER_BYTES as DEFAULT_WRITE_BUFFER_BYTES,
)
from asyncstate.backends.rocksdb_options import RocksDBOptions as RocksDBOptions
from asyncstate.backends.rocksdb_options import _check_not_forked, _note_opened
from asyncstate.backends.rocksdb_scan import _scan_is_empty, _scan_items
from asyncstate.backends.rocksdb_timers import TimerStore
from asyncstate.backends.rocksdb_ttl import RocksTtl, _Effects, apply_points, rewrite_layout
from asyncstate.backends.rocksdb_ttl import load as _load_ttl
from asyncstate.config import MAX_MAX_PARALLELISM, check_backend_state, check_int
from asyncstate.errors import BackendError, CheckpointError, ConfigError, InvalidStateError
from asyncstate.keygroups import KeyGroupRange
from asyncstate.log import get_logger
from asyncstate.runtime.requests import IteratorChunk, StateKind, StateRequest, StateRequestType
from asyncstate.serde import check_key_bytes, check_value_bytes, decode_key, decode_value
from asyncstate.state.ttl.layout import check_timestamped
from asyncstate.state.ttl.tracker import TtlTracker

__all__ = [
    "DEFAULT_BLOCK_CACHE_BYTES",
    "DEFAULT_BLOOM_FILTER_BITS",
    "DEFAULT_INLINE_READ_KEYS",
    "DEFAULT_IO_PARALLELISM",
    "DEFAULT_MEMTABLE_BLOOM_RATIO",
    "DEFAULT_WRITE_BUFFER_BYTES",
    "RocksDBBackend",
    "RocksDBOptions",
]

log = get_logger("asyncstate.backends.rocksdb")

DEFAULT_IO_PARALLELISM = 2
_MAX_IO_PARALLELISM = 64
# A batch's multi-get is split over the I/O slots only into parts of at least this many
# keys. Each part needs the GIL back to build its results, which takes up to the interpreter's
# switch interval while the loop thread is busy: the parts of an ordinary batch would only
# wait for it in turn (the loop thread idled more with smaller parts: docs/performance.md).
# Batches run on both I/O slots side by side either way.
_MIN_PART_KEYS = 2048
# Reads of up to this many keys run on the loop thread: below it, a pool hand-off and wake-up
# cost the loop more than the multi-get itself (the break-even is in docs/performance.md).
DEFAULT_INLINE_READ_KEYS = 16
_RESTORE_BATCH_ENTRIES = 100_000
_TIMER_PLACES = ("rocksdb", "heap")
# Longest the loop thread blocks to hand the GIL to an idle I/O thread (see _start_reads).
_HANDOVER_SECONDS = 0.001

_T = StateRequestType


# -- errors ---------------------------------------------------------------------------------

def _translate_error(exc: BaseException, path: str) -> BackendError:
    """Turn a rocksdict failure into a BackendError naming `path`. RocksDB errors arrive as a
    bare Exception, so the cause can only be read from the message text."""
    text = str(exc)
    # The lock is held in this process (RocksDB's own table of locked files) or in another
    # one (fcntl refused it). Other failures around the LOCK file, such as one that cannot
    # be opened, are not "in use".
    if "lock hold by current process" in text or "While lock file:" in text:
        return BackendError(
            f"RocksDB directory {path!r} is already in use (by this process or another); "
            f"close the RocksDBBackend that has it open, or use another path "
            f"(RocksDB said: {text})", path=path)
    if isinstance(exc, rocksdict.DbClosedError):
        return BackendError(f"RocksDB database {path!r} is closed", path=path)
    return BackendError(f"RocksDB failed on {path!r}: {text}", path=path)


def _release(exc: BaseException) -> None:
    """Clear the variables of the finished frames in `exc`'s traceback (the scan helpers
    take a column family as an argument).

    A caller may keep a failure, with its traceback and the exceptions it chains, for as
    long as it likes, and a database or column family object that one of those frames still
    holds keeps RocksDB's LOCK: the directory could not be opened again, even after close().
    For the same reason, the backend's methods that can fail keep no such object in a local
    variable (or drop it before anything can fail): a frame that is still running, as the
    one handling `exc`, is not cleared here. (The compiled build keeps no variables in
    frames at all; the Python sources do.)"""
    traceback.clear_frames(exc.__traceback__)


def _scan_first(cf: Any, lower: bytes, upper: bytes) -> list[tuple[bytes, bytes]]:
    """The first entry of `cf` in [lower, upper), as a list of at most one."""
    return _scan_items(cf, lower, upper, 1)


# -- the backend ----------------------------------------------------------------------------

def _directory(path: object) -> str:
    """`path` as a non-empty str, else ConfigError: "" would open the current directory."""
    try:
        name = os.fspath(path)  # type: ignore[call-overload]
    except TypeError:
        name = None
    if type(name) is not str or not name:
        raise ConfigError("path", path, "a non-empty str or os.PathLike[str] naming the "
                          "database directory")
    return name


def _check_not_foreign(path: str) -> None:
    """BackendError, before anything opens it, when directory `path` holds a rocksdict
    database in its default (pickling) mode, another program's: opening it in raw mode
    would rewrite its rocksdict-config.json, and neither program could open it again."""
    config = os.path.join(path, "rocksdict-config.json")
    if not os.path.isfile(config):
        return  # a new directory, or no directory (the open says what is wrong)
    try:
        with open(config, encoding="utf-8") as f:
            raw_mode = json.load(f).get("raw_mode")
    except (OSError, ValueError, AttributeError) as exc:
        raise BackendError(f"RocksDB directory {path!r} has a rocksdict-config.json that "
                           f"cannot be read ({exc}); refusing to open it", path=path) from None
    if raw_mode is not True:
        raise BackendError(
            f"RocksDB directory {path!r} holds a rocksdict database of another program (its "
            "default mode, not asyncstate's raw one); it was left untouched: give the "
            "backend a directory of its own", path=path)


def _stored_kind(key: bytes, value: bytes) -> tuple[str, StateKind]:
    """The state name and kind of a stored kind entry; ValueError when it is damaged."""
    return key[len(_KIND_PREFIX):].decode(), StateKind(value.decode())


def _stored_kinds(path: str) -> dict[str, StateKind]:
    """The kinds of the states stored in directory `path`, read through a read-only open
    (column family options are given when the database opens, and a value state's family
    updates in place). Empty when they cannot be read: every family then opens with the
    plain memtable, which is always correct; the real open reports the damage."""
    kinds: dict[str, StateKind] = {}
    try:
        db = rocksdict.Rdict(path, rocksdict.Options(raw_mode=True),
                             access_type=rocksdict.AccessType.read_only())
    except Exception:  # noqa: BLE001 - rocksdict raises bare Exception
        return kinds
    try:
        for key, value in _scan_items(db, _KIND_PREFIX, _prefix_end(_KIND_PREFIX)):
            with contextlib.suppress(ValueError):
                name, kind = _stored_kind(key, value)
                kinds[name] = kind
    except Exception:  # noqa: BLE001 - as above
        kinds.clear()
    finally:
        db.close()
    return kinds


class RocksDBBackend:
    """Keyed state in a RocksDB directory. `asyncstate.backends.rocksdb_layout` describes the
    layout, and this module's docstring how a batch runs.

    `path` is created if missing, and reopening it keeps its states. Only one backend may
    have a directory open at a time: opening a directory in use raises BackendError.
    `io_parallelism` is the number of pool threads that run multi-gets. A batch with at
    most `inline_read_keys` point reads runs them on the loop thread instead, because a
    thread hand-off costs more than that. 0 sends every read to the pool. `options` is a
    `RocksDBOptions`. `timers`: where the operator's timers live, "rocksdb" (in the
    directory, column families of their own, behind a small cache) or "heap" (in memory,
    snapshotted with the state). `cache_entries` > 0 puts a `StateCache` of that many
    entries in front (`asyncstate.backends.cache`), write-through unless `cache_write_back`.
    """

    completes_at_issue = False

    def __init__(self, path: str | os.PathLike[str], *,
                 io_parallelism: object = DEFAULT_IO_PARALLELISM,
                 inline_read_keys: object = DEFAULT_INLINE_READ_KEYS,
                 options: RocksDBOptions | None = None, timers: object = "rocksdb",
                 cache_entries: object = 0, cache_write_back: object = False) -> None:
        # compiled: typed as object (all are ints), so both builds raise check_int's error.
        io_parallelism = check_int("io_parallelism", io_parallelism, 1, _MAX_IO_PARALLELISM)
        inline_read_keys = check_int("inline_read_keys", inline_read_keys, 0)
        cache_entries = check_int("cache_entries", cache_entries, 0)
        self._cache: StateCache | None = backend_cache(cache_entries, cache_write_back)
        if options is None:
            options = RocksDBOptions()
        elif not isinstance(options, RocksDBOptions):
            raise ConfigError("options", options, "a RocksDBOptions")
        if timers not in _TIMER_PLACES:
            raise ConfigError("timers", timers, '"rocksdb" or "heap"')
        self._timers_in_db = timers == "rocksdb"
        self._timer_stores: list[TimerStore] = []
        # The real path: RocksDB refuses a second open of a directory in this process by
        # its path, so a symlink or another spelling must not get around it.
        self._path = os.path.realpath(_directory(path))
        self._options = options
        self._io_parallelism = io_parallelism
        self._inline_read_keys = inline_read_keys
        _check_not_forked(self._path)
        _check_not_foreign(self._path)
        db_options, self._write_options = options.to_rocksdict()
        _note_opened()  # from here on RocksDB's background threads may run
        try:
            existing = (rocksdict.Rdict.list_cf(self._path)
                        if os.path.exists(os.path.join(self._path, "CURRENT")) else [])
            kinds = _stored_kinds(self._path) if len(existing) > 1 else {}
            families = {name: options.family_options(
                            name.startswith(_CF_PREFIX)
                            and kinds.get(name[len(_CF_PREFIX):]) in _VALUE_KINDS)
                        for name in existing
                        if name.startswith(_CF_PREFIX) or name.startswith(_TIMER_CF_PREFIX)}
            self._db: rocksdict.Rdict | None = rocksdict.Rdict(
                self._path, db_options, column_families=families or None)
        except Exception as exc:  # noqa: BLE001 - rocksdict raises bare Exception
            raise _translate_error(exc, self._path) from None
        self._families = set(families)
        self._handles: dict[str, _StateHandle] = {}
        self._ttl = RocksTtl()  # which states are timestamped, and their cleanup
        self._cleaner: BackgroundCleaner | None = None  # built at open()
        self._maintenance_error: BaseException | None = None
        try:
            self._load_metadata()
        except Exception as exc:  # noqa: BLE001 - never leave the directory locked
            self._handles.clear()
            self._db.close()
            raise self._failure(exc) from None
        self._pool = ThreadPoolExecutor(max_workers=io_parallelism,
                                        thread_name_prefix="asyncstate-rocksdb")
        self._binding: ExecutorBinding | None = None
        self._chunk = 1000
        self._kg_prefix: list[bytes] = []
        self._lane: deque[_Job] = deque()
        self._parts_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._parts_in_pool = 0  # multi-get parts submitted and not finished
        self._reading = 0  # jobs whose multi-get is waiting or running
        self._pumping = False
        self._closed = False
        log.debug("rocksdb.opened", path=self._path, io_parallelism=io_parallelism,
                  inline_read_keys=inline_read_keys,
                  options=dataclasses.asdict(options), states=sorted(self._handles),
                  list_sequence=self._list_seq)

    def __repr__(self) -> str:
        status = "closed" if self._closed else f"lane={len(self._lane)} reading={self._reading}"
        return f"<RocksDBBackend {self._path!r} states={sorted(self._handles)} {status}>"

    def __enter__(self) -> RocksDBBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def path(self) -> str:
        """Absolute path of the database directory."""
        return self._path

    def _load_metadata(self) -> None:
        db = self._db
        assert db is not None
        for key, value in _scan_items(db, _KIND_PREFIX, _prefix_end(_KIND_PREFIX)):
            try:
                name, kind = _stored_kind(key, value)
            except ValueError:
                raise BackendError(
                    f"RocksDB directory {self._path!r} has a damaged state entry "
                    f"{key!r} = {value!r} (want a state name and one of "
                    f"{', '.join(k.value for k in StateKind)})", path=self._path) from None
            cf_name = _CF_PREFIX + name
            if cf_name in self._families:
                self._handles[name] = _StateHandle(
                    name, kind, db.get_column_family(cf_name),
                    db.get_column_family_handle(cf_name))
        # Unusable (below) when a change of a state's TTL layout did not complete.
        migrating = None
        for key, value in _scan_items(db, _TTL_PREFIX, _prefix_end(_TTL_PREFIX)):
            name = key[len(_TTL_PREFIX):].decode()
            if value == _TTL_MIGRATING:
                migrating = name
            else:
                self._ttl.layouts[name] = value.decode()
        raw = db.get(_SEQ_KEY)
        if raw is not None and len(raw) != _SEQ.size:
            raise BackendError(
                f"RocksDB directory {self._path!r} has a damaged list sequence entry "
                f"{_SEQ_KEY!r} = {raw!r} (want {_SEQ.size} bytes)", path=self._path)
        self._list_seq: int = _SEQ.unpack(raw)[0] if raw is not None else 0
        raw = db.get(_MAX_P_KEY)
        stored = int.from_bytes(raw, "big") if raw is not None and len(raw) == 2 else 0
        if raw is not None and not 1 <= stored <= MAX_MAX_PARALLELISM:
            raise BackendError(
                f"RocksDB directory {self._path!r} has a damaged max_parallelism entry "
                f"{_MAX_P_KEY!r} = {raw!r} (want 2 bytes, 1..{MAX_MAX_PARALLELISM})",
                path=self._path)
        # The key groups the stored state is cut by (0: none recorded, as in a directory
        # written before this entry existed).
        self._stored_max_p: int = stored
        # Why the stored state must not be used, if it must not (see _check_usable).
        self._unusable: str | None = None
        if migrating is not None:
            self._unusable = (
                f"RocksDB directory {self._path!r} holds state {migrating!r} whose entries "
                "were being rewritten (TTL timestamps added or dropped) when that stopped, so "
                "some are timestamped and others not. Restore a checkpoint into it, or use "
                "another directory")
        if db.get(_RESTORING_KEY) is not None:
            self._unusable = (
                f"RocksDB directory {self._path!r} holds a restore that did not complete (it "
                "failed or was interrupted), so its state is neither the checkpoint's nor "
                "what it held before. Restore a checkpoint into it again, or use another "
                "directory")

    def _live_db(self) -> rocksdict.Rdict:
        if self._db is None:
            raise InvalidStateError(f"RocksDBBackend {self._path!r} is closed")
        return self._db

    def _failure(self, exc: BaseException) -> BaseException:
        """A storage failure becomes a BackendError naming the path. Other errors pass
        through unchanged."""
        if type(exc) is Exception or isinstance(exc, rocksdict.DbClosedError):
            return _translate_error(exc, self._path)
        return exc

    # -- StateExecutor ---------------------------------------------------------------------

    def open(self, binding: ExecutorBinding) -> None:
        """Bind to the operator's loop and delivery callback (once)."""
        self._live_db()
        if self._binding is not None:
            raise InvalidStateError(
                "this RocksDBBackend is already bound to an operator; "
                "create one backend per operator")
        loop = binding.loop
        if loop is None:
            raise InvalidStateError("RocksDBBackend needs the operator's event loop (loop=None)")
        if self._cache is not None:  # batches are delivered through the cache
            binding = self._cache.open(binding, self._execute_batch)
        self._binding = binding
        self._chunk = binding.iterator_chunk_size
        self._kg_prefix = [kg.to_bytes(2, "big") for kg in range(binding.max_parallelism)]
        self._cleaner = BackgroundCleaner(self._handles, self._ttl.trackers,
                                          self._enqueue_maintenance, self._write_maintenance,
                                          loop)
        max_p = binding.max_parallelism
        stored = self._stored_max_p
        if self._unusable is None:  # else a restore must come first, which records max_p
            if stored and stored != max_p and self._families:
                # Refused at the first use of the state, not here: a restore discards it.
                self._unusable = (
                    f"RocksDB directory {self._path!r} holds state cut into {stored} key "
                    f"groups (max_parallelism {stored}), and this operator uses "
                    f"max_parallelism {max_p}: key groups are fixed for the life of the "
                    f"state. Open it with max_parallelism {stored}, restore a checkpoint into "
                    f"it (which replaces its state), or use another directory")
            else:
                self._store_max_parallelism(max_p)

    def _store_max_parallelism(self, max_p: int) -> None:
        if max_p != self._stored_max_p:
            try:
                self._live_db().put(_MAX_P_KEY, max_p.to_bytes(2, "big"),
                                    self._write_options)
            except Exception as exc:  # noqa: BLE001 - rocksdict raises bare Exception
                raise _translate_error(exc, self._path) from None
            self._stored_max_p = max_p

    def _check_usable(self) -> None:
        """Refuse to use state cut by another max_parallelism (see open), or left by a
        restore that did not complete. A restore (discard_state) makes the directory usable."""
        if self._unusable is not None:
            raise BackendError(self._unusable, path=self._path)

    def register_state(self, name: object, kind: object) -> _StateHandle:
        """Create or open the column family of state `name`. The kind is stored, and
        registering the name again with another kind raises ValueError, even after the
        directory is reopened."""
        self._live_db()
        self._check_usable()
        name, kind = check_backend_state(name, kind)
        handle = self._handles.get(name)
        if handle is not None:
            if handle.kind is not kind:
                raise ValueError(
                    f"state {name!r} is already registered as {handle.kind.value} state (in "
                    f"{self._path!r}), cannot register it again as {kind.value} state")
            return handle
        cf_name = _CF_PREFIX + name
        try:  # no local for the database or a column family (see _release)
            if cf_name not in self._families:
                # Value kinds never take a range deletion: their writes may go in place.
                self._live_db().create_column_family(
                    cf_name, self._options.family_options(kind in _VALUE_KINDS))
                self._families.add(cf_name)
            self._live_db().put(_KIND_PREFIX + name.encode(), kind.value.encode(),
                                self._write_options)
            handle = _StateHandle(name, kind, self._live_db().get_column_family(cf_name),
                                  self._live_db().get_column_family_handle(cf_name))
        except Exception as exc:  # noqa: BLE001 - rocksdict raises bare Exception
            raise _translate_error(exc, self._path) from None
        self._handles[name] = handle
        return handle

    @property
    def state_cache(self) -> StateCache | None:
        """The cache in front of the database, or None (`cache_entries=0`)."""
        return self._cache

    def execute_batch(self, batch: list[StateRequest]) -> None:
        """Plan the batch now (phase 1), then read and apply it in trigger order (through
        the cache, when there is one)."""
        if self._cache is not None and self._binding is not None:
            self._cache.execute_batch(batch)
        else:
            self._execute_batch(batch)

    def _execute_batch(self, batch: list[StateRequest]) -> None:
        binding = self._binding
        if binding is None:
            raise InvalidStateError("open() the RocksDBBackend before executing batches")
        if self._closed:
            binding.deliver(batch, None,
                            InvalidStateError(f"RocksDBBackend {self._path!r} is closed"))
            return
        try:
            job = self._plan(batch)
        except Exception as exc:  # noqa: BLE001 - reported through deliver
            binding.deliver(batch, None, self._failure(exc))
            return
        self._lane.append(job)
        if job.point_reads:
            self._reading += 1
            if not self._blocked(job, len(self._lane) - 1):
                self._start_reads(job)
        else:
            job.reads_done = True
        self._pump()

    def fully_loaded(self) -> bool:
        """True while every I/O slot has a batch's multi-get waiting or running."""
        return self._reading >= self._io_parallelism

    def io_slots(self) -> int:
        """Batches whose multi-gets run at once: `io_parallelism` (the operator paces
        admission by it)."""
        return self._io_parallelism

    def close(self) -> None:
        """Wait for running multi-gets, abandon pending batches and release the directory.
        Calling it again does nothing once it has completed. If it was interrupted (say, by
        a timeout), calling it again finishes closing the database. Callers in several
        threads close it once, one after another."""
        with self._close_lock:
            self._close()

    def _close(self) -> None:
        if self._db is None:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._cleaner is not None:
            self._cleaner.close()
        with contextlib.suppress(Exception):  # best effort: a refresh only lengthens a life
            self._flush_refreshes()
        if self._lane and self._binding is not None:
            # Batches under way will never finish: fail them, on the loop thread (close()
            # may run on another one), so that nothing waits for them.
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits
                self._binding.loop.call_soon_threadsafe(  # type: ignore[union-attr]
                    self._abandon_lane)
        self._drop_handles()
        db, self._db = self._db, None  # closed even if its close fails: never again
        try:
            db.close()
        except Exception as exc:  # noqa: BLE001 - rocksdict raises bare Exception
            raise _translate_error(exc, self._path) from None
        log.debug("rocksdb.closed", path=self._path)

    def _scan(self, scan: Any, cf: Any, lower: bytes, upper: bytes) -> Any:
        """`scan(cf, lower, upper)` (a `rocksdb_scan` function), its storage failures (damage)
        as BackendError naming the path."""
        try:
            return scan(cf, lower, upper)
        except Exception as exc:  # noqa: BLE001 - rocksdict raises bare Exception
            cf = None
            _release(exc)
            raise self._failure(exc) from None

    def _abandon_lane(self) -> None:
        """Loop thread, after close(): deliver the failure of every batch still under way
        (each once: a batch leaves the lane as it is delivered)."""
        deliver = self._binding.deliver  # type: ignore[union-attr]
        lane = self._lane
        while lane:
            job = lane.popleft()
            if job.maintenance is not None:
                continue
            deliver(job.batch, None, InvalidStateError(
                f"RocksDBBackend {self._path!r} was closed while this batch was under way"))

    def _drop_handles(self) -> None:
        """Column family objects keep RocksDB's LOCK even after Rdict.close(): drop every
        reference this backend handed out (states and iteration cursors hold handles)."""
        for handle in self._handles.values():
            handle.cf = None
            handle.cf_handle = None
        self._handles.clear()
        for store in self._timer_stores:
            store.release()
        self._timer_stores.clear()

    # -- phase 1: plan (loop thread) -------------------------------------------------------

    def _plan(self, batch: list[StateRequest]) -> _Job:
        job = _Job(batch, self._list_seq)
        try:
            # Read prefixes only matter while an earlier batch with writes is still unapplied.
            _plan(job, self._kg_prefix, any(earlier.writes for earlier in self._lane))
        finally:
            # Sequence numbers are never reused: those a failed plan took stay taken.
            self._list_seq = job.list_seq
        return job

    # -- phase 2: read (pool) --------------------------------------------------------------

    def _blocked(self, job: _Job, position: int) -> bool:
        """True if an earlier unapplied batch writes a prefix that `job` reads."""
        for earlier in itertools.islice(self._lane, position):
            if earlier.writes and _overlaps(job, earlier):
                return True
        return False

    def _start_reads(self, job: _Job) -> None:
        job.started = True
        parts = job.parts
        if job.point_reads <= self._inline_read_keys:
            for handle, touched in job.touched.items():
                if touched.keys:
                    parts.append((handle, touched.keys, touched.slots))
            try:
                job.raw = [handle.cf.get(keys)  # type: ignore[union-attr,arg-type]
                           for handle, keys, _slots in parts]
            except Exception as exc:  # noqa: BLE001 - phase 3 delivers it
                job.error = exc
            job.reads_done = True
            self._reading -= 1
            return
        for handle, touched in job.touched.items():
            keys = touched.keys
            slots = touched.slots
            n = len(keys)
            if not n:
                continue
            count = min(self._io_parallelism, max(1, n // _MIN_PART_KEYS))
            if count == 1:
                parts.append((handle, keys, slots))
                continue
            step = -(-n // count)
            for start in range(0, n, step):
                parts.append((handle, keys[start:start + step], slots[start:start + step]))
        job.raw = [None] * len(parts)
        job.remaining = len(parts)
        with self._parts_lock:
            idle = self._parts_in_pool < self._io_parallelism
            self._parts_in_pool += len(parts)
        # A pool thread needs the GIL to start the multi-get, and a busy loop thread gives it
        # up only at the interpreter's switch interval (5 ms) or when it idles: that was the
        # median wait before a read began. When an I/O thread is idle, block (GIL released)
        # until it has started, which takes tens of microseconds, or at most 1 ms.
        gate = None
        if idle:
            gate = job.gate = threading.Lock()
            gate.acquire()
        try:
            for index, (handle, keys, _slots) in enumerate(parts):
                self._pool.submit(self._read_part, job, index, handle, keys)
        except RuntimeError:
            # close() on another thread shut the pool down after execute_batch checked: the
            # job stays in the lane, and the close fails it on the loop thread.
            return
        if gate is not None:
            gate.acquire(timeout=_HANDOVER_SECONDS)

    def _read_part(self, job: _Job, index: int, handle: _StateHandle, keys: list[bytes]) -> None:
        """Pool thread: one multi-get (GIL released inside rocksdict)."""
        try:
            # No local for the column family: a stored error's traceback keeps this frame,
            # and a live column family object keeps RocksDB's LOCK after close().
            if handle.cf is None:
                raise InvalidStateError(f"RocksDBBackend {self._path!r} is closed")
            if index == 0 and job.gate is not None:
                job.gate.release()  # the loop thread may go on (see _start_reads)
            job.raw[index] = handle.cf.get(keys)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - phase 3 delivers it
            job.error = exc
        with self._parts_lock:
            self._parts_in_pool -= 1
        with job.lock:
            job.remaining -= 1
            last = job.remaining == 0
        if last:
            loop = self._binding.loop  # type: ignore[union-attr]
            # A closed loop raises RuntimeError: nobody waits for this batch any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._on_reads_done, job)  # type: ignore[union-attr]

    def _on_reads_done(self, job: _Job) -> None:
        if self._closed:
            return
        job.reads_done = True
        self._reading -= 1
        self._pump()

    # -- phase 3: apply (loop thread, serial lane) -----------------------------------------

    def _pump(self) -> None:
        """Apply and deliver finished batches from the head of the lane, in trigger order.
        One pump at a time: a batch triggered from inside a delivery just joins the lane."""
        if self._pumping:
            return
        self._pumping = True
        try:
            lane = self._lane
            deliver = self._binding.deliver  # type: ignore[union-attr]
            while lane and lane[0].reads_done and not self._closed:
                job = lane.popleft()
                if job.maintenance is not None:
                    self._run_maintenance(job.maintenance)
                else:
                    failed = self._maintenance_error
                    try:
                        if failed is not None:
                            # A cleanup job failed: the run fails with the next batch.
                            self._maintenance_error = None
                            raise failed
                        results = self._apply(job)
                    except Exception as exc:  # noqa: BLE001 - reported through deliver
                        deliver(job.batch, None, self._failure(exc))
                    else:
                        deliver(job.batch, results, None)
                    cleaner = self._cleaner
                    if cleaner is not None and not cleaner.busy:
                        cleaner.kick()
                for position, waiting in enumerate(lane):
                    if not waiting.started and not waiting.reads_done \
                            and not self._blocked(waiting, position):
                        self._start_reads(waiting)
        finally:
            self._pumping = False

    def _run_maintenance(self, run: Any) -> None:
        """Run a cleanup job of the backend's own at its place in the lane."""
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - fails the next batch
            log.warning("rocksdb.ttl_cleanup_failed", path=self._path, error=repr(exc))
            if self._maintenance_error is None:
                self._maintenance_error = exc

    def _enqueue_maintenance(self, run: Any) -> None:
        """Queue run() as a job of the backend's own; with nothing ahead of it, it runs now
        (nothing is delivered then)."""
        job = _Job([], self._list_seq)
        job.maintenance = run
        job.started = job.reads_done = True
        idle = not self._lane
        self._lane.append(job)
        if idle and not self._pumping:
            self._pump()

    def _write_maintenance(self, wb: rocksdict.WriteBatch,
                           removed: list[tuple[_StateHandle, bytes]] | None = None) -> None:
        """Write a job of the backend's own; `removed`: the keys a cleanup job removes, shown
        removed to the batches behind it in the lane (their multi-gets did not wait)."""
        self._live_db().write(wb, self._write_options)
        if removed:
            self._ttl.show_removals(
                removed, sum(1 for job in self._lane if job.maintenance is None))

    def _flush_refreshes(self) -> None:
        """Write the deferred refreshes of TTL reads (before anything reads the column
        families directly)."""
        if self._ttl.deferred:
            wb = self._ttl.flush()
            if wb is not None:
                try:  # no local for the database (see _release)
                    self._live_db().write(wb, self._write_options)
                except Exception as exc:  # noqa: BLE001 - rocksdict raises bare Exception
                    raise _translate_error(exc, self._path) from None

    def _apply(self, job: _Job) -> list[Any]:
        if job.error is not None:
            raise job.error
        results = job.results
        batch_size = len(results)
        points = job.ttl_points
        for (_handle, _keys, slots), values in zip(job.parts, job.raw, strict=True):
            n = len(slots)
            if values is None or len(values) != n:
                raise BackendError(f"RocksDB multi-get on {self._path!r} returned "
                                   f"{'nothing' if values is None else len(values)} values "
                                   f"for {n} keys", path=self._path)
            for j in range(n):  # compiled: index loop (cheaper than zip(strict=True))
                slot = slots[j]
                raw = values[j]
                if slot >= batch_size:  # a TTL state's point read, answered below
                    points[slot - batch_size].raw = raw  # type: ignore[index]
                elif slot >= 0:
                    results[slot] = None if raw is None else decode_value(raw)
                else:
                    results[~slot] = raw is not None
        # No local for the database: a failure's traceback keeps this frame, and a live
        # database object keeps RocksDB's LOCK after close().
        write_options = self._write_options
        if points is not None or self._ttl.deferred:
            # What they change goes before the batch's writes, which come after them.
            effects = self._ttl.effects(len(self._lane))
            if points is not None:
                apply_points(points, results, effects)
            self._ttl.settle(job, effects)
            if effects.wb is not None:
                self._live_db().write(effects.wb, write_options)
        for step in job.steps:
            if type(step) is tuple:
                index, cursor = step
                results[index] = self._load(cursor)
            else:
                self._live_db().write(step, write_options)  # type: ignore[arg-type]
        return results

    def _load(self, cursor: _Cursor) -> Any:
        """One chunk of an iteration, or the answer of MAP_IS_EMPTY. No iterator outlives
        this call: a live iterator would keep RocksDB's LOCK after close()."""
        if cursor.ttl is not None:
            effects = _Effects()
            answer = _load_ttl(cursor, self._chunk, effects)
            if effects.wb is not None:
                self._live_db().write(effects.wb, self._write_options)
            return answer
        cf = cursor.handle.cf
        if cf is None:
            raise InvalidStateError(f"RocksDBBackend {self._path!r} is closed")
        lower = cursor.prefix if cursor.after is None else cursor.after + b"\x00"
        t = cursor.request_type
        if t is _T.MAP_IS_EMPTY:
            return _scan_is_empty(cf, lower, cursor.upper)
        chunk = self._chunk
        entries = _scan_items(cf, lower, cursor.upper, chunk + 1)
        # Decoding may fail (bytes written by another program), and the failure's traceback
        # keeps this frame: no column family may be left in it (see _apply).
        del cf
        continuation = None
        if len(entries) > chunk:
            del entries[chunk:]
            continuation = _Cursor(t, cursor.handle, cursor.prefix, entries[-1][0],
                                   cursor.upper)
        skip = len(cursor.prefix)
        if t is _T.LIST_GET or t is _T.MAP_ITER_VALUE:
            decoded: list[Any] = [decode_value(v) for _k, v in entries]
        elif t is _T.MAP_ITER:
            decoded = [(decode_key(k[skip:]), decode_value(v)) for k, v in entries]
        else:
            decoded = [decode_key(k[skip:]) for k, _v in entries]
        return IteratorChunk(decoded, continuation)

    # -- snapshots and restore (call while no batch is in flight) --------------------------

    def registered_states(self) -> dict[str, StateKind]:
        """Name and kind of every state known to the database (registered, or stored by an
        earlier run in this directory)."""
        self._live_db()
        self._check_usable()
        return {name: handle.kind for name, handle in sorted(self._handles.items())}

    def snapshot_key_group(self, key_group: int) -> Iterator[tuple[str, bytes, bytes, Any]]:
        """Every (state name, key bytes, namespace bytes, data) of `key_group`. `data` is the
        value's msgpack bytes (value, reducing, aggregating), the list of element bytes in
        order (list), or the list of (user key bytes, value bytes) (map).

        The key group is read completely before this returns. All writes happen on the loop
        thread, so the result is one consistent view. No iterator or snapshot is kept, so
        `close()` always releases the directory."""
        self._live_db()
        self._check_usable()
        self._flush_refreshes()
        lower = key_group.to_bytes(2, "big")
        upper = (key_group + 1).to_bytes(2, "big")
        loaded = []
        for name, handle in sorted(self._handles.items()):
            items = self._scan(_scan_items, handle.cf, lower, upper)
            if items and name in self._ttl.trackers:
                items = self._ttl.filter_snapshot(name, items)  # full snapshot cleanup
            if items:
                loaded.append((name, handle.kind, items))
        return _snapshot_entries(loaded)

    def restore_key_group(self, key_group: int,
                          entries: Iterable[Sequence[Any]]) -> None:
        """Store entries of `key_group` in the shape `snapshot_key_group` yields, replacing
        what the backend holds for each (state, key, namespace) they name, as HeapBackend
        does. The states must be registered first: an unknown state raises KeyError. List
        elements get fresh sequence numbers."""
        self._live_db()
        self._flush_refreshes()  # else a deferred refresh could bring a replaced entry back
        lower = key_group.to_bytes(2, "big")
        upper = (key_group + 1).to_bytes(2, "big")
        handles = self._handles
        if self._cache is not None:
            self._cache.invalidate()
        # 1. Only a state that already holds data in this key group needs a list or map
        #    cleared before it is written: a fresh database takes no range tombstones.
        occupied = set()
        for name, existing in handles.items():
            if not self._scan(_scan_is_empty, existing.cf, lower, upper):
                occupied.add(name)
        # 2. Write through WriteBatches of bounded size.
        wb = rocksdict.WriteBatch(raw_mode=True)
        pack = _SEQ.pack
        check = check_value_bytes  # stored undecoded: damage must show here, not at a read
        seq = self._list_seq
        pending = 0
        written: set[bytes] = set()  # list and map prefixes this call has written
        try:  # no local for the database or a column family (see _release)
            for name, key_bytes, namespace, data in entries:
                handle = handles.get(name)
                if handle is None:
                    raise KeyError(f"state {name!r} of key group {key_group} is not registered; "
                                   f"call register_state({name!r}, kind) before restoring it")
                check = check_timestamped if name in self._ttl.layouts else check_value_bytes
                prefix = lower + key_bytes + namespace
                kind = handle.kind
                if kind is StateKind.LIST or kind is StateKind.MAP:
                    if type(data) is not list and type(data) is not tuple:
                        raise CheckpointError(
                            f"state {name!r} ({kind.value}) of key group {key_group} needs a "
                            f"list of entries, got {type(data).__name__}")
                    # An entry replaces the one before it, also one given earlier in this call.
                    if name in occupied or prefix in written:
                        wb.delete_range(prefix, _prefix_end(prefix), handle.cf_handle)
                    written.add(prefix)
                    if kind is StateKind.LIST:
                        for value in data:
                            check(value)
                            wb.put(prefix + pack(seq), value, handle.cf_handle)
                            seq += 1
                    else:
                        for user_key, value in data:
                            check_key_bytes(user_key)
                            check(value)
                            wb.put(prefix + user_key, value, handle.cf_handle)
                    pending += len(data)
                else:
                    if type(data) is not bytes:
                        raise CheckpointError(
                            f"state {name!r} ({kind.value}) of key group {key_group} needs "
                            f"msgpack bytes, got {type(data).__name__}")
                    check(data)
                    wb.put(prefix, data, handle.cf_handle)
                    pending += 1
                if pending >= _RESTORE_BATCH_ENTRIES:
                    self._list_seq = seq
                    self._live_db().write(wb, self._write_options)
                    wb = rocksdict.WriteBatch(raw_mode=True)
                    pending = 0
            self._list_seq = seq
            wb.put(_SEQ_KEY, pack(seq))
            self._live_db().write(wb, self._write_options)
        except Exception as exc:  # noqa: BLE001 - rocksdict raises bare Exception
            raise self._failure(exc) from None

    def discard_state(self) -> list[str]:
        """Drop every state the directory holds, as a restore does before loading a
        checkpoint: each state's column family, its stored kind and the list sequence go, so
        the database is as fresh. Returns the names of the dropped states (empty when there
        was nothing to drop). Only while no batch is under way: a backend with batches under way
        raises InvalidStateError."""
        self._live_db()
        if self._lane:
            raise InvalidStateError(
                f"RocksDBBackend {self._path!r} has batches under way; its state can only be "
                "discarded while no batch is under way")
        dropped = sorted(self._handles)
        if self._cache is not None:
            self._cache.invalidate()
        # Whatever there is to drop, the directory is fresh afterwards: usable, and cut by
        # this operator's key groups.
        self._unusable = None
        if self._binding is not None:
            self._store_max_parallelism(self._binding.max_parallelism)
        if not self._families and self._list_seq == 0 and self._scan(
                _scan_is_empty, self._live_db(), _KIND_PREFIX, _prefix_end(_KIND_PREFIX)):
            return dropped
        self._ttl.drop()  # their states are dropped
        self._drop_handles()  # handles handed out before no longer reach the dropped families
        for name in list(self._ttl.trackers):
            self._track_ttl(name, None)
        self._ttl.layouts.clear()
        try:  # no local for the database (see _release)
            for cf_name in sorted(self._families):
                self._live_db().drop_column_family(cf_name)
            self._families.clear()
            wb = rocksdict.WriteBatch(raw_mode=True)
            wb.delete_range(_KIND_PREFIX, _prefix_end(_KIND_PREFIX))
            wb.delete_range(_TTL_PREFIX, _prefix_end(_TTL_PREFIX))
            wb.delete(_SEQ_KEY)
            self._live_db().write(wb, self._write_options)
        except Exception as exc:  # noqa: BLE001 - rocksdict raises bare Exception
            raise _translate_error(exc, self._path) from None
        self._list_seq = 0
        log.info("rocksdb.state_discarded", path=self._path, states=dropped)
        return dropped

    def timer_store(self, name: str) -> TimerStore | None:
        """The column family of the timers named `name` (created if missing), or None when
        this backend keeps timers in memory (`timers="heap"`)."""
        if not self._timers_in_db:
            return None
        self._live_db()
        self._check_usable()
        cf_name = _TIMER_CF_PREFIX + name
        try:  # no local for the database or a column family (see _release)
            if cf_name not in self._families:
                self._live_db().create_column_family(cf_name, self._options.to_rocksdict()[0])
                self._families.add(cf_name)
            store = TimerStore(self._live_db().get_column_family(cf_name), self._write_options,
                               name, self._path)
        except Exception as exc:  # noqa: BLE001 - rocksdict raises bare Exception
            raise _translate_error(exc, self._path) from None
        self._timer_stores.append(store)
        return store

    def mark_restoring(self, restoring: bool) -> None:
        """Record that a restore is under way (before its discard_state), or that it has
        completed. A directory opened with the mark in place refuses its state (BackendError
        at the first use) until a restore into it completes: a restore that failed midway
        leaves some key groups restored and others empty."""
        self._live_db()
        try:
            if restoring:
                self._live_db().put(_RESTORING_KEY, b"", self._write_options)
            else:
                self._live_db().delete(_RESTORING_KEY, self._write_options)
        except Exception as exc:  # noqa: BLE001 - rocksdict raises bare Exception
            raise _translate_error(exc, self._path) from None

    def key_group_outside(self, key_groups: KeyGroupRange) -> tuple[str, int] | None:
        """(state name, key group) of the first entry stored outside `key_groups`, or None. A
        snapshot of `key_groups` would leave such an entry out (the directory was written by
        an operator owning other key groups, and not restored since)."""
        self._live_db()
        self._check_usable()
        below = key_groups.start.to_bytes(2, "big")
        above = (key_groups.end + 1).to_bytes(2, "big")
        for name, handle in sorted(self._handles.items()):
            for lower, upper in ((b"", below), (above, b"\xff\xff\xff")):
                first = self._scan(_scan_first, handle.cf, lower, upper)
                if first:
                    return name, int.from_bytes(first[0][0][:2], "big")
        return None

    def list_sequence(self) -> int:
        """The next list element sequence number (for checkpoints)."""
        return self._list_seq

    def set_list_sequence(self, value: int) -> None:
        """Raise the list sequence counter to at least `value`, and store it."""
        check_int("list_sequence", value, 0, 2**64 - 1)
        self._live_db()
        if value > self._list_seq:
            self._list_seq = value
            try:
                self._live_db().put(_SEQ_KEY, _SEQ.pack(value), self._write_options)
            except Exception as exc:  # noqa: BLE001 - rocksdict raises bare Exception
                raise _translate_error(exc, self._path) from None

    # -- TtlBackend ------------------------------------------------------------------------

    def ttl_layouts(self) -> dict[str, str]:
        """The time domain of every state stored with timestamps (kept in the directory)."""
        return dict(self._ttl.layouts)

    def set_ttl_layout(self, name: str, domain: str | None, stamp: int | None) -> None:
        """Store state `name` with timestamps of `domain` (None: without) from now on,
        rewriting its entries stored the other way, slice by slice (see `TtlBackend`). The
        directory refuses its state if that is interrupted."""
        self._live_db()
        self._check_usable()
        handle = self._handles.get(name)
        if handle is None:
            raise KeyError(f"state {name!r} is not registered in RocksDBBackend {self._path!r}")
        key = _TTL_PREFIX + name.encode()
        self._flush_refreshes()
        try:  # no local for the database (see _release)
            if (self._ttl.layouts.get(name) is None) != (domain is None) \
                    and self.has_entries(name):
                if domain is not None and stamp is None:
                    raise ValueError(f"state {name!r} holds entries without timestamps, and "
                                     "no timestamp to give them was named")
                self._live_db().put(key, _TTL_MIGRATING, self._write_options)
                rewrite_layout(handle, stamp if domain is not None else None,
                               self._write_maintenance)
            if domain is None:
                self._live_db().delete(key, self._write_options)
                self._ttl.layouts.pop(name, None)
            else:
                self._live_db().put(key, domain.encode(), self._write_options)
                self._ttl.layouts[name] = domain
        except Exception as exc:  # noqa: BLE001 - rocksdict raises bare Exception
            raise self._failure(exc) from None

    def has_entries(self, name: str) -> bool:
        """True when state `name` stores any entry."""
        handle = self._handles.get(name)
        if handle is None:
            return False
        return not self._scan(_scan_is_empty, handle.cf, b"", b"\xff\xff\xff")

    def track_ttl(self, name: str, tracker: TtlTracker | None) -> None:
        """Clean state `name` up as `tracker` asks (or no longer): full snapshot filtering,
        incremental steps, the background cleaner (`tracker.background_every`)."""
        self._track_ttl(name, tracker)

    def _track_ttl(self, name: str, tracker: TtlTracker | None) -> None:
        if self._cleaner is not None:
            self._cleaner.forget(name)
        self._ttl.track(name, tracker)

    def ttl_cleanup_step(self, name: str, budget: int, now: int) -> None:
        """Incremental cleanup of state `name`: up to `budget` stored entries (elements and
        map entries count one by one) from its cursor on, in a job of the backend's own in
        the lane (steps noted before that job runs join it)."""
        if self._ttl.add_step(name, budget, now):
            self._enqueue_maintenance(self._run_ttl_steps)

    def _run_ttl_steps(self) -> None:
        removed: list[tuple[_StateHandle, bytes]] = []
        wb = self._ttl.run_steps(self._handles, removed)
        if wb is not None:
            self._write_maintenance(wb, removed)

    async def wait_ttl_cleaner_idle(self) -> None:
        """Wait until the background cleaner of TTL states has nothing to do: every state it
        cleans has had its passes, and nothing in them can have expired since."""
        if self._cleaner is not None:
            await self._cleaner.wait_idle()
