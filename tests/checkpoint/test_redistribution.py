"""Operator list state in checkpoints: the even-split and union redistribution on rescale,
the mode each part records, and the checks of what a checkpoint holds."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgpack
import pytest
from checkpoint_files import (
    write_one_part,
)
from hypothesis import given
from hypothesis import strategies as st

import asyncstate as ast
from asyncstate.checkpoint.format import (
    checkpoint_path,
    open_checkpoint,
    write_part,
)
from asyncstate.checkpoint.operator_state import (
    carried_share,
    read_operator_extras,
    redistribute_even_split,
    redistribute_union,
)
from asyncstate.errors import CheckpointError, ConfigError

MAX_P = 16
TOO_DEEP = b"\x91" * 1024 + b"\x90"  # 1025 nested arrays: packs, but msgpack reads 1024 only


def test_operator_state_element_nested_too_deep_is_a_checkpoint_error(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_one_part(chk, [], extra={"operator_state": {
        "offsets": {"mode": "split", "items": [msgpack.packb(1), TOO_DEEP]}}})
    with pytest.raises(CheckpointError, match=r"operator state 'offsets' whose element 1"):
        read_operator_extras(open_checkpoint(chk))


class Declares(ast.KeyedProcessFunction):
    """Declares the operator list states named in `split` and `union` (None: not at all)."""

    def __init__(self, split: str | None = "offsets", union: str | None = "seen") -> None:
        self.split_name, self.union_name = split, union
        self.split: Any = None
        self.union: Any = None

    def open(self, ctx: ast.RuntimeContext) -> None:
        if self.split_name:
            self.split = ctx.get_operator_list_state(self.split_name)
        if self.union_name:
            self.union = ctx.get_union_list_state(self.union_name)

    async def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
        ctx.emit(value)


def _operator(fn: ast.KeyedProcessFunction, restore_from: str | None = None,
              parallelism: int = 1, index: int = 0) -> ast.KeyedOperator:
    return ast.KeyedOperator(fn, key_selector=lambda r: r, backend=ast.HeapBackend(),
                             config=ast.AsyncStateConfig(max_parallelism=MAX_P),
                             parallelism=parallelism, operator_index=index,
                             restore_from=restore_from)


@pytest.mark.timeout(60)
async def test_operator_list_update_validates_and_copies_its_values(tmp_path):
    fn = Declares()
    async with _operator(fn) as op:
        inner = [1, 2]
        await fn.split.update([inner, "x"])
        inner.append(3)  # the state holds a copy taken at update()
        assert await (await fn.split.get()).to_list() == [[1, 2], "x"]
        with pytest.raises(ast.SerializationError, match=r"'offsets'"):
            await fn.split.update(["ok", object()])
        assert await (await fn.split.get()).to_list() == [[1, 2], "x"]
        path = await op.snapshot(str(tmp_path), 1)
    fn2 = Declares()
    async with _operator(fn2, restore_from=path):
        assert await (await fn2.split.get()).to_list() == [[1, 2], "x"]


def _modes(path: str) -> list[dict[str, str]]:
    return [{name: entry["mode"] for name, entry in extra["operator_state"].items()}
            for extra in open_checkpoint(path).extras]


@pytest.mark.timeout(60)
async def test_checkpoint_records_each_operator_state_mode_and_carries_it(tmp_path):
    fn = Declares()
    async with _operator(fn) as op:
        await fn.split.add("s")
        await fn.union.add("u")
        p1 = await op.snapshot(str(tmp_path), 1)
    assert _modes(p1) == [{"offsets": "split", "seen": "union"}]
    assert read_operator_extras(open_checkpoint(p1)).operator_modes == {
        "offsets": "split", "seen": "union"}
    # A run that declares neither carries both, with their modes, into its checkpoints.
    paths = set()
    for index in range(2):
        async with _operator(Declares(None, None), p1, 2, index) as op:
            paths.add(await op.snapshot(str(tmp_path), 2))
    (p2,) = paths
    assert _modes(p2) == [{"offsets": "split", "seen": "union"}] * 2


def test_restored_list_sequence_is_the_largest_of_all_parts(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    for index, seq in enumerate([7, 3, 0]):
        write_part(chk, parallelism=3, operator_index=index, max_parallelism=MAX_P,
                   states={}, key_groups=[], extra={"list_sequence": seq})
    assert read_operator_extras(open_checkpoint(chk)).list_sequence == 7


@pytest.mark.parametrize("name", [5, b"offsets", None])
def test_operator_state_whose_name_is_not_a_str_is_a_checkpoint_error(tmp_path, name):
    chk = checkpoint_path(tmp_path, 1)
    write_one_part(chk, [], extra={"operator_state": {name: {"mode": "split", "items": []}}})
    with pytest.raises(CheckpointError, match=r"without a list of items") as info:
        read_operator_extras(open_checkpoint(chk))
    assert info.value.path.endswith(".bin")


@pytest.mark.parametrize("mode", ["broadcast", "SPLIT", None, 1])
def test_operator_state_with_an_unknown_mode_is_a_checkpoint_error(tmp_path, mode):
    chk = checkpoint_path(tmp_path, 1)
    write_one_part(chk, [], extra={"operator_state": {"offsets": {"mode": mode, "items": []}}})
    with pytest.raises(CheckpointError, match=r"operator state 'offsets' with an unknown mode"):
        read_operator_extras(open_checkpoint(chk))


def test_parts_that_disagree_on_an_operator_state_mode_are_a_checkpoint_error(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    for index, mode in enumerate(["union", "union", "split"]):
        write_part(chk, parallelism=3, operator_index=index, max_parallelism=MAX_P,
                   states={}, key_groups=[],
                   extra={"operator_state": {"offsets": {"mode": mode, "items": []},
                                             "seen": {"mode": "split", "items": []}}})
    with pytest.raises(CheckpointError, match=r"operator state 'offsets' in mode 'split', "
                                              r"where an earlier part has it in mode 'union'"
                       ) as info:
        read_operator_extras(open_checkpoint(chk))
    assert "part-3-2" in info.value.path


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("elements", "middle"), [(4, 3), (5, 4), (7, 3), (2, 3)])
async def test_carried_operator_state_keeps_every_element_once(tmp_path, elements, middle):
    items = [f"e{i}" for i in range(elements)]
    fn = Declares()
    async with _operator(fn) as op:
        await fn.split.add_all(items)
        await fn.union.add_all(items)
        p1 = await op.snapshot(str(tmp_path), 1)
    paths = set()
    for index in range(middle):  # never declares the states: carries them
        async with _operator(Declares(None, None), p1, middle, index) as op:
            paths.add(await op.snapshot(str(tmp_path), 2))
    (p2,) = paths
    fn = Declares()
    async with _operator(fn, restore_from=p2):
        # split: each carrying instance wrote the share declaring would have given it
        # (element j to instance j % middle); union: contiguous slices, order kept.
        shares = [items[index::middle] for index in range(middle)]
        assert await (await fn.split.get()).to_list() == [x for s in shares for x in s]
        assert await (await fn.union.get()).to_list() == items


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
