"""Redistribution of operator (non-keyed) list state when restoring with another parallelism.

Operator list state is a list per operator instance. On restore the old instances' lists are
concatenated in instance order and dealt out again, the way a message-queue source deals
partition `j` to the consumer with ``j % consumer_count == consumer_index``:

- even split (`get_operator_list_state`): element `j` of the concatenation goes to instance
  ``j % new_parallelism`` (round robin), so instance sizes differ by at most one and no
  element is lost or duplicated. With unchanged parallelism each instance keeps its own list
  unchanged, as in Flink (nothing moves when nothing is rescaled).
- union (`get_union_list_state`): every instance gets the whole concatenation.

Both are pure functions of the old lists, so every new instance computes its share alone.

A restored operator list state that a run never declares is still written into that run's
checkpoints (`carried_share`), so it survives a run that does not use it, as keyed state
does. A restored state keeps its mode: declaring it with the other one is refused.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from asyncstate.checkpoint.reader import Checkpoint
from asyncstate.config import check_int
from asyncstate.errors import CheckpointError
from asyncstate.serde import check_value_bytes

__all__ = [
    "RestoredExtras",
    "carried_share",
    "read_operator_extras",
    "redistribute_even_split",
    "redistribute_union",
]


@dataclasses.dataclass(frozen=True)
class RestoredExtras:
    """What a checkpoint's extra dicts hold for the operator restoring it.

    `list_sequence`: the largest list sequence of all parts (0 when none has one).
    `operator_parts`: per operator list state, one list of element bytes per old part, in
    operator order (empty where a part did not hold the state). `operator_modes`: the
    redistribution mode (``"split"`` or ``"union"``) each state was last written with.
    `states`: the checkpoint's keyed state kinds by name, and `path` the checkpoint's path.
    """

    path: str
    list_sequence: int
    operator_parts: dict[str, list[list[bytes]]]
    operator_modes: dict[str, str]
    states: dict[str, str]


def read_operator_extras(checkpoint: Checkpoint) -> RestoredExtras:
    """Read and check what `KeyedOperator.snapshot` puts in every part's extra dict:
    ``list_sequence`` (an int >= 0, absent for backends without one) and ``operator_state``
    (``{name: {"mode": "split" | "union", "items": [msgpack bytes of one element, ...]}}``).

    An extra dict of another shape, an element that is not the msgpack bytes of exactly one
    value, or a state whose mode differs from the one an earlier part gives it, raises
    CheckpointError naming the part's data file.
    """
    sequence = 0
    parts: dict[str, list[list[bytes]]] = {}
    modes: dict[str, str] = {}
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
            mode = entry.get("mode", "split")
            if mode not in ("split", "union"):
                raise bad(f"operator state {name!r} with an unknown mode", mode)
            for j, item in enumerate(items):
                if not _one_value(item):
                    raise bad(f"operator state {name!r} whose element {j} is not the msgpack "
                              "bytes of one value:", item)
            known = modes.setdefault(name, mode)
            if known != mode:
                raise bad(f"operator state {name!r} in mode {mode!r}, where an earlier part "
                          "has it in mode", known)
            parts.setdefault(name, [[] for _ in range(count)])[i] = items
    return RestoredExtras(checkpoint.path, sequence, parts, modes, dict(checkpoint.states))


def _one_value(item: object) -> bool:
    """True if `item` is the msgpack bytes of exactly one value, as the state decodes it
    (`serde.decode_value`: dicts may have tuple keys)."""
    try:
        check_value_bytes(item)
    except (ValueError, TypeError):
        return False
    return True


def carried_share(parts: Sequence[Sequence[bytes]], mode: str, new_parallelism: int,
                  index: int) -> list[bytes]:
    """Instance `index`'s share of a restored operator list state in `mode` (``"split"`` or
    ``"union"``) that this run never declared, to write into its next checkpoint so that the
    state is carried.

    Split: the share declaring the state would give (`redistribute_even_split`). Instances
    of one run that declare it and instances that do not then hold disjoint shares covering
    every element once. Union: every instance is given everything, so each writes back a
    slice instead: with unchanged parallelism its own old list, otherwise one of
    `new_parallelism` contiguous slices of the concatenation. The next checkpoint's lists then
    concatenate to the same elements in the same order, so restoring it gives what restoring
    the old one would.
    """
    if mode == "split":
        return redistribute_even_split(parts, new_parallelism, index)
    if mode != "union":
        raise ValueError(f"mode must be 'split' or 'union', got {mode!r}")
    _check(new_parallelism, index)
    if len(parts) == new_parallelism:
        return list(parts[index])
    joined = list(itertools.chain.from_iterable(parts))
    q, r = divmod(len(joined), new_parallelism)
    start = index * q + min(index, r)
    return joined[start:start + q + (index < r)]


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
