"""Adversarial properties of serde (key identity, value stored forms, errors, ordered int64),
key groups (the documented split, murmur3, validation) and StateIterator (every way of
consuming, chunk sizes, backends).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import math
import os
import struct
import subprocess
import sys
import tempfile
import textwrap
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from shared_functions import slow_examples

import asyncstate as ast
from asyncstate import serde
from asyncstate.keygroups import (
    KeyGroupRange,
    assign_to_key_group,
    compute_key_group_range_for_operator_index,
    compute_operator_index_for_key_group,
)

SerializationError = ast.SerializationError

# ===========================================================================================
# Independent references
# ===========================================================================================


def _float_bits(x: float) -> bytes:
    return struct.pack(">d", x)


def same_key(a: Any, b: Any) -> bool:
    """The docs' key identity, written without msgpack: lists and tuples are one kind,
    every scalar type is its own kind (1, 1.0, True differ), floats by their bits."""
    seq = (list, tuple)
    if type(a) in seq or type(b) in seq:
        return (type(a) in seq and type(b) in seq and len(a) == len(b)
                and all(same_key(x, y) for x, y in zip(a, b, strict=True)))
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return _float_bits(a) == _float_bits(b)
    return bool(a == b)


def as_read_back(v: Any) -> Any:
    """What a value reads back as: tuples become lists, except inside dict keys."""
    if type(v) in (list, tuple):
        return [as_read_back(x) for x in v]
    if type(v) is dict:
        return {k: as_read_back(x) for k, x in v.items()}
    return v


def strict_eq(a: Any, b: Any) -> bool:
    """Equality that tells 1, 1.0 and True apart, lists from tuples, and compares floats
    (NaN included) by bits; dicts compare their items in order (msgpack keeps it)."""
    if type(a) is not type(b):
        return False
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(strict_eq(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is dict:
        return len(a) == len(b) and all(
            strict_eq(ka, kb) and strict_eq(va, vb)
            for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True))
    if type(a) is float:
        return _float_bits(a) == _float_bits(b)
    return bool(a == b)


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


# ===========================================================================================
# Strategies
# ===========================================================================================

_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=6)
# Values that collide under Python equality but are distinct keys.
_tricky = st.sampled_from([0, 1, -1, 1.0, 0.0, -0.0, True, False, None, "1", b"1", "", b"",
                           2**63, 2**64 - 1, -(2**63), float("inf"), float("nan")])
_key_scalars = st.one_of(
    _tricky, st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True), _text, st.binary(max_size=6))
keys = st.recursive(
    _key_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.lists(inner, max_size=4).map(tuple)),
    max_leaves=10)
_hashable_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
                              st.floats(allow_nan=False), _text, st.binary(max_size=6))
dict_keys = st.recursive(_hashable_scalars, lambda inner: st.lists(inner, max_size=3).map(tuple),
                         max_leaves=5)
values = st.recursive(
    _key_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(dict_keys, inner, max_size=4)),
    max_leaves=15)


# ===========================================================================================
# serde: key identity
# ===========================================================================================


@given(a=keys, b=keys)
def test_canonical_bytes_equal_iff_same_key(a, b):
    assert (serde.canonical_key(a) == serde.canonical_key(b)) == same_key(a, b)


@given(data=st.data(), k=keys)
def test_canonical_bytes_ignore_list_vs_tuple_at_every_depth(data, k):
    def flip(x):
        if type(x) in (list, tuple):
            items = [flip(y) for y in x]
            return tuple(items) if data.draw(st.booleans()) else items
        return x

    assert serde.canonical_key(flip(k)) == serde.canonical_key(k)


@pytest.mark.parametrize(("a", "b"), [
    (1, 1.0), (1, True), (1.0, True), (0, False), (0.0, -0.0), (0, None), ("a", b"a"),
    ([1], [1.0]), ([1], [True]), ((0,), (False,)), ([[1]], [[1.0]]), ([], [[]]), ([], None),
    ([1, 2], [1, [2]]), (2**63, -(2**63)),
])
def test_keys_equal_in_python_are_distinct_keys(a, b):
    assert serde.canonical_key(a) != serde.canonical_key(b)


@given(k=keys)
def test_decode_key_round_trip_turns_tuples_into_lists(k):
    back = serde.decode_key(serde.canonical_key(k))
    assert strict_eq(back, as_read_back(k))
    assert serde.canonical_key(back) == serde.canonical_key(k)


@given(ks=st.lists(keys, min_size=1, max_size=5))
def test_canonical_bytes_are_self_delimiting(ks):
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(b"".join(serde.canonical_key(k) for k in ks))
    got = list(unpacker)
    assert len(got) == len(ks)
    assert all(strict_eq(g, as_read_back(k)) for g, k in zip(got, ks, strict=True))


@given(k=keys, max_p=st.integers(1, 32768))
def test_assign_to_key_group_is_murmur3_of_canonical_bytes(k, max_p):
    assert assign_to_key_group(k, max_p) == murmur3_x86_32(serde.canonical_key(k)) % max_p


def test_murmur3_reference_vectors():
    assert murmur3_x86_32(b"") == 0
    assert murmur3_x86_32(b"hello") == 0x248BFA47
    assert murmur3_x86_32(b"The quick brown fox jumps over the lazy dog") == 0x2E4FF723


@given(k=keys)
def test_list_and_tuple_keys_share_a_key_group(k):
    t = tuple(k) if type(k) in (list, tuple) else (k,)
    assert assign_to_key_group(list(t), 128) == assign_to_key_group(t, 128)


# ===========================================================================================
# serde: key errors
# ===========================================================================================


class Color(enum.IntEnum):
    RED = 1


class Weight(float):
    pass


class Name(str):
    pass


class Pair(tuple):
    pass


Point = collections.namedtuple("Point", "x y")


def _deep_list(depth: int, leaf: Any = None) -> Any:
    v: Any = [] if leaf is None else leaf
    for _ in range(depth):
        v = [v]
    return v


def _depth_of_deep_list(v: Any) -> int:
    """The depth `_deep_list(depth)` was built with (no recursion: == would overflow)."""
    depth = 0
    while type(v) is list and v:
        assert len(v) == 1
        v, depth = v[0], depth + 1
    assert v == []
    return depth


BAD_KEYS = [
    pytest.param(2**64, ("int",), id="int-2**64"),
    pytest.param(-(2**63) - 1, ("int",), id="int-below"),
    pytest.param([1, (2, [2**64])], ("int",), id="nested-int-2**64"),
    pytest.param(((-(2**63) - 1,),), ("int",), id="nested-int-below"),
    pytest.param("\udc80", ("str",), id="lone-surrogate"),
    pytest.param([("ok", "\ud800x")], ("str", "list"), id="nested-surrogate"),
    pytest.param(bytearray(b"x"), ("bytearray",), id="bytearray"),
    pytest.param(memoryview(b"x"), ("memoryview",), id="memoryview"),
    pytest.param(Color.RED, ("Color",), id="IntEnum"),
    pytest.param([1, Color.RED], ("Color",), id="nested-IntEnum"),
    pytest.param(Point(1, 2), ("Point",), id="namedtuple"),
    pytest.param(Name("x"), ("Name",), id="str-subclass"),
    pytest.param(Pair((1,)), ("Pair",), id="tuple-subclass"),
    pytest.param(Weight(1.5), ("Weight",), id="float-subclass"),
    pytest.param({"a": 1}, ("dict",), id="dict"),
    pytest.param([[{}]], ("dict",), id="nested-dict"),
    pytest.param({1}, ("set",), id="set"),
    pytest.param(object(), ("object",), id="object"),
    pytest.param(_deep_list(5000), ("list",), id="too-deep"),
]


@pytest.mark.parametrize(("bad", "type_names"), BAD_KEYS)
@pytest.mark.parametrize("what", ["key", "namespace", "map key"])
def test_bad_keys_raise_serialization_error_naming_state_and_type(bad, type_names, what):
    with pytest.raises(SerializationError) as info:
        serde.canonical_key(bad, what, "my_state")
    err = info.value
    assert err.state_name == "my_state"
    assert err.type_name in type_names
    assert "my_state" in str(err) and what in str(err)
    assert err.type_name in str(err)


@given(depth=st.integers(0, 6), wrap=st.lists(st.booleans(), min_size=6, max_size=6),
       bad=st.one_of(st.integers(2**64, 2**70), st.integers(-(2**70), -(2**63) - 1)))
def test_out_of_range_int_at_any_depth_is_refused_in_keys(depth, wrap, bad):
    k: Any = bad
    for i in range(depth):
        k = ("pad", k) if wrap[i] else [k, 0]
    with pytest.raises(SerializationError) as info:
        serde.canonical_key(k, "map key", "s")
    assert info.value.type_name == "int" and info.value.state_name == "s"


@given(depth=st.integers(0, 6), prefix=_text,
       surrogate=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF))
def test_surrogate_at_any_depth_is_refused_in_keys_and_values(depth, prefix, surrogate):
    k: Any = prefix + surrogate
    for _ in range(depth):
        k = [k]
    with pytest.raises(SerializationError) as info:
        serde.canonical_key(k, "key", "s")
    assert info.value.state_name == "s"
    with pytest.raises(SerializationError) as info:
        serde.to_stored(k, "s")
    assert info.value.state_name == "s"
    with pytest.raises(SerializationError):
        serde.to_stored({"y": k}, "s")  # in a dict value
    with pytest.raises(SerializationError):
        serde.to_stored({(1, prefix + surrogate): 1}, "s")  # in a tuple dict key
    with pytest.raises(SerializationError):
        serde.to_stored({"a": {prefix + surrogate: 1}}, "s")  # in a nested dict key


def test_nan_and_negative_zero_are_usable_keys_identified_by_bits():
    """Documented: keys are compared by canonical bytes, so NaN is a key equal to itself
    (same bits) and -0.0 is not 0.0."""
    nan = float("nan")
    assert serde.canonical_key(nan) == serde.canonical_key(float("nan"))
    assert serde.canonical_key(-0.0) != serde.canonical_key(0.0)
    assert math.isnan(serde.decode_key(serde.canonical_key([nan]))[0])


# ===========================================================================================
# serde: values
# ===========================================================================================


@given(v=values)
def test_value_stored_form_round_trips_tuples_as_lists(v):
    stored = serde.to_stored(v, "s")
    assert strict_eq(serde.from_stored(stored), as_read_back(v))
    # The byte form (RocksDB's) decodes to the same.
    assert strict_eq(serde.decode_value(serde.stored_to_bytes(stored)), as_read_back(v))


@pytest.mark.parametrize("v", [
    {(1, 2): "a", (3, (4, 5)): ["x", (6,)]},
    {1: {2: {(3,): (4,)}}},
    [{(1,): [(2,)]}, ((3,),)],
    {b"k": 1, None: 2, 1.5: 3, True: 4, -(2**63): 5, 2**64 - 1: 6},
    {("a", b"b", None, 1.0, False): {"n": [1, (2, 3)]}},
], ids=["tuple-keys", "nested-int-keys", "list-of-tuple-keyed", "scalar-keys", "mixed"])
def test_values_with_non_str_dict_keys_round_trip(v):
    assert strict_eq(serde.from_stored(serde.to_stored(v, "s")), as_read_back(v))


@given(v=st.lists(values, min_size=1, max_size=3), extra=values)
def test_value_copies_are_independent_of_later_mutation(v, extra):
    stored = serde.to_stored(v, "s")
    expected = as_read_back(v)
    first = serde.from_stored(stored)
    v.append(extra)
    v[0] = "mutated"
    first.append("mutated too")
    assert strict_eq(serde.from_stored(stored), expected)


@pytest.mark.parametrize(("v", "back"), [
    (Color.RED, 1), ([Color.RED], [1]), (Point(1, 2), [1, 2]), (Name("x"), "x"),
    (Pair((1,)), [1]), (Weight(1.5), 1.5), (bytearray(b"ab"), b"ab"),
    (memoryview(b"ab"), b"ab"), (float("nan"), float("nan")), (-0.0, -0.0),
    ({Color.RED: Point(1, 2)}, {1: [1, 2]}),
], ids=["IntEnum", "nested-IntEnum", "namedtuple", "str-subclass", "tuple-subclass",
        "float-subclass", "bytearray", "memoryview", "nan", "neg-zero", "dict-of-subclasses"])
def test_values_msgpack_encodes_are_accepted_as_their_base_type(v, back):
    """Documented: values are anything msgpack encodes; builtin subclasses pack as their
    base type."""
    assert strict_eq(serde.from_stored(serde.to_stored(v, "s")), back)


BAD_VALUES = [
    pytest.param(2**64, "int", id="int-2**64"),
    pytest.param(-(2**63) - 1, "int", id="int-below"),
    pytest.param([1, [2, [2**64]]], "list", id="nested-int"),
    pytest.param({"a": {"b": -(2**63) - 1}}, "dict", id="int-in-nested-dict-value"),
    pytest.param({2**64: 1}, "dict", id="int-as-dict-key"),
    pytest.param({"a": {(1, 2**64): 1}}, "dict", id="int-in-nested-tuple-dict-key"),
    pytest.param("\udc80", "str", id="surrogate"),
    pytest.param(["\ud800"], "list", id="nested-surrogate"),
    pytest.param({"\udc80": 1}, "dict", id="surrogate-dict-key"),
    pytest.param({"a": {"\udc80x": 1}}, "dict", id="surrogate-nested-dict-key"),
    pytest.param({1, 2}, "set", id="set"),
    pytest.param([object()], "list", id="nested-object"),
    pytest.param({frozenset(): 1}, "dict", id="frozenset-key"),
    pytest.param(_deep_list(5000), "list", id="too-deep"),
]


@pytest.mark.parametrize(("bad", "type_name"), BAD_VALUES)
def test_bad_values_raise_serialization_error_naming_state_and_type(bad, type_name):
    with pytest.raises(SerializationError) as info:
        serde.to_stored(bad, "my_state")
    err = info.value
    assert (err.state_name, err.type_name) == ("my_state", type_name)
    assert "my_state" in str(err) and type_name in str(err)


@pytest.mark.parametrize("leaf", [None, {}], ids=["empty-list", "empty-dict"])
def test_value_or_key_one_level_deeper_than_msgpack_reads_is_refused_at_the_write(leaf):
    """msgpack packs an empty container at nesting level 1025 (its packer checks the limit
    only when it descends into items) but reads at most 1024 levels. Such a value or key is
    refused at the call that writes it, naming the state, so it cannot poison the state."""
    v = _deep_list(1024, leaf)  # 1025 nested containers, the innermost empty
    with pytest.raises(SerializationError, match=r"^value of state 's' cannot be encoded "
                       r"with msgpack \(list\): it is nested more than 1024 levels") as info:
        serde.to_stored(v, "s")
    assert (info.value.state_name, info.value.type_name) == ("s", "list")
    if leaf is None:  # dicts cannot be keys
        with pytest.raises(SerializationError, match=r"^map key of state 's' cannot be "
                           r"encoded \(list\): it is nested more than 1024 levels"):
            serde.canonical_key(v, "map key", "s")


def test_stored_bytes_nested_too_deep_are_a_serialization_error_on_read():
    """Bytes written by another program (or damaged) that nest too deep: reading them back
    is a SerializationError, never msgpack's own error, for values and keys alike."""
    data = b"\x91" * 1024 + b"\x90"
    with pytest.raises(SerializationError, match=r"nested more than 1024 levels"):
        serde.decode_value(data)
    with pytest.raises(SerializationError, match=r"nested more than 1024 levels"):
        serde.decode_key(data)


@pytest.mark.parametrize("value", [
    pytest.param([b"\x91" * 5000], id="bin-of-header-bytes"),
    pytest.param(["\x1d" * 3000, list(range(2000))], id="many-small-arrays-bytes"),
    pytest.param([[i] for i in range(3000)], id="3000-shallow-arrays"),
    pytest.param({i: {} for i in range(3000)}, id="3000-empty-maps"),
])
def test_large_shallow_values_with_many_container_bytes_are_accepted(value):
    """The depth check decodes only encodings holding more than 1024 container-header-like
    bytes; those that are shallow pass it and read back unchanged."""
    assert serde.from_stored(serde.to_stored(value, "s")) == value


def test_deepest_key_accepted_decodes_or_is_refused_consistently_at_1023():
    """Depth 1023 (1024 arrays) is the deepest key/value that msgpack reads back."""
    v = _deep_list(1023)
    assert _depth_of_deep_list(serde.from_stored(serde.to_stored(v, "s"))) == 1023
    assert _depth_of_deep_list(serde.decode_key(serde.canonical_key(v))) == 1023


_PURE_DEEP_SCRIPT = textwrap.dedent("""
    from asyncstate import serde
    v = {(1,): 1}
    for _ in range(600):
        v = [v]
    assert serde.from_stored(serde.to_stored(v, "s")) == v
    print("ok")
""")


def test_pure_python_reads_back_deep_value_with_tuple_dict_key():
    env = dict(os.environ, ASYNCSTATE_PURE_PYTHON="1")
    proc = subprocess.run([sys.executable, "-c", _PURE_DEEP_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ===========================================================================================
# serde: ordered int64
# ===========================================================================================

_i64 = st.integers(-(2**63), 2**63 - 1)


@given(a=_i64, b=_i64)
def test_ordered_i64_preserves_order(a, b):
    ea, eb = serde.encode_ordered_i64(a), serde.encode_ordered_i64(b)
    assert len(ea) == len(eb) == 8
    assert (ea < eb) == (a < b) and (ea == eb) == (a == b)
    assert serde.decode_ordered_i64(ea) == a


def test_ordered_i64_extremes_and_sign_boundary():
    order = [-(2**63), -(2**63) + 1, -(2**32), -1, 0, 1, 2**32, 2**63 - 2, 2**63 - 1]
    enc = [serde.encode_ordered_i64(x) for x in order]
    assert enc == sorted(enc) and len(set(enc)) == len(enc)
    assert enc[0] == b"\x00" * 8 and enc[-1] == b"\xff" * 8
    assert [serde.decode_ordered_i64(e) for e in enc] == order


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1, 2**64, -(2**64), 10**30])
def test_ordered_i64_rejects_out_of_range(bad):
    with pytest.raises(SerializationError) as info:
        serde.encode_ordered_i64(bad)
    assert info.value.type_name == "int"


# ===========================================================================================
# key groups
# ===========================================================================================


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


# ===========================================================================================
# StateIterator through KeyedOperator
# ===========================================================================================

L = ast.ListStateDescriptor
M = ast.MapStateDescriptor
V = ast.ValueStateDescriptor

BACKENDS = ["heap", "rocksdb", "remote0-rocksdb"]
CHUNKS = [1, 2, 3, 1000]


def make_backend(name: str, directory: str) -> Any:
    if name == "heap":
        return ast.HeapBackend()
    if name == "remote0-heap":
        return ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0)
    db = ast.RocksDBBackend(os.path.join(directory, "db"))
    if name == "rocksdb":
        return db
    return ast.SimulatedRemoteBackend(db, latency_ms=0)


class Fn(ast.KeyedProcessFunction):
    """Records are ``(key, step)``; ``step(self, ctx)`` is awaited when it is a coroutine
    function's result, else returned (plain-def style)."""

    def open(self, ctx):
        self.l = ctx.get_list_state(L("l"))
        self.m = ctx.get_map_state(M("m"))
        self.v = ctx.get_state(V("v"))
        self.saved: list[Any] = []

    def process_element(self, record, ctx):
        return record[1](self, ctx)


def run_records(backend_name: str, chunk: int, records: list[Any]) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="asyncstate-adv-") as d:
        return ast.run(Fn(), records, key_selector=lambda r: r[0],
                       backend=make_backend(backend_name, d),
                       config=ast.AsyncStateConfig(iterator_chunk_size=chunk))


async def consume_all_ways(it: ast.StateIterator, s: Fn, tag: str) -> dict[str, Any]:
    """Every way of consuming one iterator; each result is the items seen, in order."""
    out: dict[str, Any] = {"is_empty": it.is_empty()}
    out["to_list"] = await it.to_list()
    out["to_list_again"] = await it.to_list()
    seen: list[Any] = []
    out["async_for"] = [x async for x in it]
    out["on_next_plain"] = await it.on_next(lambda x: (seen.append(x), (tag, x))[1])
    out["on_next_calls"] = list(seen)
    out["on_next_completed"] = await it.on_next(lambda x: ast.completed_future((tag, x)))
    out["on_next_state_future"] = await it.on_next(
        lambda x: s.v.value().then_apply(lambda _v: (tag, x)))
    flags = iter(range(10**9))
    out["on_next_some_none"] = await it.on_next(
        lambda x: (tag, x) if next(flags) % 2 else None)
    return out


def check_ways(out: dict[str, Any], expected: list[Any], tag: str, ordered: bool) -> None:
    def canon(xs):
        return xs if ordered else sorted(xs, key=lambda e: serde.canonical_key(
            e[1] if type(e) is tuple and len(e) == 2 and e[0] == tag else e))

    assert out["is_empty"] == (not expected)
    for way in ("to_list", "to_list_again", "async_for", "on_next_calls"):
        assert len(out[way]) == len(expected), way
        assert all(strict_eq(a, b)
                   for a, b in zip(canon(out[way]), canon(expected), strict=True)), way
    # The three ways that wrap each item see the same order as to_list.
    for way in ("on_next_plain", "on_next_completed", "on_next_state_future"):
        assert [x for _t, x in out[way]] == out["to_list"] or all(
            strict_eq(a, b) for (_t, a), b in zip(out[way], out["to_list"], strict=True)), way
        assert len(out[way]) == len(expected), way
    assert [x for _t, x in out["on_next_some_none"]] == out["to_list"][1::2] or all(
        strict_eq(a, b)
        for (_t, a), b in zip(out["on_next_some_none"], out["to_list"][1::2], strict=True))


_list_items = st.lists(st.one_of(st.integers(-5, 5), _text, st.lists(st.integers(0, 3),
                                                                       max_size=2)), max_size=12)
_map_ops = st.lists(st.tuples(keys, st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1), _text)),
                    max_size=12)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("backend_name", BACKENDS)
@settings(max_examples=slow_examples(12), suppress_health_check=[HealthCheck.too_slow])
@given(items=_list_items, ops=_map_ops)
def test_every_way_of_consuming_sees_every_item_once(backend_name, chunk, items, ops):
    model: dict[bytes, tuple[Any, Any]] = {}
    for k, v in ops:
        ck = serde.canonical_key(k)
        if v is None:
            model.pop(ck, None)
        else:
            model[ck] = (serde.decode_key(ck), v)

    async def step(s, ctx):
        await s.v.update(7)
        await s.l.update(items)
        for k, v in ops:
            s.m.put(k, v)  # not awaited: they apply in issue order
        ctx.emit(("list", await consume_all_ways(await s.l.get(), s, "list")))
        ctx.emit(("entries", await consume_all_ways(await s.m.entries(), s, "entries")))
        ctx.emit(("keys", await consume_all_ways(await s.m.keys(), s, "keys")))
        ctx.emit(("values", await consume_all_ways(await s.m.values(), s, "values")))
        ctx.emit(("map_empty", await s.m.is_empty()))

    out = dict(run_records(backend_name, chunk, [("k", step)]))
    check_ways(out["list"], [as_read_back(x) for x in items], "list", ordered=True)
    exp_entries = [(k, v) for k, v in model.values()]
    check_ways(out["entries"], exp_entries, "entries", ordered=False)
    assert all(type(e) is tuple for e in out["entries"]["to_list"])
    check_ways(out["keys"], [k for k, _v in model.values()], "keys", ordered=False)
    assert sorted(map(repr, out["values"]["to_list"])) == sorted(
        repr(v) for _k, v in model.values())
    assert out["map_empty"] == (not model)
    # keys()/values() walk the same order as entries()
    ents = out["entries"]["to_list"]
    assert all(same_key(a, b) for a, (b, _v) in zip(out["keys"]["to_list"], ents, strict=True))


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_callback_style_chain_sees_every_item_once(backend_name, chunk):
    n = 25

    def step(s, ctx):
        s.v.update(1000)
        s.l.add_all(range(n))
        calls: list[int] = []

        def fn(x):
            calls.append(x)
            if x % 3 == 0:
                return s.v.value().then_apply(lambda base: base + x)
            if x % 3 == 1:
                return None
            return ast.completed_future(-x)

        return (s.l.get()
                .then_compose(lambda it: it.on_next(fn).then_combine(
                    it.to_list(), lambda a, b: (a, b)))
                .then_accept(lambda ab: ctx.emit((ab[0], ab[1], calls))))

    (got, all_items, calls), = run_records(backend_name, chunk, [("k", step)])
    assert calls == list(range(n)) and all_items == list(range(n))
    assert got == [1000 + x if x % 3 == 0 else -x for x in range(n) if x % 3 != 1]


class Boom(Exception):
    pass


@pytest.mark.parametrize("fail_at", [0, 1, 2, 4])
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_on_next_callback_failure_surfaces_the_original_exception(backend_name, chunk, fail_at):
    boom = Boom("item", fail_at)

    async def step(s, ctx):
        await s.l.update(list(range(5)))
        calls: list[int] = []

        def fn(x):
            calls.append(x)
            if x == fail_at:
                raise boom
            return x

        it = await s.l.get()
        try:
            await it.on_next(fn)
        except Boom as exc:
            ctx.emit((exc is boom, list(calls)))
        # the iterator is still usable afterwards
        ctx.emit(await it.to_list())

    out = run_records(backend_name, chunk, [("k", step)])
    assert out == [(True, list(range(fail_at + 1))), list(range(5))]


@pytest.mark.parametrize("chunk", [1, 2, 1000])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_on_next_callback_failure_in_plain_chain_fails_run_with_it(backend_name, chunk):
    boom = Boom("chain")

    def step(s, ctx):
        s.l.update(list(range(5)))

        def fn(x):
            if x == 3:
                raise boom
            return x

        return s.l.get().then_compose(lambda it: it.on_next(fn)).then_accept(ctx.emit)

    with pytest.raises(Boom) as info:
        run_records(backend_name, chunk, [("k", step)])
    assert info.value is boom


@pytest.mark.parametrize("chunk", [1, 3, 1000])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_on_next_returning_a_failed_future_fails_with_its_exception(backend_name, chunk):
    boom = Boom("future")

    async def step(s, ctx):
        await s.l.update(list(range(6)))
        it = await s.l.get()
        def fail_on_4(y):
            if y == 4:
                raise boom
            return y

        caught: Any = None
        try:
            await it.on_next(lambda x: ast.completed_future(x).then_apply(fail_on_4))
        except Boom as exc:
            caught = exc
        ctx.emit(caught is boom)

    assert run_records(backend_name, chunk, [("k", step)]) == [True]


@pytest.mark.parametrize("chunk", [1, 2, 1000])
@pytest.mark.parametrize("backend_name", BACKENDS)
async def test_iterator_used_outside_its_record(backend_name, chunk, tmp_path):
    """Documented: chunks load within the record; state access outside a record raises
    InvalidStateError. An iterator whose items are all loaded needs no access."""

    def fill(s, ctx):
        s.l.update(list(range(5)))
        return s.l.get().then_accept(s.saved.append)

    fn = Fn()
    async with ast.KeyedOperator(fn, key_selector=lambda r: r[0],
                                 backend=make_backend(backend_name, str(tmp_path)),
                                 config=ast.AsyncStateConfig(iterator_chunk_size=chunk)) as op:
        await op.process(("k", fill))
        await op.drain()
        it = fn.saved[0]
        assert it.is_empty() is False
        if chunk >= 5:
            assert it.to_list().result() == list(range(5))
            assert it.on_next(lambda x: x * 2).result() == [0, 2, 4, 6, 8]
            assert [x async for x in it] == list(range(5))
        else:
            with pytest.raises(ast.InvalidStateError):
                it.to_list()
            with pytest.raises(ast.InvalidStateError):
                it.on_next(lambda x: x)
            with pytest.raises(ast.InvalidStateError):
                [x async for x in it]


@pytest.mark.parametrize("chunk", [1, 2, 1000])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_list_iteration_ignores_later_appends(backend_name, chunk):
    """docs/backends.md: a list iteration never visits elements appended after it started
    (the heap reads a copy, RocksDB bounds the scan by the sequence counter)."""

    async def step(s, ctx):
        await s.l.update([0, 1, 2, 3])
        it = await s.l.get()
        await s.l.add(99)
        ctx.emit(await it.to_list())
        ctx.emit(await (await s.l.get()).to_list())

    assert run_records(backend_name, chunk, [("k", step)]) == [[0, 1, 2, 3], [0, 1, 2, 3, 99]]


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_items_read_are_fresh_copies(backend_name):
    async def step(s, ctx):
        src = [[1, 2], {"a": [3]}]
        await s.l.add_all(src)
        await s.m.put("k", src)
        await s.v.update(src)
        src[0].append("mutated")
        src[1]["a"].append("mutated")
        first = await (await s.l.get()).to_list()
        first[0].append("x")
        v = await s.v.value()
        v[1]["a"].append("y")
        mv = await s.m.get("k")
        mv.append("z")
        ctx.emit((await (await s.l.get()).to_list(), await s.v.value(), await s.m.get("k")))

    expected = [[1, 2], {"a": [3]}]
    assert run_records(backend_name, 2, [("k", step)]) == [(expected, expected, expected)]


@pytest.mark.parametrize("backend_name", BACKENDS)
@settings(max_examples=slow_examples(10), suppress_health_check=[HealthCheck.too_slow])
@given(v=values, user_key=keys)
def test_values_and_map_keys_round_trip_through_backends(backend_name, v, user_key):
    async def step(s, ctx):
        await s.v.update(v)
        await s.l.add(v)
        await s.m.put(user_key, v)
        ctx.emit((await s.v.value(), await (await s.l.get()).to_list(),
                  await (await s.m.entries()).to_list(), await s.m.get(as_read_back(user_key))))

    assume(v is not None)
    (val, lst, ents, got), = run_records(backend_name, 1000, [("k", step)])
    exp = as_read_back(v)
    assert strict_eq(val, exp) and len(lst) == 1 and strict_eq(lst[0], exp)
    assert len(ents) == 1 and strict_eq(ents[0][0], as_read_back(user_key))
    assert strict_eq(ents[0][1], exp) and strict_eq(got, exp)


@pytest.mark.parametrize("backend_name", ["heap", "rocksdb"])
def test_state_calls_refuse_bad_input_at_the_call_naming_the_state(backend_name):
    cases = [
        ("v", "update", (2**64,), "int"),
        ("v", "update", ({"a": {"\udc80": 1}},), "dict"),
        ("l", "add", ([2**64],), "list"),
        ("l", "add_all", ([1, {1, 2}],), "set"),
        ("m", "put", ({"a": 1}, 1), "dict"),
        ("m", "put", ("\udc80", 1), "str"),
        ("m", "put", ((1, 2**64), 1), "int"),
        ("m", "put", (Color.RED, 1), "Color"),
        ("m", "put", ("ok", {"k": -(2**63) - 1}), "dict"),
        ("m", "get", (bytearray(b"x"),), "bytearray"),
        ("m", "put_all", ({Point(1, 2): 1},), "Point"),
        ("m", "contains", (Weight(1.0),), "Weight"),
    ]

    def step(s, ctx):
        for attr, method, args, type_name in cases:
            try:
                getattr(getattr(s, attr), method)(*args)
            except SerializationError as exc:
                ctx.emit((attr, exc.state_name, exc.type_name == type_name,
                          attr in str(exc)))
            else:
                ctx.emit((attr, "no error"))
        try:
            s.m.set_current_namespace({"ns": 1})
        except SerializationError as exc:
            ctx.emit(("ns", exc.state_name, exc.type_name == "dict", "namespace" in str(exc)))

    out = run_records(backend_name, 1000, [("k", step)])
    assert out == [(a, a, True, True) for a, *_ in cases] + [("ns", "m", True, True)]


# -- the long-iteration recursion ------------------------------------------------------------

_LONG_ITERATION_SCRIPT = textwrap.dedent("""
    import sys
    import asyncstate as ast

    N = int(sys.argv[1])

    class F(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.l = ctx.get_list_state(ast.ListStateDescriptor("l"))

        async def process_element(self, record, ctx):
            await self.l.update(list(range(N)))
            it = await self.l.get()
            ctx.emit(len(await it.to_list()))
            ctx.emit(len(await it.on_next(lambda x: x)))

    out = ast.run(F(), ["k"], key_selector=lambda r: r,
                  backend=ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0),
                  config=ast.AsyncStateConfig(iterator_chunk_size=1))
    assert out == [N, N], out
    print("ok")
""")


def _run_long_iteration(n: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _LONG_ITERATION_SCRIPT, str(n)],
                          capture_output=True, text=True, timeout=300, check=False)


def test_long_chunked_iteration_in_async_for_is_flat():
    """async for walks any number of chunks; to_list/on_next are fine for a few hundred."""
    async def step(s, ctx):
        await s.l.update(list(range(150)))
        it = await s.l.get()
        ctx.emit(([x async for x in it], await it.to_list(), await it.on_next(lambda x: x)))

    (a, b, c), = run_records("remote0-heap", 1, [("k", step)])
    assert a == b == c == list(range(150))


def test_to_list_over_many_asynchronously_loaded_chunks():
    proc = _run_long_iteration(50_000)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (
        proc.returncode, proc.stderr[-1500:])


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
                                     backend=make_backend(backend_name, directory),
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
