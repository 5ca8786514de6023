"""Checks of the operator's public arguments.

compiled: interpreted module. An argument is checked here, before any compiled code sees it,
so both builds raise the same error naming the argument (a compiled function would otherwise
raise its own TypeError for a wrongly typed one).
"""

from __future__ import annotations

import os
from typing import Any

from asyncstate.backends.base import StateExecutor
from asyncstate.clock import Clock
from asyncstate.config import AsyncStateConfig
from asyncstate.errors import ConfigError

__all__ = [
    "check_backend",
    "check_clock",
    "check_config",
    "check_function",
    "check_restore_from",
    "check_selector",
    "check_timestamp",
]

_MIN_TS = -(2**63)
_MAX_TS = 2**63 - 1
_EXECUTOR_METHODS = ("open", "execute_batch", "register_state", "fully_loaded", "close")


def check_function(function: object) -> None:
    """TypeError unless `function` has a callable process_element()."""
    if not callable(getattr(function, "process_element", None)):
        raise TypeError(f"function must be a KeyedProcessFunction with process_element(), "
                        f"got {type(function).__name__}")


def check_selector(name: str, selector: object, *, optional: bool = False) -> None:
    """TypeError unless `selector` is callable (or None, when `optional`)."""
    if selector is None and optional:
        return
    if not callable(selector):
        what = "callable or None" if optional else "callable"
        raise TypeError(f"{name} must be {what}, got {type(selector).__name__}")


def check_backend(backend: object, name: str = "backend") -> StateExecutor:
    """`backend` if it is a state backend instance, else TypeError naming what it lacks."""
    if isinstance(backend, type):
        raise TypeError(f"{name} must be a state backend instance, got the class "
                        f"{backend.__name__} (call it: {backend.__name__}(...))")
    missing = [m for m in _EXECUTOR_METHODS if not callable(getattr(backend, m, None))]
    if missing:
        raise TypeError(f"{name} must be a state backend (HeapBackend, RocksDBBackend, ...), "
                        f"got {type(backend).__name__} without "
                        f"{', '.join(m + '()' for m in missing)}")
    assert isinstance(backend, StateExecutor)
    return backend


def check_clock(clock: object) -> None:
    """TypeError unless `clock` is None or has now_ms()."""
    if clock is not None and not isinstance(clock, Clock):
        raise TypeError(f"clock must be a Clock with now_ms() (SystemClock, ManualClock) or "
                        f"None, got {type(clock).__name__}")


def check_restore_from(restore_from: object) -> str | None:
    """The checkpoint path as a str, or None; TypeError for anything else."""
    if restore_from is None:
        return None
    if not isinstance(restore_from, (str, os.PathLike)):
        raise TypeError(f"restore_from must be a checkpoint path (str or os.PathLike) or "
                        f"None, got {type(restore_from).__name__}")
    return os.fspath(restore_from)


def check_config(config: object) -> AsyncStateConfig:
    """`config`, or the default AsyncStateConfig for None; TypeError for anything else."""
    if config is None:
        return AsyncStateConfig()
    if not isinstance(config, AsyncStateConfig):
        raise TypeError(f"config must be an AsyncStateConfig, got {type(config).__name__}")
    return config


def check_timestamp(what: str, ts: Any) -> int:
    """`ts` if it is an int of milliseconds in [-2**63, 2**63), else ConfigError naming it."""
    if type(ts) is not int or not (_MIN_TS <= ts <= _MAX_TS):
        raise ConfigError(what, ts, "an int of milliseconds in [-2**63, 2**63)")
    return ts
