"""Checks of the operator's public arguments.

compiled: interpreted module. An argument is checked here, before any compiled code sees it,
so both builds raise the same error naming the argument (a compiled function would otherwise
raise its own TypeError for a wrongly typed one).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

from asyncstate.backends.base import StateExecutor
from asyncstate.clock import Clock
from asyncstate.config import MAX_MAX_PARALLELISM, AsyncStateConfig, check_int
from asyncstate.errors import ConfigError

__all__ = [
    "check_backend",
    "check_clock",
    "check_config",
    "check_function",
    "check_operator_index",
    "check_output_list",
    "check_parallelism",
    "check_restore_from",
    "check_run_backends",
    "check_run_checkpoint",
    "check_run_functions",
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


def check_output_list(output_list: object) -> list[Any]:
    """`output_list`, or a new list for None; TypeError for anything but a list."""
    if output_list is None:
        return []
    if type(output_list) is not list:
        raise TypeError(f"output_list must be a list or None, got {type(output_list).__name__}")
    return output_list


def check_timestamp(what: str, ts: Any) -> int:
    """`ts` if it is an int of milliseconds in [-2**63, 2**63), else ConfigError naming it."""
    if type(ts) is not int or not (_MIN_TS <= ts <= _MAX_TS):
        raise ConfigError(what, ts, "an int of milliseconds in [-2**63, 2**63)")
    return ts


def check_operator_index(parallelism: object, operator_index: object,
                         max_parallelism: int) -> tuple[int, int]:
    """(parallelism, operator_index) if they are ints in [1, max_parallelism] and
    [0, parallelism - 1], else ConfigError."""
    checked = check_int("parallelism", parallelism, 1, max_parallelism)
    return checked, check_int("operator_index", operator_index, 0, checked - 1)


def check_parallelism(parallelism: object) -> int:
    """`parallelism` if it is an int in [1, 32768], else ConfigError."""
    return check_int("parallelism", parallelism, 1, MAX_MAX_PARALLELISM)


def check_run_functions(function: object, parallelism: int) -> list[Any]:
    """One function object per operator: `function` itself for operator 0 and copies of it
    for the others, or what a factory (a class or a callable without process_element)
    returns for each operator."""
    if isinstance(function, type) or (callable(function) and not callable(
            getattr(function, "process_element", None))):
        made = [function() for _ in range(parallelism)]
        for fn in made:
            if not callable(getattr(fn, "process_element", None)):
                raise TypeError(f"function factory must return a KeyedProcessFunction, got "
                                f"{type(fn).__name__}")
        return made
    check_function(function)
    try:
        return [function] + [copy.deepcopy(function) for _ in range(parallelism - 1)]
    except Exception as exc:
        raise TypeError(
            f"the {type(function).__name__} object cannot be copied for {parallelism} "
            f"operators ({exc}); pass its class or a factory instead, e.g. "
            f"ast.run({type(function).__name__}, ...)") from exc


def check_run_backends(backend: object, parallelism: int) -> list[StateExecutor | None]:
    """One backend per operator (None: a HeapBackend): `backend` itself when it is a backend
    object (parallelism 1 only: a backend serves one operator), else what the factory
    returns for each operator index."""
    if backend is None:
        return [None] * parallelism
    if callable(getattr(backend, "execute_batch", None)) and not isinstance(backend, type):
        if parallelism != 1:
            raise TypeError(
                f"backend must be a factory called with each operator index when parallelism "
                f"is {parallelism} (a backend object serves one operator), got a "
                f"{type(backend).__name__} object; e.g. backend=lambda i: "
                f"ast.RocksDBBackend(f'state-{{i}}')")
        return [_run_backend(backend, "backend")]
    if not callable(backend):
        raise TypeError(f"backend must be a state backend, a factory of backends or None, "
                        f"got {type(backend).__name__}")
    if isinstance(backend, type) and callable(getattr(backend, "execute_batch", None)):
        raise TypeError(
            f"backend must be a state backend object or a factory function, got the class "
            f"{backend.__name__}: pass {backend.__name__}(...) (e.g. "
            f"ast.RocksDBBackend('state')), or, to build one per operator, e.g. "
            f"backend=lambda i: ast.RocksDBBackend(f'state-{{i}}')")
    factory: Callable[[int], object] = backend
    return [_run_backend(factory(i), f"backend({i})") for i in range(parallelism)]


def _run_backend(backend: object, name: str) -> StateExecutor:
    """`check_backend(backend, name)`, refusing a backend whose batches complete only when a
    test says so (`ManualExecutor`): nothing inside `ast.run` can, so it would wait forever."""
    from asyncstate.testing import ManualExecutor

    checked = check_backend(backend, name)
    if isinstance(checked, ManualExecutor):
        raise ConfigError(name, backend, "a backend that completes its batches by itself: a "
                          "ManualExecutor's batches complete only when a test delivers them, "
                          "which nothing inside ast.run does; drive it from a test through "
                          "ast.KeyedOperator")
    return checked


def check_run_checkpoint(checkpoint_dir: object, checkpoint_id: object) -> tuple[str, int] | None:
    """(directory, id) when both are given, None when neither is; else ConfigError."""
    if checkpoint_dir is None and checkpoint_id is None:
        return None
    if checkpoint_dir is None or checkpoint_id is None:
        missing = "checkpoint_dir" if checkpoint_dir is None else "checkpoint_id"
        raise ConfigError(missing, None, "given together with "
                          f"{'checkpoint_id' if missing == 'checkpoint_dir' else 'checkpoint_dir'}")
    if not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise TypeError(f"checkpoint_dir must be a directory path (str or os.PathLike), got "
                        f"{type(checkpoint_dir).__name__}")
    return os.fspath(checkpoint_dir), check_int("checkpoint_id", checkpoint_id, 0)
