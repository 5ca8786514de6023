"""asyncstate.logging.configure: asyncstate's events as text or JSON lines at a chosen level,
lifecycle, checkpoint, slow-batch and failure events, quiet by default."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import logging.config
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from shared_functions import Counter

import asyncstate as ast
import asyncstate.log as aslog
import asyncstate.logging as aslogging
from asyncstate.testing import ManualExecutor

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _back_to_defaults() -> Iterator[None]:
    yield
    aslogging.reset()


def _events(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_time_level_logger_event_and_fields():
    stream = io.StringIO()
    aslogging.configure(json=True, level="debug", stream=stream)
    ast.run(Counter(), [1, 2, 1], key_selector=lambda r: r)
    events = [e for e in _events(stream) if e["logger"] == "asyncstate.operator"]
    assert [e["event"] for e in events] == ["operator.open", "operator.closed"]
    opened, closed = events
    assert opened["level"] == "debug"
    assert opened["function"] == "Counter" and opened["backend"] == "HeapBackend"
    assert opened["time"].endswith("+00:00")
    assert (closed["records"], closed["failed"]) == (3, False)


def test_text_lines_name_the_event_and_its_fields():
    stream = io.StringIO()
    aslogging.configure(level="debug", stream=stream)
    ast.run(Counter(), [1], key_selector=lambda r: r)
    lines = [line for line in stream.getvalue().splitlines() if "asyncstate.operator:" in line]
    assert len(lines) == 2
    assert " DEBUG asyncstate.operator: operator.open function=Counter index=0 " in lines[0]
    assert " DEBUG asyncstate.operator: operator.closed function=Counter " in lines[1]


def test_the_level_filters_events():
    stream = io.StringIO()
    aslogging.configure(level="info", stream=stream)
    ast.run(Counter(), [1], key_selector=lambda r: r)
    assert stream.getvalue() == ""  # open and close are debug events


def test_checkpoints_are_logged(tmp_path):
    stream = io.StringIO()
    aslogging.configure(json=True, level="info", stream=stream)
    ast.run(Counter(), [1, 2], key_selector=lambda r: r, checkpoint_dir=tmp_path,
            checkpoint_id=1)
    ast.run(Counter(), [1], key_selector=lambda r: r,
            restore_from=ast.checkpoint_path(tmp_path, 1))
    events = [e["event"] for e in _events(stream)]
    assert events.count("checkpoint.part_written") == 1
    assert events.count("checkpoint.restored") == 1


def test_slow_batches_are_logged_from_the_threshold():
    stream = io.StringIO()
    aslogging.configure(json=True, level="warning", stream=stream, slow_batch_ms=0)
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0)
    outputs = ast.run(Counter(), list(range(10)), key_selector=lambda r: r, backend=backend,
                      config=ast.AsyncStateConfig(batch_size=5))
    assert len(outputs) == 10
    slow = [e for e in _events(stream) if e["event"] == "controller.slow_batch"]
    assert len(slow) == 4  # 10 reads, then 10 writes, in batches of 5: every one is slow
    assert sum(e["requests"] for e in slow) == 20
    assert all(e["level"] == "warning" and e["threshold_seconds"] == 0 for e in slow)


def test_a_failure_is_logged_and_still_raised():
    stream = io.StringIO()
    aslogging.configure(json=True, level="info", stream=stream)
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0, fail_on_call=1)
    with pytest.raises(ast.InjectedFailure):
        ast.run(Counter(), [1], key_selector=lambda r: r, backend=backend)
    events = _events(stream)
    [failed] = [e for e in events if e["event"] == "operator.failed"]
    assert failed["error"].startswith("InjectedFailure(")
    assert failed["level"] == "info" and failed["function"] == "Counter"


def test_configure_again_replaces_the_handler_and_reset_removes_it():
    first, second = io.StringIO(), io.StringIO()
    aslogging.configure(level="debug", stream=first)
    aslogging.configure(level="debug", stream=second)
    ast.run(Counter(), [1], key_selector=lambda r: r)
    written = second.getvalue()
    assert first.getvalue() == "" and "operator.closed" in written
    aslogging.reset()
    ast.run(Counter(), [1], key_selector=lambda r: r)
    assert second.getvalue() == written


@pytest.mark.parametrize("option, value", [("level", "loud"), ("slow_batch_ms", -1)])
def test_bad_options_are_refused(option, value):
    with pytest.raises(ast.ConfigError, match=option.replace("level", "log level")):
        aslogging.configure(**{option: value})


@pytest.mark.timeout(60)
def test_quiet_by_default_and_never_on_stdout():
    code = textwrap.dedent("""
        import asyncstate as ast
        class C(ast.KeyedProcessFunction):
            def open(self, ctx):
                self.n = ctx.get_state(ast.ValueStateDescriptor("n"))
            def process_element(self, v, ctx):
                return self.n.update(v)
        ast.run(C(), [1, 2], key_selector=lambda r: r)
        import asyncstate.logging
        asyncstate.logging.configure(level="debug")
        ast.run(C(), [1, 2], key_selector=lambda r: r)
    """)
    environ = {k: v for k, v in os.environ.items() if k != "ASYNCSTATE_LOG_LEVEL"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    # Only the second run, after configure(), wrote anything.
    assert lines and all(" asyncstate." in line for line in lines)
    assert sum("operator.open" in line for line in lines) == 1


class _ReadOnce(ast.KeyedProcessFunction):
    """One read per record, nothing written: one batch per record with batch_size 1."""

    def open(self, ctx):
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    async def process_element(self, value, ctx):
        ctx.emit(await self.v.value())


class _Signal(logging.Handler):
    """Sets `event` when asyncstate logs `name`."""

    def __init__(self, name: str, event: asyncio.Event) -> None:
        super().__init__()
        self.name_, self.event = name, event

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().split(" ", 1)[0] == self.name_:
            self.event.set()


@pytest.mark.timeout(30)
async def test_a_batch_under_way_is_reported_when_it_reaches_the_threshold():
    stream = io.StringIO()
    aslogging.configure(json=True, level="info", stream=stream, slow_batch_ms=30)
    reported = asyncio.Event()
    signal = _Signal("controller.slow_batch", reported)
    logging.getLogger("asyncstate").addHandler(signal)
    executor = ManualExecutor()
    try:
        async with ast.KeyedOperator(_ReadOnce(), key_selector=lambda r: r, backend=executor,
                                     config=ast.AsyncStateConfig(batch_size=1)) as op:
            await op.process(1)
            # The read's batch sits in the executor, never delivered until reported.
            await asyncio.wait_for(reported.wait(), 10)
            assert op.metrics["slow_batches"] == 1
            assert op.metrics["batches_in_executor"] == 1
            executor.complete_all()
            await op.drain()
            m = op.metrics
    finally:
        logging.getLogger("asyncstate").removeHandler(signal)
    events = _events(stream)
    slow = [e for e in events if e["event"] == "controller.slow_batch"]
    assert len(slow) == 1 and m["slow_batches"] == 1  # counted once, not again at delivery
    assert slow[0]["under_way"] is True and slow[0]["requests"] == 1
    assert slow[0]["seconds"] >= 0.03 and slow[0]["threshold_seconds"] == 0.03
    [delivered] = [e for e in events if e["event"] == "controller.slow_batch_delivered"]
    assert delivered["seconds"] >= slow[0]["seconds"] and delivered["level"] == "info"


def test_configure_changes_nothing_when_an_argument_is_bad():
    aslogging.configure(slow_batch_ms=500, level="info")
    with pytest.raises(ast.ConfigError, match="log level"):
        aslogging.configure(slow_batch_ms=5, level="bogus")
    assert aslog.slow_batch_seconds() == 0.5
    assert aslog.get_level() == "info"


def test_configure_enables_loggers_that_dict_config_disabled():
    logging.getLogger("asyncstate.operator")  # exists, as after any run
    # dictConfig changes every logger of the process: put them back for the other tests.
    root = logging.getLogger()
    saved = (root.level, list(root.handlers),
             {name: logger.disabled for name, logger in logging.Logger.manager.loggerDict.items()
              if isinstance(logger, logging.Logger)})
    logging.config.dictConfig({"version": 1, "root": {"level": "WARNING"}})
    try:
        assert logging.getLogger("asyncstate.operator").disabled
        stream = io.StringIO()
        aslogging.configure(level="debug", stream=stream)
        ast.run(Counter(), [1], key_selector=lambda r: r)
        assert "operator.closed" in stream.getvalue()
    finally:
        level, handlers, disabled = saved
        root.setLevel(level)
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        for name, was in disabled.items():
            logging.getLogger(name).disabled = was


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value, ok", [("WARN", True), ("Debug", True), ("loud", False)])
def test_the_environment_level_is_checked_and_named(value, ok):
    environ = {**os.environ, "ASYNCSTATE_LOG_LEVEL": value}
    code = "import asyncstate.log as log; print(log.get_level())"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT.parent, env=environ,
                          capture_output=True, text=True, timeout=60)
    if ok:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == ("warning" if value == "WARN" else "debug")
    else:
        assert proc.returncode != 0
        assert "ASYNCSTATE_LOG_LEVEL" in proc.stderr and "'loud'" in proc.stderr
