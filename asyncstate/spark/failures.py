"""Exceptions of user code, carried from a Spark partition to the driver intact.

Spark reports a failed Python task to the driver as text: the worker's traceback inside a
Java exception (`Py4JJavaError`, or PySpark's `PythonException`), so the user's exception type
is lost and the first lines are PySpark's worker frames, or a Java stack. The bridge fixes
both ends:

- in the partition, `carry` turns an exception into a `PartitionFailure` whose message starts
  with the original ``Type: message`` and ends with the original exception, pickled (with the
  partition's traceback as a note), on one marked line;
- on the driver, `install_driver_hook` wraps py4j's return-value function, as PySpark's own SQL
  exception handler does, so that an action failing because of such a partition raises the
  original exception (type, attributes, message and the worker traceback as a note). Failures
  of anything else pass through untouched.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import pickle
import re
import socket
import traceback
from collections.abc import Callable
from typing import Any

from asyncstate.errors import AsyncStateError
from asyncstate.log import get_logger

__all__ = ["PartitionFailure", "carry", "carry_from_task", "install_driver_hook", "rebuild"]

log = get_logger("asyncstate.spark")

_MARK = "asyncstate-exception"
_PAYLOAD_RE = re.compile(r"\[" + _MARK + r":([A-Za-z0-9+/=]+)\]")
_MAX_PAYLOAD = 1 << 20  # bytes of pickle carried; a larger exception travels as text only
_HOOK_FLAG = "_asyncstate_partition_failures"


class PartitionFailure(Exception):
    """What a bridge partition raises in the worker for an exception of user code (or of
    asyncstate): its first line is the original ``Type: message``, its last the original
    exception, pickled. The driver hook turns it back into the original exception."""


def _pickle(exc: BaseException, note: str) -> bytes | None:
    try:
        from pyspark import cloudpickle  # by value for classes of __main__ and closures
        data: bytes = cloudpickle.dumps((exc, note))  # type: ignore[no-untyped-call]
        pickle.loads(data)
    except Exception as err:  # noqa: BLE001 - anything unpicklable travels as text only
        stand_in = _builtin_stand_in(exc)
        if stand_in is None:
            log.warning("spark.exception_not_picklable", type=type(exc).__name__,
                        error=repr(err))
            return None
        # An exception that pickles but does not unpickle (PySpark's own errors take their
        # message apart in __init__): its nearest builtin class, with its message, stands in.
        return _pickle(stand_in, f"{note}\n(a {type(exc).__qualname__}, which does not "
                                 f"unpickle: {type(err).__name__}: {err})")
    return data if len(data) <= _MAX_PAYLOAD else None


def _builtin_stand_in(exc: BaseException) -> BaseException | None:
    """An instance of `exc`'s nearest builtin exception class (its own, if builtin) made of
    its arguments, or of its message, that survives pickling; None if there is none."""
    for cls in type(exc).__mro__:
        if cls.__module__ != "builtins" or not issubclass(cls, Exception):
            continue
        for args in (exc.args, (str(exc),)):
            try:
                stand_in = cls(*args)
                pickle.loads(pickle.dumps(stand_in))
            except Exception:  # noqa: BLE001 - the next form, or the next class
                continue
            return stand_in
    return None


def carry(exc: Exception, *, partition: int, attempt: int, stage: int | None,
          doing: str = "") -> PartitionFailure:
    """A PartitionFailure carrying `exc` to the driver (raise it `from exc`); `doing` says
    what the task was doing, when not running the function ("while routing records").

    Tracebacks are not pickled (nor, by every exception type, notes): the partition, attempt,
    host and the traceback in the worker travel beside `exc`, and the driver adds them to it
    as a note.
    """
    where = (f"raised {doing + ' ' if doing else ''}in Spark partition {partition} "
             f"(attempt {attempt}"
             + (f", stage {stage}" if stage is not None else "")
             + f") on host {socket.gethostname()}")
    worker_tb = "".join(traceback.format_exception(exc)).rstrip()
    data = _pickle(exc, f"{where}; traceback in the worker:\n{worker_tb}")
    head = f"{type(exc).__qualname__}: {exc}".splitlines()[0] if str(exc) else \
        type(exc).__qualname__
    text = f"{head} ({where})"
    if data is not None:
        text += f"\n[{_MARK}:{base64.b64encode(data).decode('ascii')}]"
    return PartitionFailure(text)


def carry_from_task(exc: Exception, doing: str) -> PartitionFailure:
    """`carry` for code running in a Spark task outside a bridge partition (the routing of
    records before the shuffle): the partition and attempt are the running task's."""
    from pyspark import TaskContext

    tc = TaskContext.get()
    if tc is None:
        return carry(exc, partition=-1, attempt=0, stage=None, doing=doing)
    return carry(exc, partition=tc.partitionId(), attempt=tc.attemptNumber(),
                 stage=tc.stageId(), doing=doing)


def rebuild(error: BaseException) -> BaseException | None:
    """The exception a bridge partition carried inside `error` (a failed Spark action on the
    driver), or None when `error` does not come from one.

    When the carried exception cannot be unpickled on the driver (its class is not importable
    there), an AsyncStateError with its type, message and the reason stands in for it.
    """
    text = str(error)
    java = getattr(error, "java_exception", None)
    if _MARK not in text and java is not None:
        try:
            text = str(java.toString())
        except Exception:  # noqa: BLE001 - a dead gateway: nothing to rebuild from
            return None
    match = _PAYLOAD_RE.search(text)
    if match is None:
        return None
    try:
        # The job's own executors pickled it, as they pickle every result.
        rebuilt, note = pickle.loads(base64.b64decode(match[1]))
    except (binascii.Error, pickle.UnpicklingError, ImportError, AttributeError, EOFError,
            TypeError, ValueError) as err:
        first = text[:match.start()].rstrip().splitlines()
        summary = first[-1] if first else "an exception"
        return AsyncStateError(
            f"user code in a Spark partition raised {summary}; it cannot be rebuilt on the "
            f"driver ({type(err).__name__}: {err}): make its class importable on the driver")
    if not isinstance(rebuilt, BaseException):
        return None
    with contextlib.suppress(AttributeError, TypeError):  # a type refusing attributes
        rebuilt.add_note(note)
    return rebuilt


def _hooked(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_return_value(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except Exception as error:
            rebuilt = rebuild(error)
            if rebuilt is None:
                raise
            # The Spark error stays reachable as __context__, but is not printed first.
            raise rebuilt from None

    setattr(get_return_value, _HOOK_FLAG, True)
    return get_return_value


def install_driver_hook() -> None:
    """Make failed Spark actions raise the exceptions that bridge partitions carried.

    Idempotent. Wraps the function py4j's gateway calls (PySpark's SQL handler, if installed,
    stays inside) and py4j's original, which PySpark wraps again whenever a SparkSession is
    created, so the hook survives sessions created later."""
    import py4j.java_gateway
    import py4j.protocol

    for module in (py4j.protocol, py4j.java_gateway):
        current = module.get_return_value
        if not getattr(current, _HOOK_FLAG, False):
            module.get_return_value = _hooked(current)
