"""Which implementation of the hot path runs: the compiled modules or the Python sources.

The modules in `COMPILED_MODULES` are plain, fully typed Python and stay the reference
implementation. An install also compiles them with mypyc (see `setup.py`); the compiled
extension modules sit beside the sources and are preferred by the import system. `select()`
runs once, from `asyncstate/__init__.py`, before any of them is imported:

1. With the environment variable `ASYNCSTATE_PURE_PYTHON` set to a non-empty value other than
   `0`, the Python sources are imported (the test suite runs once in each mode).
2. When some compiled module is missing, or a source differs from the one it was compiled
   from (the build stamps their digests), the Python sources are imported and a
   `RuntimeWarning` says how to rebuild. The compiled modules call each other natively, so
   it is all of them or none.
3. Otherwise the compiled modules load.

This module imports only the standard library: `setup.py` runs it for `COMPILED_MODULES` and
`write_stamp`.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr as mypyc_attr

__all__ = [
    "COMPILED_MODULES",
    "PURE_PYTHON_ENV",
    "STAMP_NAME",
    "mode",
    "mypyc_attr",
    "problems",
    "select",
    "write_stamp",
]

PURE_PYTHON_ENV = "ASYNCSTATE_PURE_PYTHON"
STAMP_NAME = "_compiled.stamp"  # beside this module: {module: sha256 of the compiled source}

# The per-record path: futures, contexts, the controller and its parts (batch statistics
# and their histogram included), the coroutine driver, the states (they share one compiled
# base class) and their TTL layer, key and value encoding (key groups included), the heap and
# RocksDB backends (their TTL reads included) and the state cache in front of a backend, the
# operator parts that admit and start records, and the timer queues (their classes inherit
# from each other natively, so all of them or none). `runtime/stepping.py`, `packed.py` and
# `operator/arguments.py` stay interpreted on purpose (see their docstrings).
COMPILED_MODULES: tuple[str, ...] = (
    "asyncstate.backends.cache",
    "asyncstate.backends.heap",
    "asyncstate.backends.heap_ttl",
    "asyncstate.backends.rocksdb",
    "asyncstate.backends.rocksdb_batch",
    "asyncstate.backends.rocksdb_layout",
    "asyncstate.backends.rocksdb_ttl",
    "asyncstate.histogram",
    "asyncstate.operator.admission",
    "asyncstate.operator.inbox",
    "asyncstate.operator.keyed",
    "asyncstate.operator.records",
    "asyncstate.operator.run",
    "asyncstate.runtime.batch_stats",
    "asyncstate.runtime.buffer",
    "asyncstate.runtime.context",
    "asyncstate.runtime.driver",
    "asyncstate.runtime.controller",
    "asyncstate.runtime.epoch",
    "asyncstate.runtime.future",
    "asyncstate.runtime.key_accounting",
    "asyncstate.runtime.occupancy",
    "asyncstate.runtime.requests",
    "asyncstate.serde",
    "asyncstate.state.base",
    "asyncstate.state.list",
    "asyncstate.state.map",
    "asyncstate.state.merging",
    "asyncstate.state.ttl.layout",
    "asyncstate.state.ttl.states",
    "asyncstate.state.ttl.tracker",
    "asyncstate.state.value",
    "asyncstate.timers.base",
    "asyncstate.timers.batch",
    "asyncstate.timers.heap",
    "asyncstate.timers.heap_set",
    "asyncstate.timers.partitioned",
    "asyncstate.timers.rocksdb_set",
    "asyncstate.timers.service",
    "asyncstate.timers.timer",
)

_C = TypeVar("_C")

if not TYPE_CHECKING:
    def mypyc_attr(*attrs: Any, **kwattrs: Any) -> Callable[[_C], _C]:
        """mypy_extensions.mypyc_attr for the compiled modules (`# compiled: mypyc_attr`):
        mypyc reads the decorator and never calls it, and the Python sources need no
        mypy_extensions at run time. (This module is not compiled: mypyc would turn the
        branch that type checkers skip into an error.)"""
        return lambda cls: cls

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_mode: str | None = None


def mode() -> str:
    """'compiled' or 'python': the implementation `select()` chose for this process."""
    return select()


def _source_path(module: str, root: str = _ROOT) -> str:
    return os.path.join(root, *module.split(".")) + ".py"


def _digests(root: str) -> dict[str, str]:
    digests = {}
    for module in COMPILED_MODULES:
        with open(_source_path(module, root), "rb") as f:
            digests[module] = hashlib.sha256(f.read()).hexdigest()
    return digests


def write_stamp(path: str, source_root: str) -> None:
    """Record the digests of the sources under `source_root` that were just compiled."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_digests(source_root), f, indent=1, sort_keys=True)


def _extension_path(module: str) -> str | None:
    base = os.path.join(_ROOT, *module.split("."))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if os.path.exists(base + suffix):
            return base + suffix
    return None


def _problems() -> list[str]:
    """Why the compiled modules cannot be used ([] when they can); [''] when none exist."""
    built = {m: _extension_path(m) for m in COMPILED_MODULES}
    if not any(built.values()):
        return [""]
    problems = [f"{module} is not compiled" for module, path in built.items() if path is None]
    try:
        with open(os.path.join(_ROOT, "asyncstate", STAMP_NAME), encoding="utf-8") as f:
            stamped = json.load(f)
    except (OSError, ValueError):
        return [*problems, f"the build stamp asyncstate/{STAMP_NAME} is missing or damaged"]
    current = _digests(_ROOT)
    problems += [f"{module} was edited after it was compiled"
                 for module in COMPILED_MODULES if stamped.get(module) != current[module]]
    return problems


def problems() -> list[str]:
    """Why the compiled modules of this install cannot be used: [] when they can (whatever
    `ASYNCSTATE_PURE_PYTHON` says); the set-up scripts ask it before reusing an install."""
    found = _problems()
    return ["no module is compiled" if p == "" else p for p in found]


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Finds the Python source of the compiled modules, ahead of their extension modules."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in COMPILED_MODULES:
            return None
        source = _source_path(fullname)
        if not os.path.isfile(source):
            return None
        return importlib.util.spec_from_file_location(fullname, source)


def select() -> str:
    """Choose the implementation (see the module docstring); idempotent."""
    global _mode
    if _mode is not None:
        return _mode
    loaded = [m for m in COMPILED_MODULES if m in sys.modules]
    if loaded:
        raise RuntimeError(f"asyncstate._compiled.select() must run before {loaded[0]} is "
                           "imported: import asyncstate first")
    if os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"):
        problems = ["requested"]
    else:
        problems = _problems()
    if not problems:
        _mode = "compiled"
        return _mode
    if problems != [""] and problems != ["requested"]:
        warnings.warn(
            f"asyncstate runs its Python sources, not its compiled modules: "
            f"{'; '.join(problems)}. Rebuild with `pip install -e .` (or set "
            f"{PURE_PYTHON_ENV}=1 to choose the Python sources on purpose)",
            RuntimeWarning, stacklevel=3)
    sys.meta_path.insert(0, _SourceFinder())
    _mode = "python"
    return _mode
