"""asyncstate.log: events reach the standard `logging` module, warnings and above by
default, on stderr when the application configured no handler, never on stdout."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from shared_functions import run_python

import asyncstate as ast
import asyncstate.log as aslog

ROOT = Path(__file__).resolve().parent.parent

# A job whose record fails and whose close() fails too: the operator raises the record's
# error and logs the close failure as the warning `operator.close_failed`.
_FAILING_JOB = """
import asyncstate as ast

class RecordError(Exception):
    pass

class CloseFails(ast.KeyedProcessFunction):
    def open(self, ctx):
        self.seen = ctx.get_state(ast.ValueStateDescriptor("seen"))

    async def process_element(self, value, ctx):
        await self.seen.update(value)
        raise RecordError("bad record " + str(value))

    def close(self):
        raise RuntimeError("close broke")

def run_failing_job():
    try:
        ast.run(CloseFails(), [1], key_selector=lambda r: r)
    except RecordError:
        return
    raise SystemExit("the job did not fail with its record's error")
"""


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "ASYNCSTATE_LOG_LEVEL"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_FAILING_JOB) + textwrap.dedent(code)],
        cwd=ROOT, env={**environ, **env}, capture_output=True, text=True, timeout=60,
        check=False)


def _close_failed_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "operator.close_failed" in line]


@pytest.fixture
def _restore_log_level() -> Iterator[None]:
    saved = aslog._threshold
    logger = logging.getLogger("asyncstate")
    saved_level = logger.level
    yield
    aslog._threshold = saved
    logger.setLevel(saved_level)


# -- a program that configures no logging -------------------------------------------------


@pytest.mark.timeout(60)
def test_close_failure_warning_goes_to_stderr_never_stdout() -> None:
    proc = _python("run_failing_job()")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    [line] = _close_failed_lines(proc.stderr)
    assert line.startswith("WARNING asyncstate.operator: operator.close_failed error=")
    assert "close broke" in line
    assert "bad record 1" in line  # while_raising: the error the run raised


@pytest.mark.timeout(60)
def test_env_level_debug_shows_lifecycle_events_on_stderr() -> None:
    proc = _python("run_failing_job()", ASYNCSTATE_LOG_LEVEL="debug")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert any(line.startswith("DEBUG asyncstate.operator: operator.open function=CloseFails")
               for line in proc.stderr.splitlines()), proc.stderr
    assert len(_close_failed_lines(proc.stderr)) == 1


@pytest.mark.timeout(60)
def test_default_level_drops_debug_events() -> None:
    proc = _python("run_failing_job()")
    assert "operator.open" not in proc.stderr


@pytest.mark.timeout(60)
def test_set_level_in_code_lowers_the_level() -> None:
    proc = _python("import asyncstate.log\nasyncstate.log.set_level('debug')\n"
                   "run_failing_job()")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert "DEBUG asyncstate.operator: operator.open" in proc.stderr


# -- a program with its own logging configuration -----------------------------------------


@pytest.mark.timeout(60)
def test_application_handlers_receive_events_once() -> None:
    proc = _python("""
        import logging, sys
        logging.basicConfig(stream=sys.stdout, format="APP %(levelname)s %(name)s %(message)s")
        run_failing_job()
        """)
    assert proc.returncode == 0, proc.stderr
    # The application chose stdout for its own handler: the event goes there, once, and
    # asyncstate's own stderr fallback stays silent.
    [line] = _close_failed_lines(proc.stdout)
    assert line.startswith("APP WARNING asyncstate.operator operator.close_failed error=")
    assert _close_failed_lines(proc.stderr) == []


@pytest.mark.timeout(60)
def test_set_level_reaches_past_the_application_root_level() -> None:
    proc = _python("""
        import logging
        logging.basicConfig(level=logging.WARNING, format="APP %(levelname)s %(message)s")
        import asyncstate.log
        asyncstate.log.set_level("debug")
        run_failing_job()
        """)
    assert proc.returncode == 0, proc.stderr
    assert "APP DEBUG operator.open function=CloseFails" in proc.stderr


@pytest.mark.timeout(60)
def test_application_level_for_asyncstate_filters_warnings() -> None:
    proc = _python("""
        import logging
        logging.basicConfig(format="APP %(levelname)s %(message)s")
        logging.getLogger("asyncstate").setLevel(logging.ERROR)
        run_failing_job()
        """)
    assert proc.returncode == 0, proc.stderr
    assert "operator.close_failed" not in proc.stderr + proc.stdout


class _RecordError(Exception):
    pass


class _CloseFails(ast.KeyedProcessFunction):
    def open(self, ctx: ast.RuntimeContext) -> None:
        self.seen = ctx.get_state(ast.ValueStateDescriptor("seen"))

    async def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
        await self.seen.update(value)
        raise _RecordError(f"bad record {value}")

    def close(self) -> None:
        raise RuntimeError("close broke")


def test_caplog_receives_the_close_failure_with_its_fields(
        caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(_RecordError) as info:
        ast.run(_CloseFails(), [7], key_selector=lambda r: r)
    assert str(info.value) == "bad record 7"
    [record] = [r for r in caplog.records if r.asyncstate_event == "operator.close_failed"]
    assert record.name == "asyncstate.operator"
    assert record.levelno == logging.WARNING
    assert record.asyncstate_fields == {"error": "RuntimeError('close broke')",
                                        "while_raising": "_RecordError('bad record 7')"}
    assert record.getMessage() == ("operator.close_failed error=\"RuntimeError('close broke')\""
                                   " while_raising=\"_RecordError('bad record 7')\"")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "close_failed" not in captured.err  # caplog's handler took it: no fallback line


@pytest.mark.usefixtures("_restore_log_level")
def test_record_points_at_the_asyncstate_call_site(caplog: pytest.LogCaptureFixture) -> None:
    aslog.set_level("debug")
    aslog.get_logger("asyncstate.test").debug("probe.event", n=1)
    [record] = [r for r in caplog.records if r.name == "asyncstate.test"]
    assert record.pathname == __file__
    assert record.funcName == "test_record_points_at_the_asyncstate_call_site"


@pytest.mark.usefixtures("_restore_log_level")
@pytest.mark.parametrize(("value", "shown"), [
    ("plain", "plain"),
    ("two words", "'two words'"),
    ("a=b", "'a=b'"),
    ("", "''"),
    (3, "3"),
    (0.5, "0.5"),
    (None, "None"),
    ([1, "x"], "[1, 'x']"),
])
def test_fields_render_as_key_value(value: Any, shown: str,
                                    caplog: pytest.LogCaptureFixture) -> None:
    aslog.set_level("info")
    aslog.get_logger("asyncstate.test").info("probe.event", field=value, n=1)
    [record] = [r for r in caplog.records if r.name == "asyncstate.test"]
    assert record.getMessage() == f"probe.event field={shown} n=1"
    assert record.asyncstate_fields == {"field": value, "n": 1}


@pytest.mark.usefixtures("_restore_log_level")
def test_an_application_structlog_configuration_does_not_filter_events(
        caplog: pytest.LogCaptureFixture) -> None:
    import structlog

    # An application that filters its own structlog events at error level still gets
    # asyncstate's warnings through logging.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    try:
        aslog.get_logger("asyncstate.test").warning("probe.warning")
    finally:
        structlog.reset_defaults()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncstate.test"] == [
        "probe.warning"]


# -- the level setting ----------------------------------------------------------------------


@pytest.mark.usefixtures("_restore_log_level")
@pytest.mark.parametrize("bad", ["bogus", "", " debug", "warnings", 10, None, logging.DEBUG])
def test_set_level_refuses_unknown_levels_with_config_error(bad: Any) -> None:
    # ("warn" is "warning", as in logging: tested with the environment variable.)
    before = aslog._threshold
    with pytest.raises(ast.ConfigError) as info:
        aslog.set_level(bad)
    assert isinstance(info.value, ValueError)
    assert info.value.option == "log level"
    assert "debug" in str(info.value)
    assert aslog._threshold == before  # a refused level changes nothing


@pytest.mark.usefixtures("_restore_log_level")
def test_set_level_is_case_insensitive_idempotent_and_filters(
        caplog: pytest.LogCaptureFixture) -> None:
    log = aslog.get_logger("asyncstate.adversarial")
    aslog.set_level("ERROR")
    aslog.set_level("error")
    caplog.set_level(logging.DEBUG)
    log.debug("d")
    log.info("i")
    log.warning("w")
    log.error("e", field=1)
    logs = [r for r in caplog.records if r.name == "asyncstate.adversarial"]
    assert [(r.asyncstate_event, r.levelname) for r in logs] == [("e", "ERROR")]
    assert logs[0].asyncstate_fields == {"field": 1}
    caplog.clear()
    aslog.set_level("Debug")
    log.debug("d")
    assert [r.asyncstate_event for r in caplog.records] == ["d"]


@pytest.mark.timeout(60)
def test_library_does_not_configure_structlog_or_logging() -> None:
    code = """
    import logging, structlog
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    import asyncstate as ast, asyncstate.log as aslog
    aslog.set_level("debug")
    class F(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.s = ctx.get_state(ast.ValueStateDescriptor("s"))
        async def process_element(self, v, ctx):
            await self.s.update(v)
    ast.run(F(), [1, 2], key_selector=lambda r: r)
    assert not structlog.is_configured(), "structlog was configured"
    assert root.handlers == handlers and root.level == level, "logging root changed"
    print("OK")
    """
    proc = run_python(code, pure=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "OK" in proc.stdout


@pytest.mark.timeout(60)
def test_invalid_log_level_env_var_fails_import_with_config_error() -> None:
    code = """
    import os
    os.environ["ASYNCSTATE_LOG_LEVEL"] = "bogus"
    try:
        import asyncstate
    except ValueError as exc:
        print("REFUSED", type(exc).__name__, exc)
    """
    proc = run_python(code, pure=False)
    assert "REFUSED ConfigError environment variable ASYNCSTATE_LOG_LEVEL must be one of" \
        in proc.stdout, proc.stderr[-2000:]


@pytest.mark.timeout(60)
def test_empty_log_level_env_var_means_default() -> None:
    code = """
    import os
    os.environ["ASYNCSTATE_LOG_LEVEL"] = ""
    import asyncstate.log as aslog
    print("THRESHOLD", aslog._threshold)
    """
    proc = run_python(code, pure=False)
    assert "THRESHOLD 30" in proc.stdout, proc.stderr[-2000:]
