"""The suite's own guards: a hung async test ends the run on every event loop."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_HUNG_TEST = '''
import asyncio


async def test_waits_forever():
    await asyncio.get_running_loop().create_future()
'''


@pytest.mark.timeout(180)
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_hung_async_test_times_out(tmp_path: Path, loop: str) -> None:
    # uvloop reports what a signal handler raises to its exception handler, so the default
    # SIGALRM method of pytest-timeout cannot end a test hung on uvloop; tests/conftest.py
    # switches those tests to the thread method.
    shutil.copy(Path(__file__).parent / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"
        "timeout = 2\n")
    (tmp_path / "test_hung.py").write_text(_HUNG_TEST)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    # Every async test carries the asyncio marker, so `-k asyncio` would select both.
    select = "uvloop" if loop == "uvloop" else "not uvloop"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", select,
         "test_hung.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    if loop == "asyncio":
        # The SIGALRM method fails the one test, and the session goes on to report it.
        assert "FAILED test_hung.py::test_waits_forever[asyncio] - Failed: Timeout" in output, \
            output
    else:
        # The thread method dumps every stack and ends the session.
        assert "+ Timeout +" in output, output
        assert "Stack of MainThread" in output, output
