"""`StateTtlConfig`: how the entries of a state expire, built with `StateTtlConfig.new_builder`.

Every argument users pass is checked here (`ConfigError` naming the option).
"""

from __future__ import annotations

import dataclasses
import enum

from asyncstate.config import check_int
from asyncstate.errors import ConfigError

__all__ = [
    "DEFAULT_CLEANUP_SIZE",
    "DEFAULT_QUERY_TIME_AFTER_NUM_ENTRIES",
    "DEFAULT_TIMER_GRANULARITY_DIVISOR",
    "MAX_TTL_MS",
    "IncrementalCleanupStrategy",
    "RocksdbCompactFilterCleanupStrategy",
    "StateTtlConfig",
    "StateTtlConfigBuilder",
    "StateVisibility",
    "TimerCleanupStrategy",
    "TtlTimeCharacteristic",
    "UpdateType",
]

MAX_TTL_MS = 2**63 - 1
# The background strategies a config gets when it names none (as in Flink): incremental
# cleanup where the backend has no background cleaner (the heap), the background cleaner on
# RocksDB.
DEFAULT_CLEANUP_SIZE = 5
DEFAULT_QUERY_TIME_AFTER_NUM_ENTRIES = 1000
# Cleanup with timers rounds expirations up to a granularity of ttl_ms // 16 (at least 1) by
# default: a key written on every record then holds about 18 pending cleanup timers per state
# and namespace (ttl_ms / granularity + 2 at most), and an entry is removed less than
# ttl_ms / 16 after it expires.
DEFAULT_TIMER_GRANULARITY_DIVISOR = 16


class UpdateType(enum.Enum):
    """When the last-access timestamp of an entry is set."""

    DISABLED = "disabled"
    """TTL is off: the state is stored and read as if no TTL config were given."""
    ON_CREATE_AND_WRITE = "on_create_and_write"
    """On every write (which creates an entry or replaces it)."""
    ON_READ_AND_WRITE = "on_read_and_write"
    """On every write, and on every read that returns the entry."""


class StateVisibility(enum.Enum):
    """Whether a read may return an expired entry."""

    RETURN_EXPIRED_IF_NOT_CLEANED_UP = "return_expired_if_not_cleaned_up"
    """An expired entry still stored is returned (and removed by that read)."""
    NEVER_RETURN_EXPIRED = "never_return_expired"
    """An expired entry reads as absent."""


class TtlTimeCharacteristic(enum.Enum):
    """Which time entries expire in."""

    PROCESSING_TIME = "processing_time"
    """The operator's clock: access time and "now" are both the clock's time."""
    EVENT_TIME = "event_time"
    """The access time is the record's (or timer's) timestamp; "now" is the watermark."""


@dataclasses.dataclass(frozen=True, slots=True)
class IncrementalCleanupStrategy:
    """Each access of the state (and each record, if `run_cleanup_for_every_record`) checks up
    to `cleanup_size` entries of the whole state and removes the expired ones."""

    cleanup_size: int
    run_cleanup_for_every_record: bool

    def __post_init__(self) -> None:
        check_int("cleanup_size", self.cleanup_size, 1)
        if type(self.run_cleanup_for_every_record) is not bool:
            raise ConfigError("run_cleanup_for_every_record",
                              self.run_cleanup_for_every_record, "a bool")


@dataclasses.dataclass(frozen=True, slots=True)
class RocksdbCompactFilterCleanupStrategy:
    """RocksDB's background cleaner scans the state in slices and removes expired entries,
    reading the time once every `query_time_after_num_entries` entries."""

    query_time_after_num_entries: int

    def __post_init__(self) -> None:
        check_int("query_time_after_num_entries", self.query_time_after_num_entries, 1)


@dataclasses.dataclass(frozen=True, slots=True)
class TimerCleanupStrategy:
    """Exact cleanup with timers: each write (and refreshing read) registers a cleanup timer
    for its (key, namespace) at its expiration rounded up to a multiple of `granularity_ms`
    (None: ttl_ms // 16, at least 1); the firing removes what has expired."""

    granularity_ms: int | None = None

    def __post_init__(self) -> None:
        if self.granularity_ms is not None:
            check_int("granularity_ms", self.granularity_ms, 1, MAX_TTL_MS)


def _check_enum(option: str, value: object, enum_type: type[enum.Enum]) -> None:
    if type(value) is not enum_type:
        members = ", ".join(f"ast.{enum_type.__name__}.{m.name}" for m in enum_type)
        raise ConfigError(option, value, f"one of {members}")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StateTtlConfig:
    """How the entries of a state expire (build one with `StateTtlConfig.new_builder(ttl_ms)`).

    An entry is expired when ``last_access + ttl_ms <= now`` (the sum clamped to 2**63 - 1).
    Cleanup on read is always on; `cleanup_full_snapshot`, `incremental_cleanup` and
    `compact_filter_cleanup` and `timer_cleanup` add the other strategies (docs/ttl.md). With
    `cleanup_in_background` (the default) a backend also runs its default background strategy
    when none is named: incremental cleanup on the heap, the background cleaner on RocksDB.
    """

    ttl_ms: int
    update_type: UpdateType = UpdateType.ON_CREATE_AND_WRITE
    state_visibility: StateVisibility = StateVisibility.NEVER_RETURN_EXPIRED
    ttl_time_characteristic: TtlTimeCharacteristic = TtlTimeCharacteristic.PROCESSING_TIME
    cleanup_full_snapshot: bool = False
    incremental_cleanup: IncrementalCleanupStrategy | None = None
    compact_filter_cleanup: RocksdbCompactFilterCleanupStrategy | None = None
    timer_cleanup: TimerCleanupStrategy | None = None
    cleanup_in_background: bool = True

    def __post_init__(self) -> None:
        check_int("ttl_ms", self.ttl_ms, 1, MAX_TTL_MS)
        _check_enum("update_type", self.update_type, UpdateType)
        _check_enum("state_visibility", self.state_visibility, StateVisibility)
        _check_enum("ttl_time_characteristic", self.ttl_time_characteristic,
                    TtlTimeCharacteristic)
        for option in ("cleanup_full_snapshot", "cleanup_in_background"):
            if type(getattr(self, option)) is not bool:
                raise ConfigError(option, getattr(self, option), "a bool")
        if self.incremental_cleanup is not None and \
                type(self.incremental_cleanup) is not IncrementalCleanupStrategy:
            raise ConfigError("incremental_cleanup", self.incremental_cleanup,
                              "an IncrementalCleanupStrategy or None")
        if self.compact_filter_cleanup is not None and \
                type(self.compact_filter_cleanup) is not RocksdbCompactFilterCleanupStrategy:
            raise ConfigError("compact_filter_cleanup", self.compact_filter_cleanup,
                              "a RocksdbCompactFilterCleanupStrategy or None")
        if self.timer_cleanup is not None and \
                type(self.timer_cleanup) is not TimerCleanupStrategy:
            raise ConfigError("timer_cleanup", self.timer_cleanup,
                              "a TimerCleanupStrategy or None")

    @staticmethod
    def new_builder(ttl_ms: int) -> StateTtlConfigBuilder:
        """A builder of a config whose entries live `ttl_ms` milliseconds (an int >= 1)."""
        return StateTtlConfigBuilder(ttl_ms)

    @property
    def is_enabled(self) -> bool:
        """False for `UpdateType.DISABLED`: the state is then stored without timestamps."""
        return self.update_type is not UpdateType.DISABLED

    def effective_incremental_cleanup(self, background_cleaner: bool
                                      ) -> IncrementalCleanupStrategy | None:
        """The incremental strategy a backend runs: the one named, else the default one on a
        backend without a background cleaner when cleanup in background is on."""
        if self.incremental_cleanup is not None:
            return self.incremental_cleanup
        if self.cleanup_in_background and not background_cleaner:
            return IncrementalCleanupStrategy(DEFAULT_CLEANUP_SIZE, False)
        return None

    def effective_compact_filter_cleanup(self, background_cleaner: bool
                                         ) -> RocksdbCompactFilterCleanupStrategy | None:
        """The background cleaner's strategy on a backend that has one (else None): the one
        named, else the default one when cleanup in background is on."""
        if not background_cleaner:
            return None
        if self.compact_filter_cleanup is not None:
            return self.compact_filter_cleanup
        if self.cleanup_in_background:
            return RocksdbCompactFilterCleanupStrategy(DEFAULT_QUERY_TIME_AFTER_NUM_ENTRIES)
        return None


    def effective_timer_cleanup(self) -> TimerCleanupStrategy | None:
        """Cleanup with timers if named, with its granularity resolved (the one given, else
        ttl_ms // 16, at least 1); whether cleanup in background is on does not matter."""
        strategy = self.timer_cleanup
        if strategy is None or strategy.granularity_ms is not None:
            return strategy
        return TimerCleanupStrategy(max(1, self.ttl_ms // DEFAULT_TIMER_GRANULARITY_DIVISOR))


class StateTtlConfigBuilder:
    """Builds a `StateTtlConfig`; every setter checks its argument and returns the builder."""

    def __init__(self, ttl_ms: int) -> None:
        check_int("ttl_ms", ttl_ms, 1, MAX_TTL_MS)
        self._fields: dict[str, object] = {"ttl_ms": ttl_ms}

    def __repr__(self) -> str:
        return f"<StateTtlConfigBuilder {self._fields}>"

    def _set(self, option: str, value: object) -> StateTtlConfigBuilder:
        self._fields[option] = value
        return self

    def set_ttl(self, ttl_ms: int) -> StateTtlConfigBuilder:
        """Entries live `ttl_ms` milliseconds after their last access."""
        return self._set("ttl_ms", check_int("ttl_ms", ttl_ms, 1, MAX_TTL_MS))

    def set_update_type(self, update_type: UpdateType) -> StateTtlConfigBuilder:
        """When the last-access timestamp is set (default ON_CREATE_AND_WRITE)."""
        _check_enum("update_type", update_type, UpdateType)
        return self._set("update_type", update_type)

    def update_ttl_on_create_and_write(self) -> StateTtlConfigBuilder:
        """`set_update_type(UpdateType.ON_CREATE_AND_WRITE)`."""
        return self._set("update_type", UpdateType.ON_CREATE_AND_WRITE)

    def update_ttl_on_read_and_write(self) -> StateTtlConfigBuilder:
        """`set_update_type(UpdateType.ON_READ_AND_WRITE)`."""
        return self._set("update_type", UpdateType.ON_READ_AND_WRITE)

    def set_state_visibility(self, visibility: StateVisibility) -> StateTtlConfigBuilder:
        """Whether reads may return expired entries (default NEVER_RETURN_EXPIRED)."""
        _check_enum("state_visibility", visibility, StateVisibility)
        return self._set("state_visibility", visibility)

    def return_expired_if_not_cleaned_up(self) -> StateTtlConfigBuilder:
        """`set_state_visibility(StateVisibility.RETURN_EXPIRED_IF_NOT_CLEANED_UP)`."""
        return self._set("state_visibility", StateVisibility.RETURN_EXPIRED_IF_NOT_CLEANED_UP)

    def never_return_expired(self) -> StateTtlConfigBuilder:
        """`set_state_visibility(StateVisibility.NEVER_RETURN_EXPIRED)`."""
        return self._set("state_visibility", StateVisibility.NEVER_RETURN_EXPIRED)

    def set_ttl_time_characteristic(self, characteristic: TtlTimeCharacteristic
                                    ) -> StateTtlConfigBuilder:
        """Processing time (the default) or event time."""
        _check_enum("ttl_time_characteristic", characteristic, TtlTimeCharacteristic)
        return self._set("ttl_time_characteristic", characteristic)

    def use_processing_time(self) -> StateTtlConfigBuilder:
        """`set_ttl_time_characteristic(TtlTimeCharacteristic.PROCESSING_TIME)`."""
        return self._set("ttl_time_characteristic", TtlTimeCharacteristic.PROCESSING_TIME)

    def use_event_time(self) -> StateTtlConfigBuilder:
        """`set_ttl_time_characteristic(TtlTimeCharacteristic.EVENT_TIME)`."""
        return self._set("ttl_time_characteristic", TtlTimeCharacteristic.EVENT_TIME)

    def cleanup_full_snapshot(self) -> StateTtlConfigBuilder:
        """Leave expired entries out of checkpoints."""
        return self._set("cleanup_full_snapshot", True)

    def cleanup_incrementally(self, cleanup_size: int,
                              run_cleanup_for_every_record: bool) -> StateTtlConfigBuilder:
        """Check up to `cleanup_size` entries on each access of the state (and on each record
        when `run_cleanup_for_every_record`), removing the expired ones."""
        return self._set("incremental_cleanup", IncrementalCleanupStrategy(
            cleanup_size, run_cleanup_for_every_record))

    def cleanup_in_rocksdb_compact_filter(self, query_time_after_num_entries: int
                                          ) -> StateTtlConfigBuilder:
        """On RocksDB, a background cleaner removes expired entries, reading the time once
        every `query_time_after_num_entries` entries it checks (ignored on other backends)."""
        return self._set("compact_filter_cleanup", RocksdbCompactFilterCleanupStrategy(
            query_time_after_num_entries))

    def cleanup_with_timers(self, granularity_ms: int | None = None) -> StateTtlConfigBuilder:
        """Remove each entry at its expiration with a cleanup timer under its key, even if it
        is never read again. Expirations are rounded up to a multiple of `granularity_ms`
        (default ttl_ms // 16, at least 1): an entry goes at most that much late, and a key
        holds at most ttl_ms / granularity_ms + 2 pending timers per state and namespace."""
        return self._set("timer_cleanup", TimerCleanupStrategy(granularity_ms))

    def disable_cleanup_in_background(self) -> StateTtlConfigBuilder:
        """Run no default background strategy (the strategies named still run)."""
        return self._set("cleanup_in_background", False)

    def build(self) -> StateTtlConfig:
        """The config."""
        return StateTtlConfig(**self._fields)  # type: ignore[arg-type]
