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

from asyncstate.checkpoint.reader import Checkpoint
from asyncstate.config import check_int
from asyncstate.errors import CheckpointError

__all__ = ["read_operator_extras", "redistribute_even_split", "redistribute_union"]


def read_operator_extras(checkpoint: Checkpoint) -> tuple[int, dict[str, list[list[Any]]]]:
    """The list sequence to resume from and each operator list state's old lists.

    Reads what `KeyedOperator.snapshot` puts in every part's extra dict: ``list_sequence``
    (an int >= 0, absent for backends without one) and ``operator_state`` (``{name: {"items":
    [...], ...}}``). Returns the largest sequence of all parts and, per state name, one list
    per old part in operator order (empty where a part did not hold the state). An extra dict
    of another shape raises CheckpointError naming the part's data file.
    """
    sequence = 0
    parts: dict[str, list[list[Any]]] = {}
    count = len(checkpoint.parts)
    for i, part in enumerate(checkpoint.parts):
        extra = part.extra

        def bad(what: str, value: Any, path: str = part.data_path) -> CheckpointError:
            return CheckpointError(
                f"extra section of data file {path!r} has {what} {value!r}", path=path)

        seq = extra.get("list_sequence", 0)
        if type(seq) is not int or seq < 0:
            raise bad("an invalid list_sequence", seq)
        sequence = max(sequence, seq)
        states = extra.get("operator_state", {})
        if not isinstance(states, dict):
            raise bad("an operator_state that is not a map:", states)
        for name, entry in states.items():
            items = entry.get("items") if isinstance(entry, dict) else None
            if type(name) is not str or not isinstance(items, list):
                raise bad(f"operator state {name!r} without a list of items:", entry)
            parts.setdefault(name, [[] for _ in range(count)])[i] = items
    return sequence, parts


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
