"""Redistribution of operator (non-keyed) list state when restoring with another parallelism.

Operator list state is a list per operator instance. On restore the old instances' lists are
concatenated in instance order and dealt out again, following seed 003 (the MetaQ source
assigning partition `j` to the consumer with ``j % consumer_count == consumer_index``):

- even split (`get_operator_list_state`): element `j` of the concatenation goes to instance
  ``j % new_parallelism`` (round robin), so instance sizes differ by at most one and no
  element is lost or duplicated. With unchanged parallelism each instance keeps its own list
  unchanged, as in Flink (nothing moves when nothing is rescaled).
- union (`get_union_list_state`): every instance gets the whole concatenation.

Both are pure functions of the old lists, so every new instance computes its share alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from asyncstate.config import check_int

__all__ = ["redistribute_even_split", "redistribute_union"]


def _check(new_parallelism: int, index: int) -> None:
    check_int("new_parallelism", new_parallelism, 1)
    check_int("index", index, 0, new_parallelism - 1)


def redistribute_even_split(parts: Sequence[Sequence[Any]], new_parallelism: int,
                            index: int) -> list[Any]:
    """Instance `index`'s share of the old instances' lists `parts` (in old instance order):
    element `j` of their concatenation goes to instance ``j % new_parallelism``; an unchanged
    parallelism keeps ``parts[index]`` as it was."""
    _check(new_parallelism, index)
    if len(parts) == new_parallelism:
        return list(parts[index])
    return list(itertools.chain.from_iterable(parts))[index::new_parallelism]


def redistribute_union(parts: Sequence[Sequence[Any]], new_parallelism: int,
                       index: int) -> list[Any]:
    """Every element of every old instance's list, in old instance order, for each instance."""
    _check(new_parallelism, index)
    return list(itertools.chain.from_iterable(parts))
