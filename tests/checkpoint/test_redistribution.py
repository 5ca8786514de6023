"""Operator list state redistribution on rescale: even split (round robin) and union."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncstate.checkpoint.operator_state import (
    carried_share,
    redistribute_even_split,
    redistribute_union,
)
from asyncstate.errors import ConfigError


def rescale_even(parts: Sequence[Sequence[Any]], new_parallelism: int) -> list[list[Any]]:
    return [redistribute_even_split(parts, new_parallelism, i) for i in range(new_parallelism)]


def test_seed_example_five_partitions_from_one_to_two_instances():
    # Seed 003: partition j goes to the consumer with j % consumer_count == consumer_index.
    parts = [["p0", "p1", "p2", "p3", "p4"]]
    assert rescale_even(parts, 2) == [["p0", "p2", "p4"], ["p1", "p3"]]


def test_even_split_deals_the_concatenation_round_robin():
    parts = [["a", "b"], ["c"], ["d", "e", "f"]]
    assert rescale_even(parts, 2) == [["a", "c", "e"], ["b", "d", "f"]]
    assert rescale_even(parts, 4) == [["a", "e"], ["b", "f"], ["c"], ["d"]]
    assert rescale_even(parts, 1) == [["a", "b", "c", "d", "e", "f"]]


def test_unchanged_parallelism_keeps_each_instance_list():
    parts = [["a", "b", "c"], [], ["d"]]
    assert rescale_even(parts, 3) == parts


def test_more_instances_than_elements_leaves_some_empty():
    assert rescale_even([["x"], ["y"]], 5) == [["x"], ["y"], [], [], []]


def test_chain_1_2_5_3_loses_and_duplicates_nothing():
    elements = [f"offset-{i}" for i in range(23)] + ["dup", "dup"]  # equal elements too
    parts: list[list[Any]] = [list(elements)]
    for p in (2, 5, 3):
        parts = rescale_even(parts, p)
        assert len(parts) == p
        assert Counter(x for part in parts for x in part) == Counter(elements)
        sizes = [len(part) for part in parts]
        assert max(sizes) - min(sizes) <= 1


def test_union_chain_1_2_5_3_gives_every_instance_everything():
    elements = list(range(11))
    parts: list[list[Any]] = [list(elements)]
    for p in (2, 5, 3):
        unions = [redistribute_union(parts, p, i) for i in range(p)]
        assert unions == [[x for part in parts for x in part]] * p
        # Like a source with union state, each instance then keeps (and snapshots) only its
        # own share of what it was given.
        parts = [u[i::p] for i, u in enumerate(unions)]
    assert sorted(x for part in parts for x in part) == elements
    assert redistribute_union([[1], [2, 3]], 3, 2) == [1, 2, 3]


def test_union_returns_a_fresh_list():
    parts = [[1, 2]]
    got = redistribute_union(parts, 1, 0)
    got.append(3)
    assert parts == [[1, 2]]
    got = redistribute_even_split(parts, 1, 0)
    got.append(3)
    assert parts == [[1, 2]]


def test_empty_history_gives_empty_lists():
    assert redistribute_even_split([], 3, 1) == []
    assert redistribute_union([], 3, 1) == []


@pytest.mark.parametrize("fn", [redistribute_even_split, redistribute_union])
@pytest.mark.parametrize(("new_parallelism", "index", "option"), [
    (0, 0, "new_parallelism"), (2, 2, "index"), (2, -1, "index"), (True, 0, "new_parallelism"),
])
def test_invalid_arguments_are_config_errors(fn, new_parallelism, index, option):
    with pytest.raises(ConfigError, match=rf"^{option} must be"):
        fn([[1]], new_parallelism, index)


@given(parts=st.lists(st.lists(st.integers(), max_size=12), min_size=1, max_size=6),
       chain=st.lists(st.integers(1, 7), min_size=1, max_size=4))
def test_even_split_preserves_the_multiset_over_any_rescale_chain(parts, chain):
    expected = Counter(x for part in parts for x in part)
    for p in chain:
        parts = rescale_even(parts, p)
        assert Counter(x for part in parts for x in part) == expected


@given(parts=st.lists(st.lists(st.integers(), max_size=9), min_size=1, max_size=6),
       new_parallelism=st.integers(1, 7))
def test_carried_shares_partition_the_elements_as_declaring_instances_do(parts,
                                                                       new_parallelism):
    # split: exactly the share a declaring instance takes, so declaring and carrying
    # instances of one run never overlap; union: slices that keep the concatenation.
    split = [carried_share(parts, "split", new_parallelism, i) for i in range(new_parallelism)]
    assert split == rescale_even(parts, new_parallelism)
    union = [carried_share(parts, "union", new_parallelism, i) for i in range(new_parallelism)]
    assert [x for part in union for x in part] == [x for part in parts for x in part]
    assert max(map(len, union)) - min(map(len, union)) <= 1 or len(parts) == new_parallelism
    if len(parts) == new_parallelism:
        assert union == [list(part) for part in parts]


def test_carried_share_of_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match=r"mode must be 'split' or 'union', got 'broadcast'"):
        carried_share([[1]], "broadcast", 1, 0)
