"""Logging: asyncstate's events, through the standard `logging` module.

asyncstate logs lifecycle events (operator open, checkpoint, restore) and failures, never one
event per record. An event is a name and fields (`log.warning("operator.close_failed",
error=...)`); structlog renders it as one line, ``operator.close_failed error=...``, into a
record of the standard-library logger of the module that logged it (``asyncstate.operator``,
``asyncstate.checkpoint``, ... all children of ``asyncstate``). Each record also carries the
event name and its fields as the attributes `asyncstate_event` and `asyncstate_fields`.

Level: events below the asyncstate level, `warning` by default, are dropped before any work.
`set_level("debug")` or the environment variable `ASYNCSTATE_LOG_LEVEL=debug` lowers it (and
sets the ``asyncstate`` logger's level to match, so the application's root level does not
hide what was asked for).

Where records go: to the application's handlers when it configured any (`basicConfig`,
`dictConfig`, pytest's `caplog`); otherwise to stderr, one line each, as Python's last-resort
handler does for warnings. Never to stdout. asyncstate neither configures structlog nor
touches the root logger.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

__all__ = ["get_level", "get_logger", "parse_level", "set_level", "set_slow_batch_seconds",
           "slow_batch_seconds"]

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
_ROOT_LOGGER = "asyncstate"


def parse_level(level: object, option: str = "log level") -> int:
    """The `logging` level of an asyncstate level name (any case; "warn" is "warning", as
    in `logging`), else ConfigError naming `option`."""
    name = level.lower() if isinstance(level, str) else None
    if name == "warn":
        name = "warning"
    value = _LEVELS.get(name) if name is not None else None
    if value is None:
        from asyncstate.errors import ConfigError
        raise ConfigError(option, level, f"one of {', '.join(_LEVELS)}")
    return value


class _StderrWhenUnconfigured(logging.StreamHandler):  # type: ignore[type-arg]
    """asyncstate's last-resort handler: writes a record to stderr only when no handler of
    the application would receive it. Unlike `logging.lastResort` it also writes records
    below warning, once the asyncstate level was lowered."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)  # not StreamHandler's: it would bind a stream
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    @property
    def stream(self) -> Any:
        # Looked up at each write, like logging's own last resort: sys.stderr may be
        # replaced after import (pytest's capture, a redirect by the application).
        return sys.stderr

    def handle(self, record: logging.LogRecord) -> bool:
        if _application_handles(record.name):
            return False
        return super().handle(record)


def _application_handles(name: str) -> bool:
    """Whether a handler other than asyncstate's own lies on `name`'s path to the root."""
    logger: logging.Logger | None = logging.getLogger(name)
    while logger is not None:
        if any(not isinstance(h, _StderrWhenUnconfigured) for h in logger.handlers):
            return True
        if not logger.propagate:
            return False
        logger = logger.parent
    return False


def _install_fallback_handler() -> None:
    root = logging.getLogger(_ROOT_LOGGER)
    if not any(isinstance(h, _StderrWhenUnconfigured) for h in root.handlers):
        root.addHandler(_StderrWhenUnconfigured())


_install_fallback_handler()
# An empty ASYNCSTATE_LOG_LEVEL counts as unset, as for most environment variables.
_threshold = parse_level(os.environ.get("ASYNCSTATE_LOG_LEVEL") or "warning",
                         "environment variable ASYNCSTATE_LOG_LEVEL")
if os.environ.get("ASYNCSTATE_LOG_LEVEL"):
    logging.getLogger(_ROOT_LOGGER).setLevel(_threshold)


def get_level() -> str:
    """The asyncstate level ("warning" unless it was changed)."""
    return next((name for name, value in _LEVELS.items() if value == _threshold), "warning")


# A batch whose round trip (trigger to delivery) takes at least this long is logged as
# `controller.slow_batch`; read by each controller when it is created.
DEFAULT_SLOW_BATCH_SECONDS = 1.0
_slow_batch_seconds = DEFAULT_SLOW_BATCH_SECONDS


def slow_batch_seconds() -> float:
    """The round trip from which a batch is logged as slow, in seconds."""
    return _slow_batch_seconds


def set_slow_batch_seconds(seconds: float) -> None:
    """Log batches whose round trip takes at least `seconds` (controllers created later)."""
    global _slow_batch_seconds
    _slow_batch_seconds = seconds


def set_level(level: str) -> None:
    """Emit asyncstate events at `level` ("debug", "info", "warning", ...) and above."""
    global _threshold
    _threshold = parse_level(level)
    logging.getLogger(_ROOT_LOGGER).setLevel(_threshold)


def _field(value: Any) -> str:
    if isinstance(value, str) and value and not any(
            c.isspace() or c in "\"'=" for c in value):
        return value
    return repr(value)


def _caller_stacklevel() -> int:
    """The `stacklevel` that makes a record name asyncstate's call site, not structlog's.

    Called by the processor, which structlog calls from a helper of the frame that then calls
    the stdlib logger (stacklevel 1): count the frames from there up to the first outside
    structlog and this module.
    """
    frame = sys._getframe(3)  # this function, the processor, structlog's helper, the caller
    level = 1
    while frame.f_back is not None and (
            frame.f_code.co_filename == __file__
            or frame.f_code.co_filename.startswith(_STRUCTLOG_DIR)):
        frame = frame.f_back
        level += 1
    return level


_STRUCTLOG_DIR = os.path.dirname(structlog.__file__) + os.sep


def _to_stdlib(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]
               ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """structlog's last processor: the ``event key=value`` line and the stdlib `extra`."""
    fields = dict(event_dict)
    event = str(fields.pop("event"))
    line = " ".join([event, *(f"{k}={_field(v)}" for k, v in fields.items())])
    return (line,), {"extra": {"asyncstate_event": event, "asyncstate_fields": fields},
                     "stacklevel": _caller_stacklevel()}


class _Logger:
    """Logs asyncstate events to the stdlib logger `name`, dropping those below the
    asyncstate level before any work."""

    __slots__ = ("_bound",)

    def __init__(self, name: str) -> None:
        # An explicit wrapper class and processor chain: an application's structlog
        # configuration (its filtering level, its renderer) does not apply to these events;
        # its logging configuration does.
        self._bound: Any = structlog.wrap_logger(
            logging.getLogger(name), processors=[_to_stdlib],
            wrapper_class=structlog.stdlib.BoundLogger, context_class=dict,
            cache_logger_on_first_use=True)

    def _emit(self, level: int, method: str, event: str, fields: dict[str, Any]) -> None:
        if level >= _threshold:
            getattr(self._bound, method)(event, **fields)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(10, "debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(20, "info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(30, "warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit(40, "error", event, fields)


def get_logger(name: str) -> _Logger:
    """The asyncstate logger named `name` (a child of ``asyncstate``, such as
    ``asyncstate.operator``)."""
    return _Logger(name)
