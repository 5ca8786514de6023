"""InternalTimer: checks at construction, identity, priority order, and the byte form that
the RocksDB queue and checkpoints store."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from timers_model import any_timestamps, identity, keys, namespaces, timestamps

from asyncstate.errors import SerializationError
from asyncstate.keygroups import assign_to_key_group
from asyncstate.serde import NONE_BYTES, canonical_key, encode_ordered_i64
from asyncstate.timers.timer import (
    MAX_TIMESTAMP,
    MIN_TIMESTAMP,
    InternalTimer,
    decode_timer,
    encode_timer,
    key_group_prefix,
    make_timer,
)


def timer(ts: int, key: Any = "k", namespace: Any = None, key_group: int = 3) -> InternalTimer:
    ns = NONE_BYTES if namespace is None else canonical_key(namespace)
    return InternalTimer(ts, key, canonical_key(key), ns, key_group)


@pytest.mark.parametrize("bad", [1.0, "5", None, True, 2**63 - 1.0])
def test_a_timestamp_that_is_not_an_int_is_refused_naming_its_type(bad: Any) -> None:
    with pytest.raises(TypeError, match=rf"^timer timestamp must be an int \(milliseconds\), "
                                        rf"got {type(bad).__name__} "):
        InternalTimer(bad, "k", b"\xa1k", NONE_BYTES, 0)


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1, 2**70])
def test_a_timestamp_outside_int64_is_refused_naming_it(bad: int) -> None:
    with pytest.raises(ValueError, match=re.escape(f"got {bad}")):
        InternalTimer(bad, "k", b"\xa1k", NONE_BYTES, 0)


def test_the_int64_extremes_are_timestamps() -> None:
    assert InternalTimer(MIN_TIMESTAMP, 1, b"\x01", NONE_BYTES, 0).timestamp == -(2**63)
    assert InternalTimer(MAX_TIMESTAMP, 1, b"\x01", NONE_BYTES, 0).timestamp == 2**63 - 1


def test_key_and_namespace_bytes_must_be_bytes() -> None:
    with pytest.raises(TypeError, match=r"^timer key_bytes and namespace_bytes must be bytes, "
                                        r"got str and bytes$"):
        InternalTimer(1, "k", "k", NONE_BYTES, 0)
    with pytest.raises(TypeError, match=r"got bytes and bytearray$"):
        InternalTimer(1, "k", b"\xa1k", bytearray(NONE_BYTES), 0)


@pytest.mark.parametrize("bad", [-1, 32768])
def test_a_key_group_outside_the_possible_ones_is_refused(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"^timer key_group must be an int in \[0, 32768\), "
                                         rf"got {bad}$"):
        InternalTimer(1, "k", b"\xa1k", NONE_BYTES, bad)
    with pytest.raises(TypeError, match=r"^timer key_group must be an int, got str$"):
        InternalTimer(1, "k", b"\xa1k", NONE_BYTES, "3")


def test_make_timer_computes_the_canonical_bytes_and_the_key_group() -> None:
    t = make_timer(10, ("user", 7), 128, namespace="window")
    assert t.key == ("user", 7)
    assert t.key_bytes == canonical_key(["user", 7])
    assert t.namespace_bytes == canonical_key("window")
    assert t.key_group == assign_to_key_group(("user", 7), 128)
    assert make_timer(10, "k", 128).namespace_bytes == NONE_BYTES


def test_make_timer_refuses_a_key_that_cannot_be_a_key() -> None:
    with pytest.raises(SerializationError, match=r"^key must be None, bool, int"):
        make_timer(1, {"a": 1}, 128)
    with pytest.raises(SerializationError, match=r"^namespace must be None, bool, int"):
        make_timer(1, "k", 128, namespace={1})


def test_equal_timers_are_equal_and_hash_alike_whatever_the_key_object() -> None:
    a = make_timer(5, (1, 2), 128, "w")
    b = make_timer(5, [1, 2], 128, "w")  # a list key has the tuple's canonical bytes
    assert a == b and hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != make_timer(6, (1, 2), 128, "w")
    assert a != make_timer(5, (1, 3), 128, "w")
    assert a != make_timer(5, (1, 2), 128, "v")
    assert a != make_timer(5, (1, 2), 128)
    assert a != (5, (1, 2), "w")


def test_order_is_timestamp_then_key_bytes_then_namespace_bytes() -> None:
    assert timer(1, "z").priority_less_than(timer(2, "a"))
    assert timer(2, "a").priority_less_than(timer(2, "b"))
    assert timer(2, "a", "n1").priority_less_than(timer(2, "a", "n2"))
    assert not timer(2, "a").priority_less_than(timer(2, "a"))
    assert timer(-(2**63), "a").priority_less_than(timer(0, "a"))


def test_repr_names_the_fields() -> None:
    assert repr(timer(5, "k")) == "InternalTimer(timestamp=5, key='k', key_group=3)"
    assert repr(timer(5, "k", "w")) == \
        "InternalTimer(timestamp=5, key='k', namespace_bytes=b'\\xa1w', key_group=3)"


@given(ts=any_timestamps, key=keys, namespace=namespaces, key_group=st.integers(0, 32767))
def test_encoding_round_trips_and_starts_with_the_key_group_and_the_ordered_timestamp(
        ts: int, key: Any, namespace: Any, key_group: int) -> None:
    t = timer(ts, key, namespace, key_group)
    data = encode_timer(t)
    assert data.startswith(key_group_prefix(key_group) + encode_ordered_i64(ts))
    back = decode_timer(data)
    assert identity(back) == identity(t) and back.key_group == key_group
    assert canonical_key(back.key) == t.key_bytes


@given(a=st.tuples(any_timestamps | timestamps, keys, namespaces),
       b=st.tuples(any_timestamps | timestamps, keys, namespaces))
def test_byte_order_is_priority_order_within_a_key_group(a: tuple[Any, ...],
                                                         b: tuple[Any, ...]) -> None:
    ta, tb = timer(*a), timer(*b)
    ea, eb = encode_timer(ta), encode_timer(tb)
    assert (ea < eb) == ta.priority_less_than(tb)
    assert (ea == eb) == (ta == tb)
    assert (ea < eb) == (identity(ta) < identity(tb))


def test_key_group_prefix_is_two_bytes_big_endian() -> None:
    assert key_group_prefix(0) == b"\x00\x00"
    assert key_group_prefix(258) == b"\x01\x02"
    assert key_group_prefix(32767) == b"\x7f\xff"


@pytest.mark.parametrize("data", [
    b"",
    b"\x00\x03" + b"\x80" + b"\x00" * 7,  # no key, no namespace
    b"\x00\x03" + b"\x80" + b"\x00" * 7 + b"\x01",  # a key, no namespace
    b"\x00\x03" + b"\x80" + b"\x00" * 7 + b"\x01\xc0\xc0",  # a namespace and one byte more
    b"\x00\x03" + b"\x80" + b"\x00" * 7 + b"\xc1\xc0",  # 0xc1 starts no msgpack value
    b"\x00\x03" + b"\x80" + b"\x00" * 7 + b"\xa5ab\xc0",  # a str longer than what follows
    b"\x80\x00" + b"\x80" + b"\x00" * 7 + b"\x01\xc0",  # key group 32768
])
def test_damaged_encodings_are_refused(data: bytes) -> None:
    with pytest.raises(SerializationError, match=r"^encoded timer (must be at least 12 bytes, got "
                                                 r"\d+|b'.*' is damaged: )"):
        decode_timer(data)


def test_decoding_refuses_what_is_not_bytes() -> None:
    with pytest.raises(SerializationError, match=r"^encoded timer must be bytes, got bytearray$"):
        decode_timer(bytearray(12))


def test_decoded_keys_come_back_as_tuples_with_the_same_bytes() -> None:
    # Tuples, hashable as the keys a key selector returns; a list key has the same bytes.
    for key in [(1, ("a", b"b")), [1, ["a", b"b"]]]:
        t = decode_timer(encode_timer(timer(1, key, ("w", 1))))
        assert t.key == (1, ("a", b"b")) and type(t.key[1]) is tuple
        assert t.key_bytes == canonical_key(key)
        assert t.namespace_bytes == canonical_key(["w", 1])
