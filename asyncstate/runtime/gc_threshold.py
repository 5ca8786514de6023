"""Raising the cyclic garbage collector's first threshold while operators run.

Records in flight keep their contexts, futures, requests and coroutines alive across
batches: about ten container objects per record, tens of thousands at a time. With CPython's
default first threshold (700 allocations) every young collection finds them alive and
promotes them, and the promotions soon trigger full collections, which walk every object of
the process (the job's own data included). A higher first threshold makes both rare. Each
young collection still walks every record in flight, so `AsyncStateConfig`'s "auto"
threshold grows with max_in_flight. (The figures are in docs/performance.md.)

Each open operator holds a request (`AsyncStateConfig.gc_threshold`); the threshold is the
largest request, never below what was set before the first request, and the thresholds found
then are restored when the last request is released. Only the first threshold changes: the
collector still runs, so reference cycles are still freed.
"""

from __future__ import annotations

import gc
import threading

from asyncstate.log import get_logger

__all__ = ["hold", "release"]

log = get_logger("asyncstate.gc")

_lock = threading.Lock()
_requests: list[int] = []
_saved: tuple[int, int, int] | None = None


def hold(threshold: int) -> None:
    """Request a first threshold of at least `threshold` until `release(threshold)`."""
    global _saved
    with _lock:
        if not _requests:
            _saved = gc.get_threshold()
        _requests.append(threshold)
        try:
            _apply()
        except BaseException:
            # The collector refused it (not a C int): withdraw the request, so that it
            # cannot break every later operator's hold.
            _requests.remove(threshold)
            if not _requests:
                _saved = None
            raise


def release(threshold: int) -> None:
    """Withdraw one `hold(threshold)`; the last release restores the saved thresholds."""
    global _saved
    with _lock:
        _requests.remove(threshold)
        if _requests:
            _apply()
        elif _saved is not None:
            gc.set_threshold(*_saved)
            log.debug("gc.threshold_restored", thresholds=_saved)
            _saved = None


def _apply() -> None:
    assert _saved is not None
    first, second, third = _saved
    wanted = max(first, *_requests)
    if gc.get_threshold()[0] != wanted:
        gc.set_threshold(wanted, second, third)
        log.debug("gc.threshold_raised", first=wanted, saved=_saved)
