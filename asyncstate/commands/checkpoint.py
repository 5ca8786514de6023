"""`asyncstate checkpoint inspect PATH`: what a checkpoint holds, checked before a restore.

The inspection opens the checkpoint as a restore does (every part's manifest, the key groups
they cover, the operator state), verifies the size and checksum of every key group, and
decodes the state entries to count them per state. It reports:

- status: ``complete`` (it can be restored, at any parallelism), ``invalid`` (the committed
  parts do not form one complete, consistent checkpoint: a part is missing or never
  committed, parts overlap, a manifest is unreadable) or ``damaged`` (a data file does not
  match its manifest), with what is wrong;
- the parts: key group range, non-empty key groups, records, data file and size, and the
  committed parts left out (of a run the checkpoint id was written again over);
- per state: kind, key groups holding it, entries (one per key and namespace), elements of
  list and map states, and bytes (the entries' encoded size);
- the operator (non-keyed) state: name, redistribution mode, elements.

Exit status 0 for a complete checkpoint, 1 otherwise. ``--json`` prints the same report as
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import msgpack

from asyncstate.checkpoint.layout import MANIFEST_NAME, PartManifest
from asyncstate.checkpoint.operator_state import read_operator_extras
from asyncstate.checkpoint.reader import Checkpoint, DataFileError, open_checkpoint
from asyncstate.checkpoint.snapshot import SECTION_STATE_ENTRIES, check_restorable
from asyncstate.cli import usage
from asyncstate.errors import CheckpointError
from asyncstate.keygroups import KeyGroupRange

__all__ = ["inspect_checkpoint", "register"]

_ELEMENT_KINDS = frozenset({"list", "map"})  # states whose entries hold several elements


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `checkpoint` subcommand (and its `inspect`) to `commands`."""
    checkpoint = commands.add_parser(
        "checkpoint", help="look into checkpoints",
        description="Look into checkpoints written by KeyedOperator.snapshot.")
    actions = checkpoint.add_subparsers(title="actions", metavar="ACTION")
    checkpoint.set_defaults(handler=lambda _args: usage(checkpoint))
    inspect = actions.add_parser(
        "inspect", help="parts, key groups, states, sizes and checksums of a checkpoint",
        description=__doc__.split("\n\n")[0] if __doc__ else None)
    inspect.add_argument("path", metavar="PATH",
                         help="the checkpoint directory (chk-<id>, as "
                              "ast.checkpoint_path(directory, id) names it)")
    inspect.add_argument("--json", action="store_true",
                         help="print the report as one JSON object")
    inspect.set_defaults(handler=_run_inspect)


def _progress(message: str) -> None:
    print(f"inspect: {message}", file=sys.stderr, flush=True)


def _run_inspect(args: argparse.Namespace) -> int:
    report = inspect_checkpoint(args.path, progress=_progress)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print("\n".join(_render(report)))
    return 0 if report["status"] == "complete" else 1


def _parts_on_disk(path: str) -> list[dict[str, Any]]:
    """The part directories under `path`, and whether each was committed (has a manifest)."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []
    return [{"name": name, "committed": os.path.exists(os.path.join(path, name, MANIFEST_NAME))}
            for name in names
            if name.startswith("part-") and os.path.isdir(os.path.join(path, name))]


def _checkpoints_below(path: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(path)
                      if n.startswith("chk-") and os.path.isdir(os.path.join(path, n)))
    except OSError:
        return []


def inspect_checkpoint(path: str, progress: Callable[[str], None] = lambda _m: None
                       ) -> dict[str, Any]:
    """Open, verify and summarise the checkpoint at `path`; the report as a JSON-ready dict
    (see the module docstring). Never raises CheckpointError: what is wrong goes in the
    report's ``problem``."""
    report: dict[str, Any] = {
        "path": path, "status": "invalid", "problem": None, "max_parallelism": None,
        "parallelism": None, "checksums_verified": False, "parts": [],
        "parts_on_disk": _parts_on_disk(path), "superseded_parts": [], "states": {},
        "operator_state": {},
    }
    progress(f"opening {path}")
    try:
        checkpoint = open_checkpoint(path)
    except CheckpointError as exc:
        report["problem"] = str(exc)
        if isinstance(exc, DataFileError):
            report["status"] = "damaged"
            return report
        below = _checkpoints_below(path)
        if below and not report["parts_on_disk"]:
            report["problem"] += (f"; this directory holds checkpoints {', '.join(below)}: "
                                  "inspect one of them")
        return report
    report["max_parallelism"] = checkpoint.max_parallelism
    report["parallelism"] = checkpoint.parallelism
    report["parts"] = [_part(p) for p in checkpoint.parts]
    report["superseded_parts"] = list(checkpoint.superseded)
    try:
        report["operator_state"] = _operator_state(checkpoint)
        progress(f"verifying the checksums of {checkpoint.parallelism} part(s)")
        check_restorable(checkpoint, KeyGroupRange(0, checkpoint.max_parallelism - 1),
                         checkpoint.max_parallelism)
        report["checksums_verified"] = True
        report["states"] = _states(checkpoint, progress)
    except CheckpointError as exc:
        report["status"], report["problem"] = "damaged", str(exc)
        return report
    report["status"] = "complete"
    return report


def _part(part: PartManifest) -> dict[str, Any]:
    r = part.key_group_range
    return {"name": part.name, "operator_index": part.operator_index,
            "key_groups": [r.start, r.end], "non_empty_key_groups": len(part.key_groups),
            "records": part.records, "data_file": part.data_file, "data_bytes": part.data_size}


def _operator_state(checkpoint: Checkpoint) -> dict[str, Any]:
    extras = read_operator_extras(checkpoint)
    return {name: {"mode": extras.operator_modes.get(name),
                   "elements": sum(len(share) for share in shares)}
            for name, shares in sorted(extras.operator_parts.items())}


def _states(checkpoint: Checkpoint, progress: Callable[[str], None]) -> dict[str, Any]:
    """Per state: kind, key groups holding it, entries, elements (list and map) and bytes."""
    states: dict[str, dict[str, Any]] = {
        name: {"kind": kind, "key_groups": 0, "entries": 0,
               "elements": 0 if kind in _ELEMENT_KINDS else None, "bytes": 0}
        for name, kind in sorted(checkpoint.states.items())}
    pack = msgpack.Packer(use_bin_type=True).pack
    for i, part in enumerate(checkpoint.parts, 1):
        progress(f"reading {part.name} ({i}/{checkpoint.parallelism})")
        for kg, records in checkpoint.read_key_group_lists(part.key_group_range):
            held: set[str] = set()
            for entry in _state_entries(part, kg, records):
                name, data = entry[0], entry[3]
                summary = states.get(name)
                if summary is None:
                    raise _damaged(part, kg, f"holds entries of state {name!r}, which its "
                                             "manifest does not declare")
                summary["entries"] += 1
                summary["bytes"] += len(pack(entry))
                if summary["elements"] is not None:
                    summary["elements"] += len(data) if isinstance(data, list) else 0
                held.add(name)
            for name in held:
                states[name]["key_groups"] += 1
    return states


def _state_entries(part: PartManifest, kg: int, records: list[Any]) -> list[list[Any]]:
    """The state entries among a key group's sections (other sections are skipped)."""
    entries: list[list[Any]] = []
    i = 0
    while i < len(records):
        header = records[i]
        if (type(header) is not list or len(header) != 2 or type(header[0]) is not int
                or type(header[1]) is not int or not 0 <= header[1] < len(records) - i):
            raise _damaged(part, kg, f"has a malformed section header {header!r}")
        tag, count = header
        section = records[i + 1:i + 1 + count]
        i += 1 + count
        if tag != SECTION_STATE_ENTRIES:
            continue
        for entry in section:
            if type(entry) is not list or len(entry) != 4 or type(entry[0]) is not str:
                raise _damaged(part, kg, "has a malformed state entry")
            entries.append(entry)
    return entries


def _damaged(part: PartManifest, kg: int, what: str) -> CheckpointError:
    return CheckpointError(f"key group {kg} of data file {part.data_path!r} {what}",
                           path=part.data_path)


def _render(report: dict[str, Any]) -> list[str]:
    """The report as text lines."""
    status = report["status"]
    if status == "complete":
        lines = [f"checkpoint {report['path']}: complete, checksums verified",
                 f"  max_parallelism {report['max_parallelism']}, written by "
                 f"{report['parallelism']} operator(s); restorable at any parallelism from 1 "
                 f"to {report['max_parallelism']}"]
    else:
        lines = [f"checkpoint {report['path']}: {status.upper()}, cannot be restored",
                 f"  {report['problem']}"]
    if report["parts"]:
        lines += ["", "part              key groups  non-empty    records        bytes  data file"]
        for p in report["parts"]:
            start, end = p["key_groups"]
            lines.append(f"  {p['name']:<15} {f'{start}..{end}':>10} "
                         f"{p['non_empty_key_groups']:>10,} {p['records']:>10,} "
                         f"{p['data_bytes']:>12,}  {p['data_file']}")
        if report["superseded_parts"]:
            lines.append(f"  left out: {', '.join(report['superseded_parts'])} (of a run the "
                         "checkpoint id was written again over, at another parallelism)")
    elif report["parts_on_disk"]:
        found = ", ".join(f"{d['name']} ({'committed' if d['committed'] else 'never committed'})"
                          for d in report["parts_on_disk"])
        lines.append(f"  parts on disk: {found}")
    if report["states"]:
        lines += ["", "state             kind         key groups    entries   elements        "
                      "bytes"]
        for name, s in report["states"].items():
            elements = "-" if s["elements"] is None else f"{s['elements']:,}"
            lines.append(f"  {name:<15} {s['kind']:<12} {s['key_groups']:>10,} "
                         f"{s['entries']:>10,} {elements:>10} {s['bytes']:>12,}")
    if status == "complete":
        operator_state = report["operator_state"]
        if operator_state:
            lines += ["", "operator state    mode         elements"]
            lines += [f"  {name:<15} {s['mode'] or '-':<12} {s['elements']:>8,}"
                      for name, s in operator_state.items()]
        else:
            lines += ["", "operator state: none"]
    return lines
