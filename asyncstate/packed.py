"""`Packed`: the stored form of a non-scalar value (see `asyncstate.serde`).

compiled: interpreted module. It lives apart from `serde`, which is compiled: a compiled
module cannot define a subclass of `bytes`.
"""

from __future__ import annotations

__all__ = ["Packed"]


class Packed(bytes):
    """A value already encoded with msgpack (the stored form of non-scalar values)."""

    __slots__ = ()
