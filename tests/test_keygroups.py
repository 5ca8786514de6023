"""Key groups (asyncstate/keygroups.py): murmur3 of canonical bytes, the documented range split
and its inverse, validation, and the key groups an operator instance owns."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import tempfile

import mmh3
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from samples import (
    keys,
)
from shared_functions import (
    new_backend,
)

import asyncstate as ast
from asyncstate import serde
from asyncstate.keygroups import (
    KeyGroupRange,
    assign_to_key_group,
    compute_key_group_range_for_operator_index,
    compute_operator_index_for_key_group,
)


@pytest.mark.parametrize(("start", "end"), [(5, 4), (1, 0)])
def test_key_group_range_with_end_before_start_is_refused(start, end):
    with pytest.raises(ValueError, match=r"^end must be") as info:
        ast.KeyGroupRange(start, end)
    assert isinstance(info.value, ast.AsyncStateError)


@pytest.mark.parametrize("other", [True, False, 1.0, 2.5, "1", None, [1]])
def test_key_group_range_contains_only_ints(other):
    rng = ast.KeyGroupRange(0, 3)
    assert other not in rng
    assert 1 in rng


def spec_key_group(key, max_parallelism):
    """The spec: unsigned murmur3 x86 32 (seed 0) of msgpack(key, use_bin_type=True)."""
    return mmh3.hash(msgpack.packb(key, use_bin_type=True), 0, signed=False) % max_parallelism


def test_murmur3_reference_vectors():
    """Anchor the spec's hash, and the reference implementation written here from the
    algorithm, to published MurmurHash3_x86_32 (seed 0) vectors."""
    vectors = {b"": 0, b"hello": 0x248BFA47,
               b"The quick brown fox jumps over the lazy dog": 0x2E4FF723}
    for data, expected in vectors.items():
        assert mmh3.hash(data, 0, signed=False) == expected, data
        assert murmur3_x86_32(data) == expected, data


KNOWN_KEYS = [0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1, 1.0, 0.5, True, False, None, "", "a",
              "hello", "ünïcødé", b"", b"\x00\xff", (1, 2), [1, 2], ("a", (b"b", None)),
              [[1.5], "x"], 127, 128, 255, 256, 65536]


@pytest.mark.parametrize("max_parallelism", [1, 2, 7, 128, 4096, 32768])
def test_assign_to_key_group_matches_the_spec(max_parallelism):
    for key in KNOWN_KEYS:
        assert ast.assign_to_key_group(key, max_parallelism) == spec_key_group(
            key, max_parallelism), key


def test_assign_to_key_group_literal_values():
    """Literal values (the spec applied by hand once), so a change in msgpack or mmh3 that
    would silently move keys between key groups is caught."""
    assert msgpack.packb("a", use_bin_type=True) == b"\xa1a"
    assert msgpack.packb(1) == b"\x01"
    assert msgpack.packb(1.0) == b"\xcb?\xf0\x00\x00\x00\x00\x00\x00"
    assert msgpack.packb(True) == b"\xc3"
    for key in ("a", 1, 1.0, True, (1, 2)):
        h = mmh3.hash(msgpack.packb(key, use_bin_type=True), 0, signed=False)
        assert ast.assign_to_key_group(key, 2**15) == h % 2**15


def test_one_one_point_zero_and_true_are_hashed_apart():
    groups = {ast.assign_to_key_group(k, 32768) for k in (1, 1.0, True)}
    assert len(groups) == 3
    assert ast.assign_to_key_group((1, "a"), 128) == ast.assign_to_key_group([1, "a"], 128)


_keys = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner), max_leaves=6)


@given(key=_keys, max_parallelism=st.integers(1, 32768))
def test_property_assign_to_key_group_is_the_spec(key, max_parallelism):
    kg = ast.assign_to_key_group(key, max_parallelism)
    assert kg == spec_key_group(key, max_parallelism)
    assert 0 <= kg < max_parallelism


def test_key_groups_are_deterministic_across_processes():
    keys = ["alpha", "beta", b"gamma", ("delta", 4), 12345, 1.25]
    code = (f"import asyncstate as ast; "
            f"print([ast.assign_to_key_group(k, 32768) for k in {keys!r}])")
    results = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=60, check=True)
        results.add(proc.stdout.strip())
    assert results == {str([spec_key_group(k, 32768) for k in keys])}


@pytest.mark.parametrize("bad", [{"a": 1}, [1, {"a": 1}], {1}, object(), 2**64])
def test_assign_to_key_group_rejects_non_keys(bad):
    with pytest.raises(ast.SerializationError):
        ast.assign_to_key_group(bad, 128)


def _expected_range(max_parallelism, parallelism, index):
    q, r = divmod(max_parallelism, parallelism)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0) - 1


def _check_split(max_parallelism, parallelism, key_groups=None):
    covered = []
    for i in range(parallelism):
        rng = ast.compute_key_group_range_for_operator_index(max_parallelism, parallelism, i)
        assert isinstance(rng, ast.KeyGroupRange)
        assert (rng.start, rng.end) == _expected_range(max_parallelism, parallelism, i)
        assert len(rng) == rng.end - rng.start + 1
        if key_groups is None:
            covered.extend(rng)
            for kg in rng:
                assert ast.compute_operator_index_for_key_group(
                    max_parallelism, parallelism, kg) == i
    if key_groups is None:
        assert covered == list(range(max_parallelism))
    else:
        for kg in key_groups:
            i = ast.compute_operator_index_for_key_group(max_parallelism, parallelism, kg)
            rng = ast.compute_key_group_range_for_operator_index(max_parallelism, parallelism, i)
            assert rng.contains(kg) and kg in rng


def test_range_split_and_inverse_exhaustive_for_small_max_parallelism():
    for max_parallelism in range(1, 65):
        for parallelism in range(1, max_parallelism + 1):
            _check_split(max_parallelism, parallelism)


@pytest.mark.parametrize(("max_parallelism", "parallelism"), [
    (128, 3), (128, 5), (128, 127), (128, 128), (4096, 7), (32768, 1), (32768, 3),
    (32768, 1000), (32768, 32767), (32768, 32768), (1000, 999),
])
def test_range_split_and_inverse_for_large_combinations(max_parallelism, parallelism):
    if max_parallelism <= 5000:
        _check_split(max_parallelism, parallelism)
    else:
        # Ranges of every index; inverse at each range boundary and a stride of key groups.
        _check_split(max_parallelism, parallelism,
                     key_groups=sorted({0, max_parallelism - 1,
                                        *range(0, max_parallelism, 97)}))
        for i in range(parallelism):
            start, end = _expected_range(max_parallelism, parallelism, i)
            for kg in (start, end):
                assert ast.compute_operator_index_for_key_group(
                    max_parallelism, parallelism, kg) == i


@given(st.data())
def test_property_range_split_inverse(data):
    max_parallelism = data.draw(st.integers(1, 32768))
    parallelism = data.draw(st.integers(1, max_parallelism))
    index = data.draw(st.integers(0, parallelism - 1))
    rng = ast.compute_key_group_range_for_operator_index(max_parallelism, parallelism, index)
    assert (rng.start, rng.end) == _expected_range(max_parallelism, parallelism, index)
    for kg in {rng.start, rng.end, (rng.start + rng.end) // 2}:
        assert ast.compute_operator_index_for_key_group(max_parallelism, parallelism,
                                                        kg) == index


def test_first_r_ranges_are_one_larger():
    sizes = [len(ast.compute_key_group_range_for_operator_index(10, 4, i)) for i in range(4)]
    assert sizes == [3, 3, 2, 2]
    starts = [ast.compute_key_group_range_for_operator_index(10, 4, i).start for i in range(4)]
    assert starts == [0, 3, 6, 8]


def test_key_group_range():
    rng = ast.KeyGroupRange(3, 6)
    assert (rng.start, rng.end) == (3, 6)
    assert len(rng) == 4
    assert list(rng) == [3, 4, 5, 6]
    assert rng.contains(3) and rng.contains(6)
    assert not rng.contains(2) and not rng.contains(7)
    # contains() and `in` are one check: only ints are key groups.
    for other in (True, 4.0, 4.5, "4", None):
        assert not rng.contains(other) and other not in rng
    assert len(ast.KeyGroupRange(5, 5)) == 1


@pytest.mark.parametrize(("max_parallelism", "parallelism", "index"), [
    (128, 0, 0), (128, 129, 0), (128, -1, 0), (128, 2, 2), (128, 2, -1), (0, 1, 0),
    (32769, 1, 0), (128, True, 0), (128, 2, 1.0),
])
def test_range_split_validation(max_parallelism, parallelism, index):
    with pytest.raises(ValueError) as info:
        ast.compute_key_group_range_for_operator_index(max_parallelism, parallelism, index)
    assert isinstance(info.value, ast.AsyncStateError)


@pytest.mark.parametrize(("max_parallelism", "parallelism", "key_group"), [
    (128, 0, 0), (128, 129, 0), (128, 2, 128), (128, 2, -1), (0, 1, 0), (32769, 1, 0),
])
def test_operator_index_validation(max_parallelism, parallelism, key_group):
    with pytest.raises(ValueError) as info:
        ast.compute_operator_index_for_key_group(max_parallelism, parallelism, key_group)
    assert isinstance(info.value, ast.AsyncStateError)


SerializationError = ast.SerializationError


def _fmix(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h


def murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """Unsigned MurmurHash3 x86 32-bit, straight from the reference algorithm."""
    c1, c2 = 0xCC9E2D51, 0x1B873593
    h = seed & 0xFFFFFFFF
    n = len(data) // 4 * 4
    for i in range(0, n, 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (k * c1) & 0xFFFFFFFF
        k = ((k << 15) | (k >> 17)) & 0xFFFFFFFF
        k = (k * c2) & 0xFFFFFFFF
        h ^= k
        h = ((h << 13) | (h >> 19)) & 0xFFFFFFFF
        h = (h * 5 + 0xE6546B64) & 0xFFFFFFFF
    tail = data[n:]
    if tail:
        k = int.from_bytes(tail, "little")
        k = (k * c1) & 0xFFFFFFFF
        k = ((k << 15) | (k >> 17)) & 0xFFFFFFFF
        k = (k * c2) & 0xFFFFFFFF
        h ^= k
    return _fmix(h ^ len(data))


def documented_range(max_p: int, p: int, i: int) -> tuple[int, int]:
    """docs/api.md: q, r = divmod(max_p, p); range i starts at i*q + min(i, r) and holds
    q + (1 if i < r else 0) groups."""
    q, r = divmod(max_p, p)
    start = i * q + min(i, r)
    return start, start + q + (1 if i < r else 0) - 1


def flink_range(max_p: int, p: int, i: int) -> tuple[int, int]:
    """Flink's KeyGroupRangeAssignment.computeKeyGroupRangeForOperatorIndex."""
    return (i * max_p + p - 1) // p, ((i + 1) * max_p - 1) // p


@given(k=keys, max_p=st.integers(1, 32768))
def test_assign_to_key_group_is_murmur3_of_canonical_bytes(k, max_p):
    assert assign_to_key_group(k, max_p) == murmur3_x86_32(serde.canonical_key(k)) % max_p


@given(k=keys)
def test_list_and_tuple_keys_share_a_key_group(k):
    t = tuple(k) if type(k) in (list, tuple) else (k,)
    assert assign_to_key_group(list(t), 128) == assign_to_key_group(t, 128)


@settings(max_examples=300)
@given(data=st.data())
def test_ranges_match_the_documented_split_and_partition(data):
    max_p = data.draw(st.one_of(st.integers(1, 300), st.integers(1, 32768)))
    p = data.draw(st.integers(1, max_p))
    nxt = 0
    for i in range(p):
        r = compute_key_group_range_for_operator_index(max_p, p, i)
        assert type(r) is KeyGroupRange
        assert (r.start, r.end) == documented_range(max_p, p, i)
        assert r.start == nxt and len(r) >= 1
        nxt = r.end + 1
        # sizes differ by at most one
        assert len(r) in (max_p // p, -(-max_p // p))
    assert nxt == max_p


@settings(max_examples=300)
@given(data=st.data())
def test_operator_index_of_every_key_group_lies_in_its_range(data):
    max_p = data.draw(st.integers(1, 32768))
    p = data.draw(st.integers(1, max_p))
    groups = (range(max_p) if max_p <= 2000
              else [*data.draw(st.lists(st.integers(0, max_p - 1), min_size=1, max_size=50)),
                    0, max_p - 1])
    for g in groups:
        i = compute_operator_index_for_key_group(max_p, p, g)
        assert 0 <= i < p
        r = compute_key_group_range_for_operator_index(max_p, p, i)
        assert g in r and r.contains(g)


def test_exhaustive_small_split_is_consistent_both_ways():
    for max_p in range(1, 130):
        for p in range(1, max_p + 1):
            owner = []
            for i in range(p):
                owner.extend([i] * len(compute_key_group_range_for_operator_index(max_p, p, i)))
            assert owner == [compute_operator_index_for_key_group(max_p, p, g)
                             for g in range(max_p)]


def test_split_is_the_documented_one_not_current_flinks():
    """/work/shared/design/API.md: 'this is not current Flink's formula'. Both partition
    [0, max_parallelism); they agree when p divides max_p and differ otherwise."""
    assert [documented_range(10, 4, i) for i in range(4)] == [(0, 2), (3, 5), (6, 7), (8, 9)]
    assert [flink_range(10, 4, i) for i in range(4)] == [(0, 2), (3, 4), (5, 7), (8, 9)]
    got = [compute_key_group_range_for_operator_index(10, 4, i) for i in range(4)]
    assert [(r.start, r.end) for r in got] == [documented_range(10, 4, i) for i in range(4)]
    for max_p, p in [(128, 4), (128, 128), (32768, 8), (6, 3)]:
        assert ([flink_range(max_p, p, i) for i in range(p)]
                == [(r.start, r.end) for r in (compute_key_group_range_for_operator_index(
                    max_p, p, i) for i in range(p))])


def test_flink_formula_reference_partitions_too():
    for max_p in range(1, 80):
        for p in range(1, max_p + 1):
            spans = [flink_range(max_p, p, i) for i in range(p)]
            assert spans[0][0] == 0 and spans[-1][1] == max_p - 1
            assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(spans))
            for g in range(max_p):
                i = g * p // max_p  # Flink's computeOperatorIndexForKeyGroup
                assert spans[i][0] <= g <= spans[i][1]


BAD_KG_ARGS = [
    # (max_parallelism, parallelism, index, option named)
    pytest.param(0, 1, 0, "max_parallelism", id="max_p-0"),
    pytest.param(-1, 1, 0, "max_parallelism", id="max_p-neg"),
    pytest.param(32769, 1, 0, "max_parallelism", id="max_p-too-big"),
    pytest.param(True, 1, 0, "max_parallelism", id="max_p-bool"),
    pytest.param(128.0, 1, 0, "max_parallelism", id="max_p-float"),
    pytest.param("128", 1, 0, "max_parallelism", id="max_p-str"),
    pytest.param(128, 0, 0, "parallelism", id="p-0"),
    pytest.param(128, -2, 0, "parallelism", id="p-neg"),
    pytest.param(128, 129, 0, "parallelism", id="p-above-max"),
    pytest.param(128, True, 0, "parallelism", id="p-bool"),
    pytest.param(128, 2.0, 0, "parallelism", id="p-float"),
    pytest.param(128, 4, -1, "index", id="index-neg"),
    pytest.param(128, 4, 4, "index", id="index-too-big"),
    pytest.param(128, 4, False, "index", id="index-bool"),
    pytest.param(128, 4, 1.0, "index", id="index-float"),
]


@pytest.mark.parametrize(("max_p", "p", "index", "option"), BAD_KG_ARGS)
def test_invalid_range_arguments_raise_config_error_naming_the_argument(max_p, p, index, option):
    with pytest.raises(ast.ConfigError) as info:
        compute_key_group_range_for_operator_index(max_p, p, index)
    assert isinstance(info.value, ValueError)
    assert option in info.value.option and option in str(info.value)
    assert info.value.value is (max_p if option == "max_parallelism"
                                else p if option == "parallelism" else index)


@pytest.mark.parametrize(("max_p", "p", "kg", "option"), [
    pytest.param(0, 1, 0, "max_parallelism", id="max_p-0"),
    pytest.param(32769, 1, 0, "max_parallelism", id="max_p-too-big"),
    pytest.param(False, 1, 0, "max_parallelism", id="max_p-bool"),
    pytest.param(128, 129, 0, "parallelism", id="p-above-max"),
    pytest.param(128, 1.0, 0, "parallelism", id="p-float"),
    pytest.param(128, 4, -1, "key_group", id="kg-neg"),
    pytest.param(128, 4, 128, "key_group", id="kg-too-big"),
    pytest.param(128, 4, True, "key_group", id="kg-bool"),
    pytest.param(128, 4, 3.0, "key_group", id="kg-float"),
])
def test_invalid_operator_index_arguments_raise_config_error(max_p, p, kg, option):
    with pytest.raises(ast.ConfigError) as info:
        compute_operator_index_for_key_group(max_p, p, kg)
    assert info.value.option == option and option in str(info.value)


@pytest.mark.parametrize("max_p", [0, -5, 32769, True, 2.0, None])
def test_assign_to_key_group_validates_max_parallelism(max_p):
    with pytest.raises(ast.ConfigError) as info:
        assign_to_key_group("k", max_p)
    assert info.value.option == "max_parallelism"


def test_assign_to_key_group_refuses_bad_keys_with_serialization_error():
    with pytest.raises(SerializationError):
        assign_to_key_group({"a": 1}, 128)
    with pytest.raises(SerializationError):
        assign_to_key_group(2**64, 128)


def test_extreme_max_parallelism_values():
    assert compute_key_group_range_for_operator_index(1, 1, 0) == KeyGroupRange(0, 0)
    assert compute_key_group_range_for_operator_index(32768, 1, 0) == KeyGroupRange(0, 32767)
    assert compute_key_group_range_for_operator_index(32768, 32768, 32767) == \
        KeyGroupRange(32767, 32767)
    assert compute_operator_index_for_key_group(32768, 32768, 12345) == 12345
    assert compute_operator_index_for_key_group(32768, 1, 32767) == 0


V = ast.ValueStateDescriptor


@pytest.mark.parametrize("backend_name", ["heap", "rocksdb"])
def test_operator_owns_exactly_the_key_groups_of_its_range(backend_name):
    """KeyedOperator(parallelism=4, operator_index=i) admits exactly the keys whose group
    lies in the documented range i, and list/tuple spellings of a key agree."""
    max_p, p = 16, 4
    ks = [i for i in range(200)] + [(i, "t") for i in range(50)] + [str(i) for i in range(50)]

    class Count(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.c = ctx.get_state(V("c"))

        async def process_element(self, record, ctx):
            n = (await self.c.value() or 0) + 1
            await self.c.update(n)
            ctx.emit((serde.canonical_key(ctx.current_key), n))

    async def main(index, directory):
        admitted, refused = [], []
        async with ast.KeyedOperator(Count(), key_selector=lambda r: r,
                                     backend=new_backend(backend_name, directory),
                                     config=ast.AsyncStateConfig(max_parallelism=max_p),
                                     parallelism=p, operator_index=index) as op:
            for k in ks + [list(k) for k in ks if type(k) is tuple]:
                try:
                    await op.process(k)
                    admitted.append(k)
                except ast.KeyGroupError as exc:
                    refused.append((k, exc.key_group))
            await op.drain()
            return admitted, refused, op.outputs(), op.key_group_range

    for index in range(p):
        with tempfile.TemporaryDirectory(prefix="asyncstate-adv-") as d:
            admitted, refused, outputs, kg_range = asyncio.run(main(index, d))
        assert (kg_range.start, kg_range.end) == documented_range(max_p, p, index)
        assert admitted and refused
        assert all(assign_to_key_group(k, max_p) in kg_range for k in admitted)
        assert all(kg == assign_to_key_group(k, max_p) and kg not in kg_range
                   for k, kg in refused)
        counts = dict(outputs)  # the tuple key and its list spelling count as one key
        for k in admitted:
            if type(k) is tuple:
                assert counts[serde.canonical_key(k)] == 2
