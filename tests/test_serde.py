"""asyncstate.serde: canonical key bytes and key identity, stored forms of values, the keys and
values it refuses, nesting depth, and the ordered int64 encoding."""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
import textwrap
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from samples import (
    Color,
    Name,
    Pair,
    Point,
    Weight,
    keys,
    same_key,
    short_text,
    values,
)
from shared_functions import (
    normalize,
    strict_eq,
)

import asyncstate as ast
from asyncstate import serde
from asyncstate.serde import (
    Packed,
    canonical_key,
    check_value_bytes,
    decode_key,
    decode_ordered_i64,
    decode_value,
    encode_ordered_i64,
    from_stored,
    stored_to_bytes,
    to_stored,
)

TOO_DEEP = b"\x91" * 1024 + b"\x90"  # 1025 nested arrays: packs, but msgpack reads 1024 only


def test_check_value_bytes_refuses_bytes_nested_too_deep_with_value_error():
    with pytest.raises(ValueError, match=r"nested more than 1024 levels"):
        check_value_bytes(TOO_DEEP)


I64 = st.integers(-(2**63), 2**63 - 1)


@given(I64, I64)
def test_ordered_i64_keeps_numeric_order_in_byte_order(a: int, b: int) -> None:
    ea, eb = encode_ordered_i64(a), encode_ordered_i64(b)
    assert len(ea) == len(eb) == 8
    assert (ea < eb) == (a < b) and (ea == eb) == (a == b)
    assert decode_ordered_i64(ea) == a


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1, 2**64, -(2**64), 10**30])
def test_ordered_i64_rejects_out_of_range(bad: int) -> None:
    with pytest.raises(ast.SerializationError, match=r"^ordered int64 out of range") as info:
        encode_ordered_i64(bad)
    assert info.value.type_name == "int"


@pytest.mark.parametrize(("bad", "shown"), [(True, "bool"), (1.5, "float"), (2.0, "float"),
                                           (float("nan"), "float"), ("1", "str"),
                                           (None, "NoneType")])
def test_ordered_i64_rejects_what_is_not_an_int_naming_its_type(bad: Any, shown: str) -> None:
    with pytest.raises(ast.SerializationError,
                       match=rf"^ordered int64 must be an int, got {shown}$") as info:
        encode_ordered_i64(bad)
    assert info.value.type_name == shown


@pytest.mark.parametrize(("bad", "shown"), [(b"\x00" * 7, "7 bytes"), (b"\x00" * 9, "9 bytes"),
                                           (bytearray(8), "bytearray"), (5, "int")])
def test_ordered_i64_decodes_exactly_8_bytes(bad: Any, shown: str) -> None:
    with pytest.raises(ast.SerializationError,
                       match=rf"^ordered int64 must be decoded from 8 bytes, got {shown}$"):
        decode_ordered_i64(bad)


def test_canonical_key_is_msgpack_with_bin_type() -> None:
    for key in [1, -5, 2**64 - 1, "k", b"k", None, True, 1.5, [1, "a"], ("x", (1, 2))]:
        assert canonical_key(key) == msgpack.packb(key, use_bin_type=True)


def test_one_one_point_zero_and_true_are_three_keys_list_and_tuple_one() -> None:
    assert len({canonical_key(1), canonical_key(1.0), canonical_key(True)}) == 3
    assert canonical_key([1, 2]) == canonical_key((1, 2))
    assert decode_key(canonical_key((1, (2, 3)))) == [1, [2, 3]]


@pytest.mark.parametrize(("key", "type_name"), [
    ({"a": 1}, "dict"), ([1, {"a": 1}], "dict"), (object(), "object"), (2**64, "int"),
    (-(2**63) - 1, "int"), ({1, 2}, "set"), ("\ud800", "str")])
def test_invalid_keys_raise_serialization_error_naming_the_type(key: Any, type_name: str) -> None:
    with pytest.raises(ast.SerializationError, match=rf"\b{type_name}\b") as info:
        canonical_key(key, "map key", "tags")
    assert info.value.type_name == type_name
    assert "tags" in str(info.value)


def test_to_stored_keeps_scalars_and_packs_containers_once() -> None:
    for scalar in [0, -1, 2**64 - 1, 1.5, "a", "é", b"b", None, True]:
        assert to_stored(scalar, "s") is scalar
    stored = to_stored({"a": [1, (2, 3)]}, "s")
    assert type(stored) is Packed
    assert stored_to_bytes(stored) is stored
    assert from_stored(stored) == {"a": [1, [2, 3]]}  # tuples come back as lists
    assert from_stored(stored) is not from_stored(stored)  # a fresh copy per read


def test_values_with_int_and_tuple_map_keys_round_trip() -> None:
    value = {1: "one", (2, 3): ["x", (4,)]}
    assert decode_value(stored_to_bytes(to_stored(value, "s"))) == {1: "one", (2, 3): ["x", [4]]}


@pytest.mark.parametrize("bad", [object(), 2**64, {1, 2}, "\ud800", [1, object()]])
def test_unencodable_values_name_the_state(bad: Any) -> None:
    with pytest.raises(ast.SerializationError, match=r"state 'counts'") as info:
        to_stored(bad, "counts")
    assert info.value.state_name == "counts"
    copy = pickle.loads(pickle.dumps(info.value))
    assert copy.state_name == "counts" and str(copy) == str(info.value)


class HashableDict(dict):  # type: ignore[type-arg]
    def __hash__(self) -> int:  # type: ignore[override]
        return 0


@pytest.mark.parametrize("bad", [
    pytest.param(lambda: {HashableDict(a=1): "x"}, id="dict-key"),
    pytest.param(lambda: {(1, HashableDict()): "x"}, id="dict-in-tuple-key"),
    pytest.param(lambda: [0, {"k": {HashableDict(): 1}}], id="nested"),
])
def test_values_whose_dict_keys_hold_dicts_are_refused_at_the_write(bad: Any) -> None:
    # msgpack packs a dict subclass as a map, and no decoder can make a map a dict key:
    # accepted, such a value could never be read back.
    with pytest.raises(ast.SerializationError, match=r"^value of state 'm' cannot be read "
                                                     r"back \((dict|list)\): a dict key is or "
                                                     r"holds a dict") as info:
        to_stored(bad(), "m")
    assert info.value.state_name == "m"


def test_values_with_several_dicts_and_no_dict_in_a_key_are_kept() -> None:
    value = {"a": {"b": {1: {"c": (2, 3)}}}, (4, "t"): {"d": {}}, "\x80\x81": {"\xde": 1},
             "sub": HashableDict(x=[HashableDict()])}  # dict subclasses as values are fine
    assert decode_value(stored_to_bytes(to_stored(value, "s"))) == {
        "a": {"b": {1: {"c": [2, 3]}}}, (4, "t"): {"d": {}}, "\x80\x81": {"\xde": 1},
        "sub": {"x": [{}]}}


@given(st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
                    | st.floats(allow_nan=False) | st.text() | st.binary(),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(), inner, max_size=4), max_leaves=20))
def test_stored_form_round_trips_through_bytes(value: Any) -> None:
    stored = to_stored(value, "s")
    assert from_stored(stored) == value
    assert decode_value(stored_to_bytes(stored)) == value


SerializationError = ast.SerializationError


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
    assert strict_eq(back, normalize(k))
    assert serde.canonical_key(back) == serde.canonical_key(k)


@given(ks=st.lists(keys, min_size=1, max_size=5))
def test_canonical_bytes_are_self_delimiting(ks):
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(b"".join(serde.canonical_key(k) for k in ks))
    got = list(unpacker)
    assert len(got) == len(ks)
    assert all(strict_eq(g, normalize(k)) for g, k in zip(got, ks, strict=True))


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


@given(depth=st.integers(0, 6), prefix=short_text,
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


@given(v=values)
def test_value_stored_form_round_trips_tuples_as_lists(v):
    stored = serde.to_stored(v, "s")
    assert strict_eq(serde.from_stored(stored), normalize(v))
    # The byte form (RocksDB's) decodes to the same.
    assert strict_eq(serde.decode_value(serde.stored_to_bytes(stored)), normalize(v))


@pytest.mark.parametrize("v", [
    {(1, 2): "a", (3, (4, 5)): ["x", (6,)]},
    {1: {2: {(3,): (4,)}}},
    [{(1,): [(2,)]}, ((3,),)],
    {b"k": 1, None: 2, 1.5: 3, True: 4, -(2**63): 5, 2**64 - 1: 6},
    {("a", b"b", None, 1.0, False): {"n": [1, (2, 3)]}},
], ids=["tuple-keys", "nested-int-keys", "list-of-tuple-keyed", "scalar-keys", "mixed"])
def test_values_with_non_str_dict_keys_round_trip(v):
    assert strict_eq(serde.from_stored(serde.to_stored(v, "s")), normalize(v))


@given(v=st.lists(values, min_size=1, max_size=3), extra=values)
def test_value_copies_are_independent_of_later_mutation(v, extra):
    stored = serde.to_stored(v, "s")
    expected = normalize(v)
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


def test_ordered_i64_extremes_and_sign_boundary():
    order = [-(2**63), -(2**63) + 1, -(2**32), -1, 0, 1, 2**32, 2**63 - 2, 2**63 - 1]
    enc = [serde.encode_ordered_i64(x) for x in order]
    assert enc == sorted(enc) and len(set(enc)) == len(enc)
    assert enc[0] == b"\x00" * 8 and enc[-1] == b"\xff" * 8
    assert [serde.decode_ordered_i64(e) for e in enc] == order
