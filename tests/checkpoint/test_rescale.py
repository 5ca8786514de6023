"""Rescaling through checkpoints: keyed state and both kinds of operator list state through
chains of parallelisms and backends, against sequential models."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_functions import (
    LOOP_NAMES,
    Ledger,
    new_backend,
    normalize,
    run_on_loop,
    second,
    slow_examples,
)

import asyncstate as ast

MAX_P = 16


class Totals(ast.KeyedProcessFunction):
    """Per key: a running sum (ValueState), the values (ListState), counts per tag (MapState);
    one operator list state holding the instance's 'offsets'."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.sum = ctx.get_state(ast.ValueStateDescriptor("sum"))
        self.values = ctx.get_list_state(ast.ListStateDescriptor("values"))
        self.tags = ctx.get_map_state(ast.MapStateDescriptor("tags"))
        self.offsets = ctx.get_operator_list_state("offsets")
        self.seen = ctx.get_union_list_state("seen")

    async def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
        key, amount, tag = value
        total = (await self.sum.value() or 0) + amount
        await self.sum.update(total)
        await self.values.add(amount)
        await self.tags.put(tag, (await self.tags.get(tag) or 0) + 1)
        values = await (await self.values.get()).to_list()
        tags = dict(await (await self.tags.entries()).to_list())
        ctx.emit((key, total, values, tags))


def _owner(key: Any, parallelism: int) -> int:
    kg = ast.assign_to_key_group(key, MAX_P)
    return ast.compute_operator_index_for_key_group(MAX_P, parallelism, kg)


async def _phase(records: list[tuple[Any, int, str]], parallelism: int, directory: str,
                 checkpoint_id: int, restore_from: str | None,
                 backend_factory: Callable[[int], Any]) -> tuple[str, dict[Any, Any]]:
    config = ast.AsyncStateConfig(max_parallelism=MAX_P, batch_size=7, max_in_flight=20)
    final: dict[Any, Any] = {}
    paths = set()
    for index in range(parallelism):
        fn = Totals()
        op = ast.KeyedOperator(fn, key_selector=lambda r: r[0], backend=backend_factory(index),
                               config=config, parallelism=parallelism, operator_index=index,
                               restore_from=restore_from)
        async with op:
            await fn.offsets.add(f"p{parallelism}-i{index}")
            await fn.seen.add(index)
            for r in records:
                if _owner(r[0], parallelism) == index:
                    await op.process(r)
            paths.add(await op.snapshot(directory, checkpoint_id))
            for key, total, values, tags in op.outputs():
                final[key] = (total, values, tags)
    assert len(paths) == 1
    return paths.pop(), final


def _model(records: list[tuple[Any, int, str]]) -> dict[Any, Any]:
    state: dict[Any, Any] = {}
    for key, amount, tag in records:
        total, values, tags = state.get(key, (0, [], {}))
        tags = dict(tags)
        tags[tag] = tags.get(tag, 0) + 1
        state[key] = (total + amount, [*values, amount], tags)
    return state


async def _rescale_chain(records: list[tuple[Any, int, str]], chain: list[int], tmp: Any,
                         backend_factory: Callable[[str, int, int], Any]) -> None:
    phases = [records[i::len(chain)] for i in range(len(chain))]
    seen: list[tuple[Any, int, str]] = []
    restore: str | None = None
    for n, (parallelism, chunk) in enumerate(zip(chain, phases, strict=True)):
        path, final = await _phase(
            chunk, parallelism, str(tmp / "chk"), n, restore,
            lambda index, p=parallelism, n=n: backend_factory(f"{n}-{p}", p, index))
        seen.extend(chunk)
        expected = _model(seen)
        for key, value in final.items():
            assert value == expected[key], key
        restore = path


def _totals_records(n: int, keys: int, seed: int) -> list[tuple[Any, int, str]]:
    rng = random.Random(seed)
    return [(rng.choice([f"k{i}" for i in range(keys)] + list(range(keys))),
             rng.randint(-5, 50), rng.choice("xyz")) for _ in range(n)]


def _heap(tag: str, parallelism: int, index: int) -> ast.HeapBackend:
    return ast.HeapBackend()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["heap", "rocksdb", "mixed"])
async def test_rescale_2_to_3_to_1_equals_the_model(tmp_path: Any, kind: str) -> None:
    def factory(tag: str, parallelism: int, index: int) -> Any:
        # "mixed": RocksDB writes the checkpoints heap restores, and the other way round.
        if kind == "heap" or (kind == "mixed" and parallelism != 3):
            return ast.HeapBackend()
        return ast.RocksDBBackend(str(tmp_path / f"db-{tag}-{index}"))

    await _rescale_chain(_totals_records(300, 25, 1), [2, 3, 1], tmp_path, factory)


@pytest.mark.timeout(60)
async def test_operator_state_through_1_2_5_3(tmp_path: Any) -> None:
    config = ast.AsyncStateConfig(max_parallelism=MAX_P)
    restore: str | None = None
    expected: list[str] = []
    for n, parallelism in enumerate([1, 2, 5, 3]):
        got_split: list[str] = []
        got_union: list[list[int]] = []
        paths = set()
        for index in range(parallelism):
            fn = Totals()
            async with ast.KeyedOperator(fn, key_selector=lambda r: r[0],
                                         backend=ast.HeapBackend(), config=config,
                                         parallelism=parallelism, operator_index=index,
                                         restore_from=restore) as op:
                got_split.extend(await (await fn.offsets.get()).to_list())
                got_union.append(await (await fn.seen.get()).to_list())
                await fn.offsets.add(f"phase{n}-i{index}")
                await fn.seen.add(n * 10 + index)
                paths.add(await op.snapshot(str(tmp_path), n))
        # Even split: every element reaches exactly one instance; union: all, everywhere.
        assert sorted(got_split) == sorted(expected)
        assert all(u == got_union[0] for u in got_union)
        expected.extend(f"phase{n}-i{i}" for i in range(parallelism))
        restore = paths.pop()


@pytest.mark.timeout(120)
@settings(max_examples=slow_examples(15), deadline=None)
@given(keys=st.integers(1, 40), n=st.integers(0, 120), seed=st.integers(0, 10_000),
       chain=st.lists(st.integers(1, 5), min_size=2, max_size=3),
       loop=st.sampled_from(LOOP_NAMES))
def test_random_rescale_chains_equal_the_model(tmp_path_factory: Any, keys: int, n: int,
                                               seed: int, chain: list[int], loop: str) -> None:
    tmp = tmp_path_factory.mktemp("rescale")
    run_on_loop(loop, _rescale_chain(_totals_records(n, keys, seed), chain, tmp, _heap))


class Holder(ast.KeyedProcessFunction):
    """Only operator state: one even-split and one union list state."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.split = ctx.get_operator_list_state("split")
        self.union = ctx.get_union_list_state("union")

    async def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
        pass


ELEMENTS: list[Any] = [
    {(1, 2): 3, (4, (5, 6)): [7]},  # dict with tuple keys (nested too): API.md allows them
    {1: "a", 2.5: None, None: (8, 9)},
    [(1, 2), {"k": (3,)}],
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("new_parallelism", [1, 2, 3])
async def test_operator_state_values_restore_as_keyed_state_values_do(
        tmp_path: Any, new_parallelism: int) -> None:
    """Operator list state elements follow the value rules of keyed state: every value the
    snapshot accepts restores (tuples back as lists, tuple map keys kept)."""
    config = ast.AsyncStateConfig(max_parallelism=MAX_P)
    fn = Holder()
    async with ast.KeyedOperator(fn, key_selector=lambda r: r, backend=ast.HeapBackend(),
                                 config=config, parallelism=2, operator_index=0) as op:
        for element in ELEMENTS:
            await fn.split.add(element)
            await fn.union.add(element)
        path = await op.snapshot(str(tmp_path), 1)
    async with ast.KeyedOperator(Holder(), key_selector=lambda r: r, backend=ast.HeapBackend(),
                                 config=config, parallelism=2, operator_index=1) as op:
        assert await op.snapshot(str(tmp_path), 1) == path
    expected = [{(1, 2): 3, (4, (5, 6)): [7]}, {1: "a", 2.5: None, None: [8, 9]},
                [[1, 2], {"k": [3]}]]
    got_split: list[Any] = []
    for index in range(new_parallelism):
        fn = Holder()
        async with ast.KeyedOperator(fn, key_selector=lambda r: r, backend=ast.HeapBackend(),
                                     config=config, parallelism=new_parallelism,
                                     operator_index=index, restore_from=path):
            got_split.extend(await (await fn.split.get()).to_list())
            assert await (await fn.union.get()).to_list() == expected
    assert sorted(map(repr, got_split)) == sorted(map(repr, expected))


BackendFactory = Callable[[str], Any]  # tag -> a fresh backend


def _owns(key: Any, max_p: int, parallelism: int, index: int) -> bool:
    kg = ast.assign_to_key_group(key, max_p)
    return ast.compute_operator_index_for_key_group(max_p, parallelism, kg) == index


def _keyed_model(records: list[Any]) -> dict[Any, Any]:
    state: dict[Any, Any] = {}
    for _, key, amount, tag in records:
        total, values, tags = state.get(key, (0, [], {}))
        tags = {**tags, tag: tags.get(tag, 0) + 1}
        state[key] = (total + amount, [*values, amount], tags)
    return state


def _split_model(old: list[list[Any]], parallelism: int) -> list[list[Any]]:
    """Seed 003 even split, written independently of the package."""
    if len(old) == parallelism:
        return [list(part) for part in old]
    flat = [x for part in old for x in part]
    return [[x for j, x in enumerate(flat) if j % parallelism == i] for i in range(parallelism)]


def _backend_factory(kind: str, tmp: Any) -> BackendFactory:
    return lambda tag: new_backend(kind, tmp)


async def _chain(tmp: Any, chain: list[tuple[int, str]], records: list[Any],
                 max_p: int = MAX_P, batch_size: int = 5) -> None:
    """Run `records` cut into one chunk per phase through `chain` of (parallelism, backend
    kind); after each phase compare keyed state (every key seen so far) and operator state
    with the models."""
    config = ast.AsyncStateConfig(max_parallelism=max_p, batch_size=batch_size,
                                  max_in_flight=13)
    chunks = [records[i::len(chain)] for i in range(len(chain))]
    seen: list[Any] = []
    split_parts: list[list[Any]] = []
    union_parts: list[list[Any]] = []
    restore: str | None = None
    for n, ((parallelism, kind), chunk) in enumerate(zip(chain, chunks, strict=True)):
        seen.extend(chunk)
        expected_keyed = _keyed_model(seen)
        expected_split = _split_model(split_parts, parallelism)
        expected_union = [x for part in union_parts for x in part]
        make = _backend_factory(kind, tmp)
        new_split: list[list[Any]] = []
        new_union: list[list[Any]] = []
        got_keyed: dict[Any, Any] = {}
        paths = set()
        for index in range(parallelism):
            fn = Ledger()
            async with ast.KeyedOperator(fn, key_selector=second, backend=make(f"{n}-{index}"),
                                         config=config, parallelism=parallelism,
                                         operator_index=index, restore_from=restore) as op:
                assert fn.split is not None and fn.union is not None
                got_split = await (await fn.split.get()).to_list()
                got_union = await (await fn.union.get()).to_list()
                assert got_split == expected_split[index], (n, index)
                assert got_union == expected_union, (n, index)
                # Split: append one element. Union: keep this instance's share, append one.
                await fn.split.add(f"s{n}-{index}")
                await fn.union.update([*got_union[index::parallelism], [n, index]])
                new_split.append([*got_split, f"s{n}-{index}"])
                new_union.append([*got_union[index::parallelism], [n, index]])
                for r in chunk:
                    if _owns(r[1], max_p, parallelism, index):
                        await op.process(r)
                paths.add(await op.snapshot(str(tmp / "chk"), n))  # no drain: snapshot drains
                for key in expected_keyed:
                    if _owns(key, max_p, parallelism, index):
                        await op.process(("r", key))
                await op.drain()
                for key, total, values, tags in op.outputs():
                    got_keyed[key] = (total, values, tags)
        assert got_keyed == expected_keyed, n
        assert len(paths) == 1
        restore = paths.pop()
        split_parts, union_parts = new_split, new_union


def _records(n: int, keys: int, seed: int) -> list[Any]:
    rng = random.Random(seed)
    pool: list[Any] = [f"k{i}" for i in range(keys)] + list(range(keys // 2)) + [
        (1, "t"), b"\x00b", 2**64 - 1, -(2**63), 2.5, None, ""]  # 1.0/True: see below
    return [("w", rng.choice(pool), rng.randint(-5, 50), rng.choice(["x", "y", 3, b"t", None]))
            for _ in range(n)]


@pytest.mark.timeout(120)
async def test_chain_1_2_5_3_1_mixed_backends_equals_the_models(tmp_path: Any) -> None:
    chain = [(1, "heap"), (2, "rocksdb"), (5, "heap"), (3, "rocksdb"), (1, "rocksdb")]
    await _chain(tmp_path, chain, _records(250, 30, 7))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("max_p", "chain"), [
    (1, [(1, "heap"), (1, "rocksdb"), (1, "heap")]),
    (4, [(4, "rocksdb"), (2, "heap"), (4, "heap"), (1, "rocksdb")]),  # parallelism == max_p
    (5, [(5, "heap"), (3, "rocksdb"), (5, "rocksdb")]),
    (32768, [(1, "heap"), (3, "rocksdb"), (2, "heap")]),
])
async def test_max_parallelism_edge_values(tmp_path: Any, max_p: int,
                                           chain: list[tuple[int, str]]) -> None:
    await _chain(tmp_path, chain, _records(90, 12, max_p), max_p=max_p)


@pytest.mark.timeout(300)
@settings(max_examples=slow_examples(8), deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(0, 80), keys=st.integers(1, 20),
       chain=st.lists(st.tuples(st.integers(1, 5), st.sampled_from(["heap", "rocksdb"])),
                      min_size=2, max_size=4),
       loop=st.sampled_from(LOOP_NAMES))
def test_random_chains_equal_the_models(tmp_path_factory: Any, seed: int, n: int, keys: int,
                                        chain: list[tuple[int, str]], loop: str) -> None:
    tmp = tmp_path_factory.mktemp("adv")
    run_on_loop(loop, _chain(tmp, chain, _records(n, keys, seed), batch_size=3))


async def _op_phase(tmp: Any, parallelism: int, restore: str | None, checkpoint_id: int,
                    declare: Callable[[int], tuple[str | None, str | None]],
                    add: Callable[[int], list[Any]]) -> tuple[str, list[dict[str, Any]]]:
    """One run of `parallelism` instances: instance i declares the split and union names of
    `declare(i)` (None: not declared), reads them, appends `add(i)` to each, snapshots."""
    config = ast.AsyncStateConfig(max_parallelism=MAX_P)
    got: list[dict[str, Any]] = []
    paths = set()
    for index in range(parallelism):
        split, union = declare(index)
        fn = Ledger(split, union)
        async with ast.KeyedOperator(fn, key_selector=second, backend=ast.HeapBackend(),
                                     config=config, parallelism=parallelism,
                                     operator_index=index, restore_from=restore) as op:
            here: dict[str, Any] = {}
            for state in (fn.split, fn.union):
                if state is not None:
                    here[state.name] = await (await state.get()).to_list()
                    await state.add_all(add(index))
            got.append(here)
            paths.add(await op.snapshot(str(tmp), checkpoint_id))
    assert len(paths) == 1
    return paths.pop(), got


ODD = [(1, (2, "t")), b"\x00\xff", bytearray(b"ba"), 2**64 - 1, -(2**63), None, True, 1.0, 1,
       -0.0, "", "ключ", [], {}, {"a": (1,), 7: [b"x"]}, [[[]]], "x" * 5000]


async def test_odd_element_types_survive_rescale_1_3_2(tmp_path: Any) -> None:
    elements = ODD + ODD[:5]  # with duplicates
    p1, _ = await _op_phase(tmp_path, 1, None, 1, lambda i: ("offsets", "seen"),
                            lambda i: elements)
    p2, got = await _op_phase(tmp_path, 3, p1, 2, lambda i: ("offsets", "seen"), lambda i: [])
    expected = [normalize(x) if not isinstance(x, bytearray) else bytes(x) for x in elements]
    split = [x for g in got for x in g["offsets"]]
    assert sorted(map(repr, split)) == sorted(map(repr, expected))
    assert [type(x) for x in got[0]["seen"]] == [type(x) for x in expected]
    assert all(g["seen"] == expected for g in got)
    # Round robin: instance i holds elements i, i+3, ...
    assert [g["offsets"] for g in got] == [expected[i::3] for i in range(3)]
    _, got = await _op_phase(tmp_path, 2, p2, 3, lambda i: ("offsets", None), lambda i: [])
    flat = [x for i in range(3) for x in expected[i::3]]  # instance order of the last run
    assert [g["offsets"] for g in got] == [flat[0::2], flat[1::2]]


@pytest.mark.parametrize("bad", [2**64, -(2**63) - 1, object(), {1, 2}, [1, object()]])
async def test_unencodable_operator_elements_are_rejected_and_nothing_leaks(
        tmp_path: Any, bad: Any) -> None:
    fn = Ledger()
    async with ast.KeyedOperator(fn, key_selector=second, backend=ast.HeapBackend(),
                                 config=ast.AsyncStateConfig(max_parallelism=MAX_P)) as op:
        assert fn.split is not None
        await fn.split.add("kept")
        with pytest.raises(ast.SerializationError):
            await fn.split.add(bad)
        with pytest.raises(ast.SerializationError):
            await fn.split.add_all(["no", bad])
        path = await op.snapshot(str(tmp_path), 1)
    _, got = await _op_phase(tmp_path, 1, path, 2, lambda i: ("offsets", None), lambda i: [])
    assert got == [{"offsets": ["kept"]}]


async def test_empty_operator_lists_survive_rescales(tmp_path: Any) -> None:
    path: str | None = None
    for n, p in enumerate([1, 4, 2, 1]):
        path, got = await _op_phase(tmp_path, p, path, n, lambda i: ("offsets", "seen"),
                                    lambda i: [])
        assert got == [{"offsets": [], "seen": []}] * p


async def test_operator_state_declared_by_only_some_instances_rescales_without_loss(
        tmp_path: Any) -> None:
    # 2 instances, only instance 1 declares "offsets"; then 3 and 1 instances, all declaring.
    p1, _ = await _op_phase(tmp_path, 2, None, 1,
                            lambda i: ("offsets", "seen") if i == 1 else (None, None),
                            lambda i: [f"e{i}a", f"e{i}b"])
    p2, got = await _op_phase(tmp_path, 3, p1, 2, lambda i: ("offsets", "seen"), lambda i: [])
    assert [g["offsets"] for g in got] == [["e1a"], ["e1b"], []]
    assert all(g["seen"] == ["e1a", "e1b"] for g in got)
    _, got = await _op_phase(tmp_path, 1, p2, 3, lambda i: ("offsets", None), lambda i: [])
    assert got == [{"offsets": ["e1a", "e1b"]}]


async def test_unchanged_parallelism_keeps_each_instance_list(tmp_path: Any) -> None:
    p1, _ = await _op_phase(tmp_path, 3, None, 1, lambda i: ("offsets", None),
                            lambda i: [f"i{i}-{j}" for j in range(i + 1)])
    _, got = await _op_phase(tmp_path, 3, p1, 2, lambda i: ("offsets", None), lambda i: [])
    assert [g["offsets"] for g in got] == [["i0-0"], ["i1-0", "i1-1"], ["i2-0", "i2-1", "i2-2"]]


@pytest.mark.parametrize(("before", "after"), [("split", "union"), ("union", "split")])
async def test_a_restored_operator_state_keeps_its_mode(tmp_path: Any, before: str,
                                                        after: str) -> None:
    """As in Flink, declaring a restored operator state with the other mode is refused
    (instances that do not declare it carry it in its old mode, so a checkpoint holding both
    modes could not be restored), and the checkpoint still restores in its own mode."""
    def names(mode: str) -> Callable[[int], tuple[str | None, str | None]]:
        return lambda i: ("x", None) if mode == "split" else (None, "x")

    p1, _ = await _op_phase(tmp_path, 2, None, 1, names(before), lambda i: [f"e{i}"])
    with pytest.raises(ast.ConfigError, match=(
            rf"operator state 'x' was restored with {before} redistribution from "
            rf"'{p1}' and cannot be declared with {after} redistribution")):
        await _op_phase(tmp_path, 3, p1, 2, names(after), lambda i: [])
    _, got = await _op_phase(tmp_path, 3, p1, 2, names(before), lambda i: [])
    expected = _split_model([["e0"], ["e1"]], 3) if before == "split" else [["e0", "e1"]] * 3
    assert [g["x"] for g in got] == expected


def _carry_model(parts: list[list[Any]], parallelism: int, mode: str,
                 declared: list[bool], adds: list[list[Any]]) -> list[list[Any]]:
    """The lists a run of `parallelism` instances writes for one operator state restored
    from `parts`: a declaring instance writes what it was given plus its `adds`; one that does
    not declare it writes its even-split share (split) or a contiguous slice of the
    concatenation, its own old list at unchanged parallelism (union)."""
    flat = [x for part in parts for x in part]
    given = (_split_model(parts, parallelism) if mode == "split" else [flat] * parallelism)
    if len(parts) == parallelism:
        slices = [list(part) for part in parts]
    else:
        q, r = divmod(len(flat), parallelism)
        bounds = [i * q + min(i, r) for i in range(parallelism + 1)]
        slices = [flat[bounds[i]:bounds[i + 1]] for i in range(parallelism)]
    carried = given if mode == "split" else slices
    return [[*given[i], *adds[i]] if declared[i] else carried[i] for i in range(parallelism)]


async def test_operator_state_declared_by_some_instances_after_a_rescale_loses_nothing(
        tmp_path: Any) -> None:
    # 2 instances hold [e0a, e0b] and [e1a, e1b]; at 3 only instance 0 declares the state.
    p1, _ = await _op_phase(tmp_path, 2, None, 1, lambda i: ("offsets", None),
                            lambda i: [f"e{i}a", f"e{i}b"])
    p2, got = await _op_phase(tmp_path, 3, p1, 2,
                              lambda i: ("offsets", None) if i == 0 else (None, None),
                              lambda i: [])
    assert got[0] == {"offsets": ["e0a", "e1b"]}
    _, got = await _op_phase(tmp_path, 1, p2, 3, lambda i: ("offsets", None), lambda i: [])
    # instances 1 and 2 carried their even-split shares [e0b] and [e1a]
    assert got == [{"offsets": ["e0a", "e1b", "e0b", "e1a"]}]


@pytest.mark.timeout(300)
@settings(max_examples=slow_examples(25), deadline=None)
@given(data=st.data(),
       chain=st.lists(st.integers(1, 5), min_size=2, max_size=5),
       loop=st.sampled_from(LOOP_NAMES))
def test_random_partial_declarations_match_the_carry_model(tmp_path_factory: Any,
                                                           data: st.DataObject,
                                                           chain: list[int], loop: str) -> None:
    """Each run of the chain declares each state on a random subset of its instances; every
    checkpoint must hold exactly what the model says, and the last run restores it."""
    tmp = tmp_path_factory.mktemp("partial")
    masks = [data.draw(st.lists(st.booleans(), min_size=p, max_size=p)) for p in chain]

    async def run() -> None:
        split: list[list[Any]] = []
        union: list[list[Any]] = []
        restore: str | None = None
        for n, (parallelism, mask) in enumerate(zip(chain, masks, strict=True)):
            # Both states are declared by the same instances (union: a different subset
            # comes from the mask reversed).
            union_mask = mask[::-1]
            adds = [[f"{n}.{i}"] for i in range(parallelism)]
            restore, got = await _op_phase(
                tmp, parallelism, restore, n,
                lambda i, m=mask, u=union_mask: ("offsets" if m[i] else None,
                                                 "seen" if u[i] else None),
                lambda i, a=adds: a[i])
            for i in range(parallelism):
                if mask[i]:
                    assert got[i]["offsets"] == _split_model(split, parallelism)[i], (n, i)
                if union_mask[i]:
                    assert got[i]["seen"] == [x for part in union for x in part], (n, i)
            split = _carry_model(split, parallelism, "split", mask, adds)
            union = _carry_model(union, parallelism, "union", union_mask, adds)
        _, got = await _op_phase(tmp, 1, restore, len(chain), lambda i: ("offsets", "seen"),
                                 lambda i: [])
        assert got == [{"offsets": _split_model(split, 1)[0],
                        "seen": [x for part in union for x in part]}]

    run_on_loop(loop, run())


async def test_operator_and_keyed_state_with_the_same_name_are_independent(
        tmp_path: Any) -> None:
    class Same(ast.KeyedProcessFunction):
        def open(self, ctx: ast.RuntimeContext) -> None:
            self.keyed = ctx.get_list_state(ast.ListStateDescriptor("s"))
            self.op_list = ctx.get_operator_list_state("s")
            self.op_union = ctx.get_union_list_state("u")
            self.keyed_u = ctx.get_state(ast.ValueStateDescriptor("u"))

        async def process_element(self, value: Any, ctx: Any) -> None:
            if value[1] is not None:
                await self.keyed.add(value[1])
                await self.keyed_u.update(value[1])
            ctx.emit((await (await self.keyed.get()).to_list(), await self.keyed_u.value()))

    path: str | None = None
    for n, kind in enumerate(["rocksdb", "heap", "rocksdb"]):
        fn = Same()
        backend = _backend_factory(kind, tmp_path)(str(n))
        async with ast.KeyedOperator(fn, key_selector=lambda r: r[0], backend=backend,
                                     restore_from=path) as op:
            assert await (await fn.op_list.get()).to_list() == [f"op{i}" for i in range(n)]
            assert await (await fn.op_union.get()).to_list() == [f"un{i}" for i in range(n)]
            await fn.op_list.add(f"op{n}")
            await fn.op_union.add(f"un{n}")
            await op.process(("k", n))
            await op.drain()
            assert op.outputs() == [(list(range(n + 1)), n)]
            path = await op.snapshot(str(tmp_path / "chk"), n)


@pytest.mark.timeout(60)
async def test_list_appends_after_merging_restore_keep_every_element(tmp_path: Any) -> None:
    # Each RocksDB instance numbers its list elements on its own; restoring them into one
    # instance must neither overwrite nor reorder anything, nor must later appends.
    keys = [f"k{i}" for i in range(12)]
    model: dict[str, list[int]] = {k: [] for k in keys}
    path: str | None = None
    for n, p in enumerate([3, 1, 2, 1]):
        config = ast.AsyncStateConfig(max_parallelism=MAX_P, batch_size=2)
        outs: dict[str, Any] = {}
        for index in range(p):
            backend = ast.RocksDBBackend(str(tmp_path / f"db-{n}-{index}"))
            async with ast.KeyedOperator(Ledger(), key_selector=second, backend=backend,
                                         config=config, parallelism=p, operator_index=index,
                                         restore_from=path) as op:
                for j in range(3 + n):
                    for k in keys:
                        if _owns(k, MAX_P, p, index):
                            await op.process(("w", k, 100 * n + j, "t"))
                path_n = await op.snapshot(str(tmp_path / "chk"), n)
                for k in keys:
                    if _owns(k, MAX_P, p, index):
                        await op.process(("r", k))
                await op.drain()
                outs.update({o[0]: o[2] for o in op.outputs()})
        for k in keys:
            model[k] += [100 * n + j for j in range(3 + n)]
        assert outs == model, n
        path = path_n


class Distinct(ast.KeyedProcessFunction):
    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))
        self.m = ctx.get_map_state(ast.MapStateDescriptor("m"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        key, write = value
        if write:
            await self.v.update(repr(key))
            for i, uk in enumerate([1, 1.0, True, 0, False, (1, 2), b"1", "1"]):
                await self.m.put(uk, i)
        entries = await (await self.m.entries()).to_list()
        ctx.emit((repr(key), await self.v.value(),
                  sorted((repr(k), type(k).__name__, v) for k, v in entries)))


async def test_keys_1_1p0_true_stay_distinct_through_rescale(tmp_path: Any) -> None:
    keys = [1, 1.0, True, 0, False, 0.0, (1, "a"), b"1", "1", None]
    max_p = 8
    expected = None
    path: str | None = None
    for n, (p, kind) in enumerate([(1, "heap"), (3, "rocksdb"), (2, "heap"), (1, "rocksdb")]):
        config = ast.AsyncStateConfig(max_parallelism=max_p)
        outs = []
        for index in range(p):
            backend = _backend_factory(kind, tmp_path)(f"{n}-{index}")
            async with ast.KeyedOperator(Distinct(), key_selector=lambda r: r[0],
                                         backend=backend, config=config, parallelism=p,
                                         operator_index=index, restore_from=path) as op:
                for k in keys:
                    if _owns(k, max_p, p, index):
                        await op.process((k, n == 0))
                path_n = await op.snapshot(str(tmp_path / "chk"), n)
                await op.drain()
                outs += op.outputs()
        outs.sort()
        assert len(outs) == len(keys)
        assert all(o[1] == o[0] for o in outs)  # each key kept its own value
        assert all(len(o[2]) == 8 for o in outs)  # 8 distinct map user keys
        if expected is None:
            expected = outs
        assert outs == expected
        path = path_n


async def test_operator_state_not_declared_in_a_run_survives_the_next_checkpoint(
        tmp_path: Any) -> None:
    p1, _ = await _op_phase(tmp_path, 1, None, 1, lambda i: ("offsets", "seen"),
                            lambda i: ["x", "y"])
    p2, _ = await _op_phase(tmp_path, 1, p1, 2, lambda i: (None, None), lambda i: [])
    _, got = await _op_phase(tmp_path, 1, p2, 3, lambda i: ("offsets", "seen"), lambda i: [])
    assert got == [{"offsets": ["x", "y"], "seen": ["x", "y"]}]


@pytest.mark.parametrize(("between", "after"), [(2, 1), (3, 2), (3, 4), (1, 3), (2, 2)])
async def test_undeclared_operator_state_is_carried_through_a_rescale_unchanged(
        tmp_path: Any, between: int, after: int) -> None:
    """Written at parallelism 2, restored at `between` by a run that declares neither state,
    then at `after`. The carrying run writes, per instance, the even-split share of "offsets"
    that declaring it would have given, and of the union state "seen" its old list when the
    parallelism is unchanged, else a contiguous slice of the old lists joined, so that the
    union keeps its elements and order."""
    old = [[f"{i}-{j}" for j in range(3 + 2 * i)] for i in range(2)]
    first, _ = await _op_phase(tmp_path / "a", 2, None, 1, lambda i: ("offsets", "seen"),
                               lambda i: old[i])
    carried, _ = await _op_phase(tmp_path / "b", between, first, 2, lambda i: (None, None),
                                 lambda i: [])

    def declare_both(i: int) -> tuple[str | None, str | None]:
        return ("offsets", "seen")

    _, got = await _op_phase(tmp_path / "c", after, carried, 3, declare_both, lambda i: [])
    joined = old[0] + old[1]
    carried_split = _split_model(old, between)
    if between == 2:
        carried_union = old
    else:  # 8 elements cut into `between` contiguous slices, the first ones one longer
        q, r = divmod(len(joined), between)
        bounds = [i * q + min(i, r) for i in range(between + 1)]
        carried_union = [joined[bounds[i]:bounds[i + 1]] for i in range(between)]
    assert sorted(x for part in carried_split for x in part) == sorted(joined)
    assert [x for part in carried_union for x in part] == joined
    assert [d["offsets"] for d in got] == _split_model(carried_split, after)
    assert [d["seen"] for d in got] == [joined] * after


def test_counter_sanity() -> None:
    # The models above are only as good as this helper.
    assert _split_model([["a", "b"], ["c"]], 2) == [["a", "b"], ["c"]]
    assert _split_model([["a", "b"], ["c"]], 3) == [["a"], ["b"], ["c"]]
    assert _split_model([], 2) == [[], []]
    assert Counter(x for p in _split_model([["a"] * 5, ["b"]], 4) for x in p) == Counter(
        {"a": 5, "b": 1})
