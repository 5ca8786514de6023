"""Install asyncstate into ./.venv, unless the install there is up to date: the set-up step of
scripts/demo.sh and scripts/test.sh.

Usage: ``python3 scripts/install.py [--extras a,b] [--require-compiled] [--check]``

The install is reused while nothing it was built from changed. It is redone (an editable
``pip install -e '.[extras]'``, which compiles the hot path) when:

- .venv or the install is missing, or its Python no longer runs, or asyncstate there is not
  this checkout;
- pyproject.toml or setup.py changed since the install (their digests are stamped in
  ``.venv/asyncstate-install.json``);
- the compiled modules are wanted and one of them is missing, or its source changed since it
  was compiled (asyncstate/_compiled.py's build stamp tells), or the last install skipped
  compiling because ASYNCSTATE_PURE_PYTHON was set.

Extras missing from an otherwise current install are added without rebuilding. With
ASYNCSTATE_PURE_PYTHON set, the Python sources are wanted: nothing is compiled, and any
current install will do. An install that could not compile (no working C compiler) is
reused as it is, with a note; delete .venv to try compiling again.

Messages go to stderr. Exit status 0 when the install is ready; 1 when pip failed (its log
is printed) or, with --require-compiled, when the hot path could not be compiled. With
--check nothing is installed: exit status 0 when the install is current, else 1 and why.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
PYTHON = VENV / "bin" / "python"
STAMP = VENV / "asyncstate-install.json"
INPUTS = ("pyproject.toml", "setup.py")
HEARTBEAT_S = 20.0
_COMPILED = runpy.run_path(str(ROOT / "asyncstate" / "_compiled.py"))
PURE_PYTHON_ENV: str = _COMPILED["PURE_PYTHON_ENV"]


def say(message: str) -> None:
    print(f"asyncstate: {message}", file=sys.stderr, flush=True)


def pure_python_wanted() -> bool:
    return os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0")


def digests() -> dict[str, str]:
    return {name: hashlib.sha256((ROOT / name).read_bytes()).hexdigest() for name in INPUTS}


def read_stamp() -> dict[str, Any] | None:
    try:
        stamp = json.loads(STAMP.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def compiled_problems() -> list[str]:
    """Why the compiled modules cannot be used ([] when they can)."""
    problems: list[str] = _COMPILED["problems"]()
    return problems


def installed_here() -> bool:
    """Whether .venv's Python runs and imports asyncstate from this checkout."""
    if not PYTHON.exists():
        return False
    code = ("import importlib.util, sys; spec = importlib.util.find_spec('asyncstate'); "
            "sys.stdout.write(spec.origin if spec and spec.origin else '')")
    try:
        # -I: not the current directory, which may hold a checkout, only what is installed.
        proc = subprocess.run([str(PYTHON), "-I", "-c", code], capture_output=True, text=True,
                              timeout=60, check=False)
    except OSError:
        return False
    return proc.returncode == 0 and proc.stdout == str(ROOT / "asyncstate" / "__init__.py")


def why_build(stamp: dict[str, Any] | None) -> str | None:
    """Why the install must be (re)built, or None when it can be reused."""
    if not PYTHON.exists():
        return "no install in .venv yet"
    if stamp is None:
        return "no record of the install in .venv"
    changed = [name for name, digest in digests().items()
               if stamp.get("inputs", {}).get(name) != digest]
    if changed:
        return f"{' and '.join(changed)} changed since the last install"
    if not installed_here():
        return "asyncstate in .venv is not this checkout"
    if pure_python_wanted():
        return None
    build = stamp.get("build")
    if build == "pure":
        return f"the last install skipped compiling ({PURE_PYTHON_ENV} was set)"
    if build == "compiled":
        problems = compiled_problems()
        if problems:
            return "; ".join(problems)
    return None


def extra_requirements(extras: list[str]) -> list[str]:
    """The requirements of `extras` as pyproject.toml lists them, self-references resolved."""
    import tomllib  # Python >= 3.11, checked in main()

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    table: dict[str, list[str]] = project.get("optional-dependencies", {})
    name = project["name"]
    out: list[str] = []
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in table.get(extra, []):
            if req.startswith(f"{name}["):
                todo += req[len(name) + 1:req.index("]")].split(",")
            elif req not in out:
                out.append(req)
    return out


def pip(args: list[str], doing: str) -> bool:
    """Run ``pip install ARGS`` in .venv with its output in a log; say what it does every
    HEARTBEAT_S seconds. True on success; on failure the log is printed."""
    started = time.monotonic()
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as log:
        proc = subprocess.Popen([str(PYTHON), "-m", "pip", "install", "-v", *args],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        while True:
            try:
                status = proc.wait(timeout=HEARTBEAT_S)
                break
            except subprocess.TimeoutExpired:
                say(f"still {doing} ({time.monotonic() - started:.0f} s)")
        log.seek(0)
        text = log.read()
    if status != 0:
        print(text, file=sys.stderr)
        say(f"pip install failed (status {status}); its log is above")
        return False
    for line in text.splitlines():
        if "WARNING: asyncstate's hot path was not compiled" in line:
            print(line.strip(), file=sys.stderr)
    say(f"done in {time.monotonic() - started:.0f} s")
    return True


def main(argv: list[str] | None = None) -> int:
    if sys.version_info < (3, 11):  # noqa: UP036 - runs under whatever python3 is on PATH
        say(f"needs Python 3.11 or later, {sys.executable} is {sys.version.split()[0]}; set "
            "PYTHON to a newer interpreter")
        return 1
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extras", default="", help="comma-separated extras to install")
    parser.add_argument("--require-compiled", action="store_true",
                        help="fail when the hot path could not be compiled")
    parser.add_argument("--check", action="store_true",
                        help="install nothing: say whether the install is current")
    args = parser.parse_args(argv)
    wanted = [e for e in args.extras.split(",") if e]
    stamp = read_stamp()
    if stamp is not None and not PYTHON.exists():
        stamp = None
    reason = why_build(stamp)
    if args.check:
        missing = [e for e in wanted if e not in (stamp or {}).get("extras", [])]
        if reason is None and missing:
            reason = f"the extras {', '.join(missing)} are not installed"
        if reason is not None:
            say(reason)
        return 0 if reason is None else 1
    if reason is None and stamp is not None:
        missing = [e for e in wanted if e not in stamp.get("extras", [])]
        if missing:
            say(f"adding the extras {', '.join(missing)} to the install in .venv")
            if not pip(extra_requirements(missing), "installing"):
                return 1
            stamp["extras"] = sorted({*stamp.get("extras", []), *missing})
            STAMP.write_text(json.dumps(stamp, indent=1), encoding="utf-8")
    else:
        if not PYTHON.exists():
            say("creating the virtual environment .venv")
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        extras = sorted({*wanted, *((stamp or {}).get("extras", []))})
        target = f".[{','.join(extras)}]" if extras else "."
        if pure_python_wanted():
            say(f"{reason}: installing asyncstate with its Python sources "
                f"({PURE_PYTHON_ENV} is set: nothing to compile), about half a minute")
        else:
            say(f"{reason}: installing asyncstate and compiling the hot path with mypyc, "
                "one to two minutes, longer on a busy machine (later runs reuse the install)")
        STAMP.unlink(missing_ok=True)  # an interrupted install is not current
        if not pip(["-e", target], "compiling" if not pure_python_wanted() else "installing"):
            return 1
        build = "pure" if pure_python_wanted() else \
            "compiled" if not compiled_problems() else "fallback"
        stamp = {"inputs": digests(), "extras": extras, "build": build}
        STAMP.write_text(json.dumps(stamp, indent=1), encoding="utf-8")
    if stamp.get("build") == "fallback" and not pure_python_wanted():
        say("the hot path is not compiled on this machine (no working C compiler?): the "
            "Python sources run instead. Delete .venv to try compiling again.")
        if args.require_compiled:
            say(f"this needs the compiled modules; to test the Python sources alone, run "
                f"with {PURE_PYTHON_ENV}=1")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
