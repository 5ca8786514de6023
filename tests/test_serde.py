"""asyncstate.serde: canonical key bytes, stored forms, ordered encodings."""

from __future__ import annotations

import pickle
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

import asyncstate as ast
from asyncstate.serde import (
    Packed,
    canonical_key,
    decode_key,
    decode_ordered_i64,
    decode_value,
    encode_ordered_i64,
    from_stored,
    stored_to_bytes,
    to_stored,
)

I64 = st.integers(-(2**63), 2**63 - 1)


@given(I64, I64)
def test_ordered_i64_keeps_numeric_order_in_byte_order(a: int, b: int) -> None:
    ea, eb = encode_ordered_i64(a), encode_ordered_i64(b)
    assert len(ea) == len(eb) == 8
    assert (ea < eb) == (a < b) and (ea == eb) == (a == b)
    assert decode_ordered_i64(ea) == a


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1])
def test_ordered_i64_rejects_out_of_range(bad: int) -> None:
    with pytest.raises(ast.SerializationError, match=r"^ordered int64 out of range"):
        encode_ordered_i64(bad)


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
