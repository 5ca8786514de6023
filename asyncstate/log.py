"""Logging: structlog events with fields, quiet unless switched on.

asyncstate logs lifecycle events (operator open, checkpoint, restore) and failures, never one
event per record. Nothing is printed until the level is lowered, with
`asyncstate.log.set_level("debug")` or the environment variable `ASYNCSTATE_LOG_LEVEL=debug`;
then events go through structlog's configuration (the application's, if it has one).
"""

from __future__ import annotations

import os
from typing import Any

import structlog

__all__ = ["get_logger", "set_level"]

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}


def _parse(level: str) -> int:
    try:
        return _LEVELS[level.lower()]
    except (KeyError, AttributeError):
        from asyncstate.errors import ConfigError
        raise ConfigError("log level", level, f"one of {', '.join(_LEVELS)}") from None


# An empty ASYNCSTATE_LOG_LEVEL counts as unset, as for most environment variables.
_threshold = _parse(os.environ.get("ASYNCSTATE_LOG_LEVEL") or "warning")


def set_level(level: str) -> None:
    """Emit asyncstate events at `level` ("debug", "info", "warning", ...) and above."""
    global _threshold
    _threshold = _parse(level)


class _Logger:
    """A structlog logger that drops events below the asyncstate level before any work."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def _emit(self, level: int, method: str, event: str, fields: dict[str, Any]) -> None:
        if level >= _threshold:
            getattr(structlog.get_logger(self._name), method)(event, **fields)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(10, "debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(20, "info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(30, "warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit(40, "error", event, fields)


def get_logger(name: str) -> _Logger:
    """The asyncstate logger named `name`."""
    return _Logger(name)
