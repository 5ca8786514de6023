"""Encoding of keys, namespaces and values (msgpack).

Keys, namespaces and map user keys are identified by their *canonical bytes*: msgpack with
``use_bin_type=True``. The controller, every backend, checkpoints and key groups compare keys
that way, so ``1``, ``1.0`` and ``True`` are three keys while ``[1, 2]`` and ``(1, 2)`` are one.
Allowed key types: None, bool, int in [-2**63, 2**64), float, str, bytes, and lists or tuples
of those. Dicts are not keys.

Values are anything msgpack encodes (dicts with int or tuple keys included). States hand
backends the *stored form* of a value (see `to_stored`): immutable scalars stay as they are,
everything else is packed once at the call that wrote it. That single step validates the
value (errors name the state and the type), copies it (later mutation of the caller's list
cannot change stored state) and makes tuples come back as lists on every backend.

A key's *key group* is the unsigned murmur3 x86 32-bit hash (seed 0) of its canonical bytes,
modulo max_parallelism (`key_group_of_bytes`; `asyncstate.keygroups` has the public side).

Ordered encodings (`encode_ordered_i64`) keep byte order equal to numeric order, for sorted
keys such as timer timestamps.
"""

from __future__ import annotations

import struct
from typing import Any, Final

import mmh3
import msgpack

from asyncstate.errors import SerializationError
from asyncstate.packed import Packed as Packed

__all__ = [
    "NONE_BYTES",
    "Packed",
    "canonical_key",
    "check_key_bytes",
    "check_value_bytes",
    "decode_key",
    "decode_ordered_i64",
    "decode_value",
    "encode_ordered_i64",
    "from_stored",
    "key_group_of_bytes",
    "stored_to_bytes",
    "to_stored",
]

NONE_BYTES: Final = b"\xc0"  # canonical bytes of None: the default namespace
_INT_MIN: Final = -(2**63)
_INT_END: Final = 2**64
_KEY_SCALARS: Final = frozenset({type(None), bool, int, float, str, bytes})
_VALUE_SCALARS: Final = _KEY_SCALARS
_unpackb: Final = msgpack.unpackb  # compiled: Final alias
_StackError: Final = msgpack.StackError  # compiled: Final alias
# One reusable Packer (cheaper than msgpack.packb per call). Packing exact builtin types
# with no `default` hook never calls back into Python, so each call holds the GIL from start
# to end and the shared buffer cannot be interleaved by another thread.
_packb: Final = msgpack.Packer(use_bin_type=True, autoreset=True).pack


# msgpack packs an empty container one level deeper than it unpacks: 1025 nested containers
# pack, but only 1024 read back. Bytes that deep hold more than 1024 container headers, so
# only encodings with that many header-like bytes are decoded to check (`_too_deep`).
_MAX_DEPTH: Final = 1024
_TOO_DEEP: Final = f"it is nested more than {_MAX_DEPTH} levels deep, the most msgpack decodes"
_CONTAINER_HEADS: Final = bytes([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])


def _too_deep(data: bytes) -> bool:
    """True if `data` (msgpack that packed) is nested deeper than msgpack reads back."""
    if len(data) <= _MAX_DEPTH or \
            len(data) - len(data.translate(None, _CONTAINER_HEADS)) <= _MAX_DEPTH:
        return False
    try:
        _unpackb(data, raw=True, strict_map_key=False, use_list=False)
    except _StackError:
        return True
    return False


def _describe(what: str, state_name: str | None) -> str:
    return what if state_name is None else f"{what} of state {state_name!r}"


def _check_key_parts(key: object, what: str, state_name: str | None) -> None:
    # A walk with its own stack, not recursion: a key nested deeper than the interpreter's
    # recursion limit gets msgpack's own nesting error (a SerializationError), not a crash.
    stack: list[object] = [key]
    while stack:
        part = stack.pop()
        tp = type(part)
        if tp is list or tp is tuple:
            stack.extend(reversed(part))  # type: ignore[call-overload]
            continue
        if tp not in _KEY_SCALARS:
            hint = " (dicts are not allowed in keys)" if isinstance(part, dict) else ""
            raise SerializationError(
                f"{_describe(what, state_name)} must be None, bool, int, float, str, bytes or "
                f"a list/tuple of those, got {tp.__name__}{hint}",
                state_name=state_name, type_name=tp.__name__)
        if tp is int and not (_INT_MIN <= part < _INT_END):  # type: ignore[operator]
            raise SerializationError(
                f"{_describe(what, state_name)} is an int outside [-2**63, 2**64): {part!r}",
                state_name=state_name, type_name="int")


def canonical_key(key: object, what: str = "key", state_name: str | None = None) -> bytes:
    """Return the canonical bytes of a key, namespace or map user key.

    Raises SerializationError naming `what` (and the state) for a type that cannot be a key.
    """
    tp = type(key)
    if not (tp is int or tp is str or tp is bytes):  # the common scalars need no walk
        _check_key_parts(key, what, state_name)
    try:
        data: bytes = _packb(key)
    except (OverflowError, UnicodeEncodeError, ValueError) as exc:
        raise SerializationError(
            f"{_describe(what, state_name)} cannot be encoded ({tp.__name__}): {exc}",
            state_name=state_name, type_name=tp.__name__) from None
    if not (tp is int or tp is str or tp is bytes) and _too_deep(data):
        raise SerializationError(
            f"{_describe(what, state_name)} cannot be encoded ({tp.__name__}): {_TOO_DEEP}",
            state_name=state_name, type_name=tp.__name__)
    return data


_murmur3: Final = mmh3.hash  # compiled: Final alias


def key_group_of_bytes(key_bytes: bytes, max_parallelism: int) -> int:
    """Key group of canonical key bytes (`max_parallelism` is not checked here)."""
    return _murmur3(key_bytes, 0, False) % max_parallelism


def decode_key(data: bytes, tuples: bool = False) -> Any:
    """Decode canonical key bytes: tuples come back as lists, or with `tuples` as tuples
    (hashable, as the keys a key selector returns usually are)."""
    try:
        return _unpackb(data, raw=False, strict_map_key=False, use_list=not tuples)
    except _StackError:
        raise SerializationError(
            f"a stored key cannot be read back: {_TOO_DEEP}", type_name="bytes") from None


def to_stored(value: object, state_name: str) -> Any:
    """Validate a value and return its stored form (scalar as is, anything else `Packed`).

    Raises SerializationError naming the state and the type when msgpack cannot encode it.
    """
    tp = type(value)
    if tp in _VALUE_SCALARS:
        if tp is int:
            if _INT_MIN <= value < _INT_END:  # type: ignore[operator]
                return value
        elif tp is str:
            if value.isascii():  # type: ignore[attr-defined]
                return value
            try:
                value.encode("utf-8")  # type: ignore[attr-defined]
            except UnicodeEncodeError as exc:
                raise SerializationError(
                    f"value of state {state_name!r} is a str that is not valid UTF-8: {exc}",
                    state_name=state_name, type_name="str") from None
            return value
        else:
            return value
    try:
        data = _pack_value(value)
    except (TypeError, OverflowError, UnicodeEncodeError, ValueError) as exc:
        raise SerializationError(
            f"value of state {state_name!r} cannot be encoded with msgpack "
            f"({tp.__name__}): {exc}", state_name=state_name, type_name=tp.__name__) from None
    if _too_deep(data):
        raise SerializationError(
            f"value of state {state_name!r} cannot be encoded with msgpack ({tp.__name__}): "
            f"{_TOO_DEEP}",
            state_name=state_name, type_name=tp.__name__)
    if _dict_key_holds_dict(value):
        raise SerializationError(
            f"value of state {state_name!r} cannot be read back ({tp.__name__}): a dict key "
            "is or holds a dict (a hashable dict subclass packs as a map, which decodes as an "
            "unhashable dict)", state_name=state_name, type_name=tp.__name__)
    return Packed(data)


def _dict_key_holds_dict(value: object) -> bool:
    """True if a dict in `value` has a key that is or holds a dict. msgpack packs such a key
    (a hashable dict subclass) as a map, which no decoder can make a dict key. A walk with
    its own stack; ints, floats, strs and bytes are skipped by identity checks, so long lists
    of numbers cost little."""
    stack: list[object] = [value]
    while stack:
        obj = stack.pop()
        if isinstance(obj, dict):
            for key, item in obj.items():
                if _is_container(key) and _holds_dict(key):
                    return True
                if _is_container(item):
                    stack.append(item)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                if _is_container(item):
                    stack.append(item)
    return False


def _is_container(obj: object) -> bool:
    tp = type(obj)
    return not (tp is int or tp is float or tp is str or tp is bytes or tp is bool
                or obj is None)


def _holds_dict(key: object) -> bool:
    stack: list[object] = [key]
    while stack:
        obj = stack.pop()
        if isinstance(obj, dict):
            return True
        if isinstance(obj, (list, tuple)):
            stack.extend(obj)
    return False


def _pack_value(value: object) -> bytes:
    # Values may be subclasses (IntEnum, namedtuple) whose packing can run Python code, so
    # they get a fresh Packer rather than the shared one.
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


def from_stored(stored: Any) -> Any:
    """Return the user value of a stored form (a fresh copy for packed values)."""
    if type(stored) is Packed:
        return decode_value(stored)
    return stored


def stored_to_bytes(stored: Any) -> bytes:
    """Return the msgpack bytes of a stored form (for byte-oriented backends)."""
    if type(stored) is Packed:
        return stored
    return _packb(stored)  # type: ignore[no-any-return]


def decode_value(data: bytes) -> Any:
    """Decode msgpack value bytes: arrays become lists; dicts may have int or tuple keys."""
    try:
        return _unpackb(data, raw=False, strict_map_key=False)
    except TypeError:
        # A map key that is an array cannot be a list (unhashable): decode arrays as tuples,
        # then turn every array that is not a map key back into a list.
        return _lists(_unpackb(data, raw=False, strict_map_key=False, use_list=False))
    except _StackError:
        # msgpack packs an empty container one level deeper than it reads back.
        raise SerializationError(
            f"a stored value cannot be read back: {_TOO_DEEP}", type_name="bytes") from None


def check_value_bytes(data: object) -> None:
    """Raise ValueError (TypeError for a non-bytes `data`) unless `data` is the msgpack
    bytes of exactly one value that `decode_value` reads back. Restores check value bytes
    they store undecoded, so damage shows at restore, naming the checkpoint file, not at a
    later read."""
    _check_one(data, False)


def check_key_bytes(data: object) -> None:
    """As `check_value_bytes`, for the bytes of one key that `decode_key` reads back:
    restores check the map user keys they store."""
    _check_one(data, True)


def _check_one(data: object, key: bool) -> None:
    # compiled: typed as object (the compiled build raises this TypeError, not its own).
    what = "key" if key else "value"
    if type(data) is not bytes:
        raise TypeError(f"stored {what} bytes must be bytes, got {type(data).__name__}")
    try:
        if key:
            decode_key(data)
        else:
            decode_value(data)
    except SerializationError as exc:
        raise ValueError(str(exc)) from None
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        shown = data if len(data) <= 16 else data[:16] + b"..."
        raise ValueError(f"stored {what} bytes {shown!r} are not the msgpack bytes of one "
                         f"{what} ({type(exc).__name__}: {exc})") from None


def _lists(obj: Any) -> Any:
    """`obj` with every tuple that is not a dict key turned into a list. The containers are
    fresh from the decoder, so dicts are updated in place; an explicit stack, not recursion,
    walks values as deep as msgpack nests them."""
    holder: list[Any] = [obj]
    stack: list[tuple[Any, Any]] = [(holder, 0)]
    while stack:
        parent, slot = stack.pop()
        item = parent[slot]
        if type(item) is tuple:
            items = list(item)
            parent[slot] = items
            stack.extend([(items, i) for i in range(len(items))])
        elif type(item) is dict:
            stack.extend([(item, k) for k in item])
    return holder[0]


_I64 = struct.Struct(">Q")


def encode_ordered_i64(value: object) -> bytes:
    """8 bytes whose unsigned byte order equals the signed order of `value` (sign bit flipped).
    `value` must be an int (not a bool) in [-2**63, 2**63), else SerializationError."""
    # compiled: typed as object (the compiled build raises these errors, not its own).
    if type(value) is not int:
        raise SerializationError(f"ordered int64 must be an int, got {type(value).__name__}",
                                 type_name=type(value).__name__)
    if not (-(2**63) <= value < 2**63):
        raise SerializationError(f"ordered int64 out of range: {value!r}", type_name="int")
    return _I64.pack(value + 2**63)


def decode_ordered_i64(data: object) -> int:
    """Inverse of `encode_ordered_i64`: `data` must be 8 bytes, else SerializationError."""
    if type(data) is not bytes or len(data) != _I64.size:
        shown = f"{len(data)} bytes" if type(data) is bytes else type(data).__name__
        raise SerializationError(f"ordered int64 must be decoded from 8 bytes, got {shown}",
                                 type_name=type(data).__name__)
    return int(_I64.unpack(data)[0]) - 2**63
