"""Key groups: the unit in which keyed state is assigned to operators and rescaled.

A key's group is the unsigned murmur3 x86 32-bit hash (seed 0) of its canonical bytes,
modulo `max_parallelism`. Operator `i` of `p` owns a contiguous range: with
``q, r = divmod(max_parallelism, p)``, range `i` starts at ``i*q + min(i, r)`` and holds
``q + (1 if i < r else 0)`` groups, so the first `r` ranges are one larger.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from asyncstate.config import MAX_MAX_PARALLELISM, check_int
from asyncstate.serde import canonical_key, key_group_of_bytes

__all__ = [
    "KeyGroupRange",
    "assign_to_key_group",
    "compute_key_group_range_for_operator_index",
    "compute_operator_index_for_key_group",
    "key_group_of_bytes",
    "operator_index_for_key",
]

def assign_to_key_group(key: object, max_parallelism: int) -> int:
    """Key group of `key`: unsigned murmur3-32 (seed 0) of its canonical bytes, modulo
    `max_parallelism`."""
    check_int("max_parallelism", max_parallelism, 1, MAX_MAX_PARALLELISM)
    return key_group_of_bytes(canonical_key(key), max_parallelism)


@dataclasses.dataclass(frozen=True, slots=True)
class KeyGroupRange:
    """An inclusive range of key groups ``start..end``."""

    start: int
    end: int

    def __post_init__(self) -> None:
        check_int("start", self.start, 0)
        check_int("end", self.end, self.start)

    def contains(self, key_group: object) -> bool:
        """True when `key_group` is an int in this range (as `key_group in range`)."""
        return type(key_group) is int and self.start <= key_group <= self.end

    def __contains__(self, key_group: object) -> bool:
        return self.contains(key_group)

    def __len__(self) -> int:
        return self.end - self.start + 1

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end + 1))


def _check(max_parallelism: int, parallelism: int) -> None:
    check_int("max_parallelism", max_parallelism, 1, MAX_MAX_PARALLELISM)
    check_int("parallelism", parallelism, 1, max_parallelism)


def compute_key_group_range_for_operator_index(
    max_parallelism: int, parallelism: int, index: int
) -> KeyGroupRange:
    """The key groups owned by operator `index` of `parallelism`."""
    _check(max_parallelism, parallelism)
    check_int("operator_index", index, 0, parallelism - 1)
    q, r = divmod(max_parallelism, parallelism)
    start = index * q + min(index, r)
    return KeyGroupRange(start, start + q + (1 if index < r else 0) - 1)


def compute_operator_index_for_key_group(
    max_parallelism: int, parallelism: int, key_group: int
) -> int:
    """The operator index of `parallelism` that owns `key_group` (inverse of the range split)."""
    _check(max_parallelism, parallelism)
    check_int("key_group", key_group, 0, max_parallelism - 1)
    q, r = divmod(max_parallelism, parallelism)
    boundary = r * (q + 1)
    if key_group < boundary:
        return key_group // (q + 1)
    return r + (key_group - boundary) // q


def operator_index_for_key(key: object, max_parallelism: int, parallelism: int) -> int:
    """The index of the operator (of `parallelism`) whose key-group range holds `key`: where
    a job routes the key's records."""
    return compute_operator_index_for_key_group(
        max_parallelism, parallelism, assign_to_key_group(key, max_parallelism))
