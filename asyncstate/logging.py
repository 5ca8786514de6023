"""`asyncstate.logging.configure`: one call to see asyncstate's events, as text or JSON.

asyncstate logs through the standard `logging` module (`asyncstate.log` describes how), and
is quiet by default: warnings only, on stderr when the application configured no logging.
`configure()` turns on asyncstate's own handler, on stderr unless told otherwise:

    import asyncstate.logging
    asyncstate.logging.configure(level="info")             # ``time level logger: event k=v``
    asyncstate.logging.configure(json=True, level="debug")  # one JSON object per line

Events (name, level): ``operator.open`` and ``operator.closed`` (debug; closed carries the
run's counters), ``operator.failed`` (info: the exception also reaches the caller),
``checkpoint.part_written`` and ``checkpoint.restored`` (info), ``controller.slow_batch``
(warning: a batch whose round trip took at least `slow_batch_ms`), ``operator.close_failed``
(warning), and debug events of the controller and backends. No event is logged per record.

Calling `configure` again replaces the handler it installed before; `reset()` removes it.
"""

from __future__ import annotations

import datetime
import json as _json
import logging
import sys
from typing import Any, TextIO

from asyncstate.errors import ConfigError
from asyncstate.log import (
    DEFAULT_SLOW_BATCH_SECONDS,
    parse_level,
    set_level,
    set_slow_batch_seconds,
)

__all__ = ["JsonFormatter", "configure", "reset"]

_LOGGER = "asyncstate"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, event and the
    event's fields (values JSON cannot hold are written as their repr)."""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "asyncstate_fields", None) or {}
        entry: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": getattr(record, "asyncstate_event", record.getMessage()),
        }
        for key, value in fields.items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return _json.dumps(entry, default=repr, ensure_ascii=False)


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler `configure` installs; writes to the stream it was given, or to whatever
    sys.stderr is at each write."""

    def __init__(self, stream: TextIO | None) -> None:
        logging.Handler.__init__(self)
        self._given = stream

    @property
    def stream(self) -> Any:
        return self._given if self._given is not None else sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        self._given = value


def _installed() -> list[logging.Handler]:
    return [h for h in logging.getLogger(_LOGGER).handlers if isinstance(h, _Handler)]


def configure(*, json: bool = False, level: str = "info", stream: TextIO | None = None,
              slow_batch_ms: float | None = None) -> logging.Handler:
    """Write asyncstate's events at `level` ("debug", "info", "warning", "error") and above
    to `stream` (default: stderr), one line each: ``time level logger: event key=value ...``,
    or a JSON object with `json=True`. `slow_batch_ms`: log ``controller.slow_batch`` for a
    batch whose round trip takes at least this long (controllers created afterwards;
    default 1000). Returns the handler, already installed on the ``asyncstate`` logger."""
    # Every argument is checked before anything changes.
    if slow_batch_ms is not None and (
            isinstance(slow_batch_ms, bool) or not isinstance(slow_batch_ms, (int, float))
            or not slow_batch_ms >= 0):
        raise ConfigError("slow_batch_ms", slow_batch_ms, "a number >= 0")
    parse_level(level)
    if slow_batch_ms is not None:
        set_slow_batch_seconds(slow_batch_ms / 1000.0)
    set_level(level)
    reset(keep_level=True)
    _enable_loggers()
    handler = _Handler(stream)
    handler.setFormatter(JsonFormatter() if json else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger(_LOGGER).addHandler(handler)
    return handler


def _enable_loggers() -> None:
    """Enable asyncstate's loggers again: `logging.config.dictConfig` disables the loggers
    that exist when it runs unless its configuration names them."""
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) \
                and (name == _LOGGER or name.startswith(_LOGGER + ".")):
            logger.disabled = False


def reset(*, keep_level: bool = False) -> None:
    """Remove the handler `configure` installed and, unless `keep_level`, go back to the
    defaults (warnings and above, slow batches from 1000 ms)."""
    logger = logging.getLogger(_LOGGER)
    for handler in _installed():
        logger.removeHandler(handler)
    if not keep_level:
        set_level("warning")
        set_slow_batch_seconds(DEFAULT_SLOW_BATCH_SECONDS)
