"""Installing asyncstate: the fallback to the Python sources without a C compiler, the extras,
and scripts/install.py, which lets scripts/demo.sh and scripts/test.sh reuse a current
install."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import venv
from pathlib import Path
from types import ModuleType

import pytest

from asyncstate import _compiled

ROOT = Path(__file__).resolve().parent.parent
_BUILD_LEFTOVERS = (".venv", ".git", "build", "dist", "*.egg-info", "*.so", "__pycache__",
                    ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis",
                    "bench-results", _compiled.STAMP_NAME)


def copy_checkout(target: Path) -> Path:
    """The checkout's sources without installs or build outputs, as a fresh clone has them."""
    shutil.copytree(ROOT, target, ignore=shutil.ignore_patterns(*_BUILD_LEFTOVERS))
    return target


# -- a source install without a C compiler ------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(os.environ.get("ASYNCSTATE_EXPECT_IMPLEMENTATION") == "python",
                    reason="builds its own install, whatever the build under test: "
                           "scripts/test.sh runs it in the compiled pass only")
def test_install_without_a_compiler_falls_back_to_the_python_sources(tmp_path: Path) -> None:
    source = copy_checkout(tmp_path / "asyncstate-src")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    environ = {k: v for k, v in os.environ.items()
               if k not in (_compiled.PURE_PYTHON_ENV, "ASYNCSTATE_EXPECT_IMPLEMENTATION")}
    # `false` exits 1 for any input: a compiler that compiles nothing.
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-v", "--disable-pip-version-check", str(source)],
        env={**environ, "CC": "false"}, capture_output=True, text=True, timeout=280,
        check=False)
    assert install.returncode == 0, install.stdout[-4000:] + install.stderr[-4000:]
    log = install.stdout + install.stderr
    warnings = [line.strip() for line in log.splitlines()
                if "asyncstate's hot path was not compiled" in line]
    assert len(warnings) == 1, warnings
    [warning] = warnings
    assert warning.startswith("WARNING: asyncstate's hot path was not compiled (the C "
                              "compiler does not work: ")
    assert f"set {_compiled.PURE_PYTHON_ENV}=1 while installing" in warning
    assert "mypyc" not in log.split("hot path was not compiled")[1].split("\n")[0]

    site = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())
    package = site / "asyncstate"
    assert (package / "operator" / "keyed.py").is_file()
    assert not list(package.rglob("*.so")) and not list(site.glob("asyncstate__mypyc*"))
    assert not (package / _compiled.STAMP_NAME).exists()

    probe = textwrap.dedent("""
        import asyncstate as ast
        from asyncstate import _compiled
        class Count(ast.KeyedProcessFunction):
            def open(self, ctx):
                self.n = ctx.get_state(ast.ValueStateDescriptor("n"))
            async def process_element(self, value, ctx):
                n = (await self.n.value() or 0) + 1
                await self.n.update(n)
                ctx.emit((value, n))
        print(_compiled.mode(), ast.__file__)
        print(sorted(ast.run(Count(), ["a", "b", "a"], key_selector=lambda r: r)))
        """)
    # -W error: a warning about stale or partial compiled modules would fail the import.
    run = subprocess.run([str(python), "-W", "error", "-c", probe], cwd=tmp_path, env=environ,
                         capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    mode, path, result = run.stdout.replace("\n", " ", 1).split(" ", 2)
    assert mode == "python"
    assert Path(path) == package / "__init__.py"
    assert result.strip() == "[('a', 1), ('a', 2), ('b', 1)]"


def _setup_py(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items()
               if k not in (_compiled.PURE_PYTHON_ENV, "ASYNCSTATE_EXPECT_IMPLEMENTATION")}
    return subprocess.run([sys.executable, "setup.py", *args], cwd=root,
                          env={**environ, **env}, capture_output=True, text=True, timeout=280,
                          check=False)


def _import_probe(root: Path) -> subprocess.CompletedProcess[str]:
    """`import asyncstate` from `root` with warnings as errors; prints the implementation."""
    environ = {k: v for k, v in os.environ.items() if k != _compiled.PURE_PYTHON_ENV}
    return subprocess.run(
        [sys.executable, "-W", "error", "-c",
         "import asyncstate, asyncstate._compiled as c; print(c.mode(), asyncstate.__file__)"],
        cwd=root, env={**environ, "PYTHONPATH": str(root)}, capture_output=True, text=True,
        timeout=60, check=False)


def test_pure_python_env_skips_compiling_without_a_warning(tmp_path: Path) -> None:
    source = copy_checkout(tmp_path / "src")
    proc = _setup_py(source, "build_ext", "--inplace", **{_compiled.PURE_PYTHON_ENV: "1"})
    assert proc.returncode == 0, proc.stderr
    assert "WARNING" not in proc.stdout + proc.stderr
    assert not list(source.rglob("*.so"))
    assert not (source / "build").exists()  # mypyc generated no C


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(os.environ.get("ASYNCSTATE_EXPECT_IMPLEMENTATION") == "python",
                    reason="builds its own install, whatever the build under test: "
                           "scripts/test.sh runs it in the compiled pass only")
@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc for the compiler probe")
def test_a_failing_extension_build_falls_back_and_removes_old_compiled_modules(
        tmp_path: Path) -> None:
    source = copy_checkout(tmp_path / "src")
    # An earlier build's leftovers, which an in-place (editable) rebuild must not leave.
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    stale = [source / "asyncstate" / f"serde{suffix}", source / f"asyncstate__mypyc{suffix}"]
    for path in stale:
        path.write_bytes(b"not a real extension")
    (source / "asyncstate" / _compiled.STAMP_NAME).write_text("{}", encoding="utf-8")
    # A compiler that passes the set-up probe and fails on the generated modules.
    compiler = tmp_path / "cc"
    compiler.write_text(f'#!/bin/sh\ncase "$*" in *probe.c*) exec {shutil.which("gcc")} "$@";; '
                        'esac\necho "cc: refusing to compile" >&2\nexit 1\n', encoding="utf-8")
    compiler.chmod(0o755)
    proc = _setup_py(source, "build_ext", "--inplace", CC=str(compiler))
    assert proc.returncode == 0, proc.stderr[-4000:]
    warnings = [line for line in (proc.stdout + proc.stderr).splitlines()
                if "asyncstate's hot path was not compiled" in line]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("WARNING: asyncstate's hot path was not compiled (building "
                                  "the extension modules failed: ")
    assert (source / "build").is_dir()  # mypyc ran: the failure came from the C build
    assert not list(source.rglob("*.so"))
    assert not (source / "asyncstate" / _compiled.STAMP_NAME).exists()
    probe = _import_probe(source)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["python", str(source / "asyncstate" / "__init__.py")]


# -- extras -------------------------------------------------------------------------------


def _project() -> dict[str, object]:
    project: dict[str, object] = tomllib.loads(
        (ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return project


def _installer() -> ModuleType:
    return _load_installer(ROOT)


def _load_installer(root: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"install_{id(root)}",
                                                  root / "scripts" / "install.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _names(requirements: list[str]) -> set[str]:
    return {r.split(">")[0].split("=")[0].split("[")[0].split(";")[0].strip().lower()
            .replace("_", "-") for r in requirements}


def test_all_extra_holds_what_users_run_and_no_test_or_lint_tool() -> None:
    names = _names(_installer().extra_requirements(["all"]))
    assert {"rocksdict", "pyspark", "matplotlib", "rich", "prometheus-client"} <= names
    assert not names & {"pytest", "pytest-asyncio", "pytest-timeout", "hypothesis", "ruff",
                        "mypy", "tox"}


def test_test_and_dev_extras_hold_the_tools() -> None:
    installer = _installer()
    test = _names(installer.extra_requirements(["test"]))
    assert {"pytest", "pytest-asyncio", "pytest-timeout", "hypothesis", "rocksdict", "ruff",
            "mypy"} <= test
    assert test | {"tox"} <= _names(installer.extra_requirements(["dev"]))


def test_console_script_is_the_cli() -> None:
    assert _project()["scripts"] == {"asyncstate": "asyncstate.cli:main"}


# -- scripts/install.py: when an install is reused ----------------------------------------


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of the checkout with a .venv whose Python imports asyncstate from the copy (a
    .pth file, as an editable install has), without pip or a build."""
    root = copy_checkout(tmp_path / "src")
    venv.create(root / ".venv", with_pip=False, symlinks=True)
    site = Path(sysconfig.get_paths(vars={"base": str(root / ".venv"),
                                          "platbase": str(root / ".venv")})["purelib"])
    (site / "asyncstate-src.pth").write_text(f"{root}\n", encoding="utf-8")
    return root


def stamp(root: Path, build: str, extras: list[str]) -> None:
    installer = _load_installer(root)
    installer.STAMP.write_text(json.dumps({"inputs": installer.digests(), "extras": extras,
                                           "build": build}), encoding="utf-8")


def check(root: Path, *args: str, **env: str) -> tuple[int, str]:
    """`scripts/install.py --check ARGS` in `root`: its exit status and message."""
    environ = {k: v for k, v in os.environ.items() if k != _compiled.PURE_PYTHON_ENV}
    proc = subprocess.run([sys.executable, str(root / "scripts" / "install.py"), "--check",
                           *args], env={**environ, **env}, capture_output=True, text=True,
                          timeout=60, check=False)
    return proc.returncode, proc.stderr.strip()


def test_a_current_install_is_reused(checkout: Path) -> None:
    stamp(checkout, "fallback", ["test"])
    assert check(checkout, "--extras", "test") == (0, "")


def test_no_record_of_an_install_means_install(checkout: Path) -> None:
    assert check(checkout) == (1, "asyncstate: no record of the install in .venv")


def test_a_changed_pyproject_or_setup_means_install(checkout: Path) -> None:
    stamp(checkout, "fallback", [])
    with (checkout / "setup.py").open("a", encoding="utf-8") as f:
        f.write("\n# edited\n")
    assert check(checkout) == (1, "asyncstate: setup.py changed since the last install")


def test_missing_compiled_modules_mean_install(checkout: Path) -> None:
    stamp(checkout, "compiled", [])  # the copy has no compiled modules
    assert check(checkout) == (1, "asyncstate: no module is compiled")
    # The Python sources are wanted: nothing needs compiling.
    assert check(checkout, **{_compiled.PURE_PYTHON_ENV: "1"}) == (0, "")


def test_a_pure_python_install_is_rebuilt_when_compiled_modules_are_wanted(
        checkout: Path) -> None:
    stamp(checkout, "pure", [])
    assert check(checkout) == (1, "asyncstate: the last install skipped compiling "
                                  "(ASYNCSTATE_PURE_PYTHON was set)")
    assert check(checkout, **{_compiled.PURE_PYTHON_ENV: "1"}) == (0, "")


def test_missing_extras_are_named(checkout: Path) -> None:
    stamp(checkout, "fallback", ["rocksdb"])
    assert check(checkout, "--extras", "rocksdb,test") == (
        1, "asyncstate: the extras test are not installed")


def test_an_install_of_another_checkout_means_install(checkout: Path) -> None:
    stamp(checkout, "fallback", [])
    for pth in (checkout / ".venv").rglob("asyncstate-src.pth"):
        pth.unlink()
    assert check(checkout) == (1, "asyncstate: asyncstate in .venv is not this checkout")


def test_this_checkouts_install_is_current_after_the_set_up_scripts() -> None:
    # scripts/test.sh installed this run's build (and stamped it): a second run of either
    # README command must reuse it, not recompile.
    if os.environ.get("ASYNCSTATE_EXPECT_IMPLEMENTATION") is None:
        pytest.skip("ASYNCSTATE_EXPECT_IMPLEMENTATION is not set (scripts/test.sh sets it)")
    pure = os.environ.get(_compiled.PURE_PYTHON_ENV, "")
    env = {_compiled.PURE_PYTHON_ENV: pure} if pure else {}
    assert check(ROOT, "--extras", "test", **env) == (0, "")
