"""asyncstate.log: the level setting and the rule that the library configures no logging."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from shared_functions import run_python
from structlog.testing import capture_logs

import asyncstate as ast
import asyncstate.log as aslog


@pytest.fixture
def _restore_log_level() -> Iterator[None]:
    saved = aslog._threshold
    yield
    aslog._threshold = saved


@pytest.mark.usefixtures("_restore_log_level")
@pytest.mark.parametrize("bad", ["bogus", "", " debug", "warn", 10, None, logging.DEBUG])
def test_set_level_refuses_unknown_levels_with_config_error(bad: Any) -> None:
    before = aslog._threshold
    with pytest.raises(ast.ConfigError) as info:
        aslog.set_level(bad)
    assert isinstance(info.value, ValueError)
    assert info.value.option == "log level"
    assert "debug" in str(info.value)
    assert aslog._threshold == before  # a refused level changes nothing


@pytest.mark.usefixtures("_restore_log_level")
def test_set_level_is_case_insensitive_idempotent_and_filters() -> None:
    log = aslog.get_logger("asyncstate.adversarial")
    aslog.set_level("ERROR")
    aslog.set_level("error")
    with capture_logs() as logs:
        log.debug("d")
        log.info("i")
        log.warning("w")
        log.error("e", field=1)
    assert [(e["event"], e["log_level"]) for e in logs] == [("e", "error")]
    assert logs[0]["field"] == 1
    aslog.set_level("Debug")
    with capture_logs() as logs:
        log.debug("d")
    assert [e["event"] for e in logs] == ["d"]


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
    assert "REFUSED ConfigError log level must be one of" in proc.stdout, proc.stderr[-2000:]


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
