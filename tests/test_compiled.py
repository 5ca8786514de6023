"""Choosing between the compiled hot-path modules and their Python sources (_compiled.py).

`scripts/test.sh` runs the whole suite twice: once on the compiled modules and once with
ASYNCSTATE_PURE_PYTHON=1; it sets ASYNCSTATE_EXPECT_IMPLEMENTATION so that a build that
silently fell back to the sources fails here instead of testing one implementation twice.
"""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import asyncstate
from asyncstate import _compiled

ROOT = Path(asyncstate.__file__).resolve().parent.parent
PROBE = (
    "import warnings, sys\n"
    "warnings.simplefilter('always')\n"
    "with warnings.catch_warnings(record=True) as seen:\n"
    "    import asyncstate, asyncstate._compiled as c\n"
    "    import asyncstate.runtime.future as f\n"
    "print(c.mode())\n"
    "print(f.__file__)\n"
    "for w in seen:\n"
    "    print('WARNING', w.category.__name__, w.message)\n"
)


def is_extension(path: str | None) -> bool:
    return path is not None and path.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def probe(root: Path, **env: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if k != _compiled.PURE_PYTHON_ENV}
    environ.update(env)
    environ["PYTHONPATH"] = str(root)
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=root, env=environ,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return out.splitlines()


def copy_checkout(tmp_path: Path) -> Path:
    """The package and its compiled group library, copied to a directory of their own."""
    copy = tmp_path / "checkout"
    copy.mkdir()
    # Without bytecode caches: the suite's other pass may be writing them meanwhile.
    shutil.copytree(ROOT / "asyncstate", copy / "asyncstate",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for lib in ROOT.glob("asyncstate__mypyc*"):
        shutil.copy2(lib, copy / lib.name)
    return copy


def compiled_build_present() -> bool:
    return _compiled._extension_path("asyncstate.runtime.future") is not None


needs_build = pytest.mark.skipif(not compiled_build_present(),
                                 reason="no compiled build in this checkout")


def test_every_listed_module_runs_in_the_chosen_implementation() -> None:
    mode = _compiled.mode()
    for name in _compiled.COMPILED_MODULES:
        module = sys.modules.get(name) or __import__(name, fromlist=["_"])
        assert is_extension(module.__file__) == (mode == "compiled"), (name, module.__file__)


def test_the_expected_implementation_runs() -> None:
    expected = os.environ.get("ASYNCSTATE_EXPECT_IMPLEMENTATION")
    if expected is None:
        pytest.skip("ASYNCSTATE_EXPECT_IMPLEMENTATION is not set (scripts/test.sh sets it)")
    assert _compiled.mode() == expected


@needs_build
def test_pure_python_switch_loads_the_sources_without_a_warning() -> None:
    lines = probe(ROOT, ASYNCSTATE_PURE_PYTHON="1")
    assert lines[0] == "python"
    assert lines[1].endswith(os.path.join("runtime", "future.py"))
    assert not [line for line in lines if line.startswith("WARNING")]


@needs_build
def test_an_edited_source_is_never_shadowed_by_its_stale_compiled_module(
        tmp_path: Path) -> None:
    copy = copy_checkout(tmp_path)
    assert probe(copy)[0] == "compiled"

    source = copy / "asyncstate" / "runtime" / "controller.py"
    source.write_text(source.read_text() + "\n# edited after the build\n")
    lines = probe(copy)
    assert lines[0] == "python"
    assert lines[1].endswith(os.path.join("runtime", "future.py"))
    [warning] = [line for line in lines if line.startswith("WARNING")]
    assert warning.startswith("WARNING RuntimeWarning asyncstate runs its Python sources")
    assert "asyncstate.runtime.controller was edited after it was compiled" in warning
    assert "pip install -e ." in warning


@needs_build
def test_a_missing_stamp_falls_back_to_the_sources(tmp_path: Path) -> None:
    copy = copy_checkout(tmp_path)
    (copy / "asyncstate" / _compiled.STAMP_NAME).unlink()
    lines = probe(copy)
    assert lines[0] == "python"
    assert any("build stamp" in line for line in lines if line.startswith("WARNING"))


def test_select_refuses_to_run_after_a_listed_module_was_imported() -> None:
    code = ("import sys, importlib.util\n"
            "spec = importlib.util.spec_from_file_location('c', sys.argv[1])\n"
            "c = importlib.util.module_from_spec(spec); spec.loader.exec_module(c)\n"
            "import asyncstate.runtime.requests\n"
            "try:\n"
            "    c.select()\n"
            "except RuntimeError as e:\n"
            "    print(e)\n")
    environ = dict(os.environ, PYTHONPATH=str(ROOT))
    # asyncstate.runtime.requests imports the package first, which selects; a fresh copy of
    # the module has not selected yet and must refuse.
    out = subprocess.run([sys.executable, "-c", code, _compiled.__file__], env=environ,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.startswith("asyncstate._compiled.select() must run before asyncstate.")
