"""Keys and values the serde, key-group and state tests feed: hypothesis strategies that mix
the values Python equality confuses (1, 1.0, True; 0.0, -0.0; NaN), builtin subclasses that
pack as their base type, and the documented key identity written without msgpack."""

from __future__ import annotations

import collections
import enum
import struct
from typing import Any

from hypothesis import strategies as st


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


short_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=6)

# Values that collide under Python equality but are distinct keys.
tricky_scalars = st.sampled_from([0, 1, -1, 1.0, 0.0, -0.0, True, False, None, "1", b"1", "",
                                  b"", 2**63, 2**64 - 1, -(2**63), float("inf"), float("nan")])

key_scalars = st.one_of(
    tricky_scalars, st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True), short_text, st.binary(max_size=6))

keys = st.recursive(
    key_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.lists(inner, max_size=4).map(tuple)),
    max_leaves=10)

hashable_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
                             st.floats(allow_nan=False), short_text, st.binary(max_size=6))

dict_keys = st.recursive(hashable_scalars, lambda inner: st.lists(inner, max_size=3).map(tuple),
                         max_leaves=5)

values = st.recursive(
    key_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(dict_keys, inner, max_size=4)),
    max_leaves=15)


class Color(enum.IntEnum):
    RED = 1


class Weight(float):
    pass


class Name(str):
    pass


class Pair(tuple):
    pass


Point = collections.namedtuple("Point", "x y")
