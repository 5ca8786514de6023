"""Small checkpoints written and read for the checkpoint tests: parts whose key group `kg`
holds `records_for(kg)`, one-entry parts, the attempts of concurrent writers (each record
names its writer and round), and in-place damage (a flipped bit, an edited manifest)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import msgpack

import asyncstate as ast
from asyncstate.checkpoint.format import (
    MANIFEST_NAME,
    checkpoint_path,
    open_checkpoint,
    write_part,
)
from asyncstate.keygroups import KeyGroupRange, compute_key_group_range_for_operator_index
from asyncstate.serde import canonical_key

MAX_P = 16


STATES = {"count": "value", "seen": "list"}


def records_for(kg: int, n: int = 3) -> list[object]:
    return [[kg, i, f"r{kg}-{i}", b"\x00\xff" * i, {1: [kg, None, 1.5]}, "é"] for i in range(n)]


def write_all(chk: str, parallelism: int, max_p: int = MAX_P, *, extra_of=None,
              states=STATES, **kwargs) -> dict[int, list[object]]:
    """Write every part of a checkpoint; key group kg gets records_for(kg) (kg % 3 == 2: none)."""
    expected: dict[int, list[object]] = {}
    for index in range(parallelism):
        kgs = compute_key_group_range_for_operator_index(max_p, parallelism, index)
        groups = [(kg, records_for(kg)) for kg in kgs if kg % 3 != 2]
        expected.update(groups)
        write_part(chk, parallelism=parallelism, operator_index=index, max_parallelism=max_p,
                   states=states, key_groups=groups,
                   extra=(extra_of(index) if extra_of else {"index": index}), **kwargs)
    return expected


def read_all(chk: str, kgs: KeyGroupRange | None = None) -> dict[int, list[object]]:
    cp = open_checkpoint(chk)
    rng = kgs or KeyGroupRange(0, cp.max_parallelism - 1)
    return {kg: list(records) for kg, records in cp.read_key_groups(rng)}


def damage(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def edit_manifest(chk: str, part: str, edit=None, **changes) -> None:
    """Rewrite a part's manifest with `changes`, then `edit(manifest)` if given."""
    path = os.path.join(chk, part, MANIFEST_NAME)
    with open(path) as f:
        m = json.load(f)
    m.update(changes)
    if edit is not None:
        edit(m)
    with open(path, "w") as f:
        json.dump(m, f)


def entry(key: str, value_bytes: bytes, state: str = "v") -> list[object]:
    return [state, canonical_key(key), canonical_key(None), value_bytes]


def write_one_part(chk: str, key_groups: list, extra: dict | None = None,
                   max_parallelism: int = MAX_P) -> None:
    write_part(chk, parallelism=1, operator_index=0, max_parallelism=max_parallelism,
               states={"v": "value"}, key_groups=key_groups, extra=extra)


def write_simple(chk: str) -> None:
    kg = ast.assign_to_key_group("k", MAX_P)
    write_one_part(chk, [(kg, [[0, 1], entry("k", msgpack.packb(1))])])


def simple_part(tmp_path: Any) -> tuple[str, Any]:
    """A checkpoint of one part holding one entry, and that part as the reader sees it."""
    chk = checkpoint_path(tmp_path, 1)
    write_simple(chk)
    return chk, open_checkpoint(chk).parts[0]


def attempt_records(writer: int, n: int, kg: int) -> list[list[int]]:
    return [[writer, n, kg, j] for j in range(1 + (n + kg) % 5)]


def write_attempt(chk: str, writer: int, n: int, **kwargs) -> None:
    write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P,
               states={"s": "value"},
               key_groups=[(kg, attempt_records(writer, n, kg)) for kg in range(MAX_P)],
               extra={"writer": writer, "n": n}, **kwargs)


def read_consistent(chk: str) -> tuple[int, int]:
    """Open, verify and read the checkpoint; assert every record belongs to the attempt its
    extra names. Returns (writer, n)."""
    cp = open_checkpoint(chk)
    cp.verify()
    (extra,) = cp.extras
    w, n = extra["writer"], extra["n"]
    got = {kg: list(recs) for kg, recs in cp.read_key_groups(KeyGroupRange(0, MAX_P - 1))}
    assert got == {kg: attempt_records(w, n, kg) for kg in range(MAX_P)}, (w, n)
    return w, n


def part_files(part_dir: str) -> list[str]:
    return sorted(os.listdir(part_dir))


def committed(part_dir: str) -> dict:
    with open(os.path.join(part_dir, MANIFEST_NAME), "rb") as f:
        return json.loads(f.read())


def assert_one_complete_attempt(chk: str) -> None:
    part_dir = os.path.join(chk, "part-1-0")
    names = part_files(part_dir)
    live = committed(part_dir)["data_file"]
    assert live in names
    # Every other file is a data file of a finished attempt (orphaned by the race, young,
    # so kept by the grace period): no temp manifest survives a finished writer.
    assert all(re.fullmatch(r"data-[0-9a-f]{32}\.bin", n) for n in names if n != MANIFEST_NAME)
    read_consistent(chk)
