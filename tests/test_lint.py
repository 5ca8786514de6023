"""The sources are ruff clean and the package is mypy --strict clean (pyproject.toml holds
both configurations). Run once, in the compiled pass: the sources are the same in both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    os.environ.get("ASYNCSTATE_PURE_PYTHON", "") not in ("", "0"),
    reason="the sources are linted once, in the compiled pass")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=False)


def test_ruff_finds_nothing() -> None:
    done = _run("ruff", "check", "asyncstate", "tests", "scripts")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.timeout(600)
def test_mypy_strict_finds_nothing_in_the_package(tmp_path: Path) -> None:
    done = _run("mypy", "--cache-dir", str(tmp_path / "mypy-cache"))
    assert done.returncode == 0, done.stdout + done.stderr
