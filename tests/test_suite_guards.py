"""The suite's own guards: a hung test ends the run, whatever loop it hangs on."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_HUNG_TESTS = {
    "asyncio": '''
import asyncio


async def test_waits_forever():
    await asyncio.get_running_loop().create_future()
''',
    "uvloop": '''
import asyncio


async def test_waits_forever():
    await asyncio.get_running_loop().create_future()
''',
    # A plain test that runs a job on uvloop itself, as ast.run does.
    "sync-uvloop": '''
import asyncio

import uvloop


def test_waits_forever():
    async def forever():
        await asyncio.get_running_loop().create_future()

    uvloop.run(forever())
''',
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", sorted(_HUNG_TESTS))
def test_a_hung_test_times_out(tmp_path: Path, case: str) -> None:
    # uvloop reports what a signal handler raises to its exception handler, so the SIGALRM
    # method of pytest-timeout cannot end a test hung on uvloop: the suite's configuration
    # (pyproject.toml) uses the thread method, read here from the project's own file.
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for name in ("conftest.py", "shared_functions.py"):
        shutil.copy(ROOT / "tests" / name, tmp_path / name)
    (tmp_path / "test_hung.py").write_text(_HUNG_TESTS[case])
    select = {"asyncio": "not uvloop", "uvloop": "uvloop", "sync-uvloop": "test_waits"}[case]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "timeout=2",
         "-o", "addopts=", "-k", select, "test_hung.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "+ Timeout +" in output, output
    assert "Stack of MainThread" in output, output
