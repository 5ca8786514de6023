"""Build hook: compiles the hot-path modules with mypyc (metadata lives in pyproject.toml).

Set ASYNCSTATE_PURE_PYTHON=1 while installing to skip the compilation; the package then runs
its Python sources, which are the reference implementation (see asyncstate/_compiled.py).
Without a working C compiler (or Python's headers, or mypyc) the install does the same after
one warning on stderr (`pip install -v` shows it), instead of failing.
Next to the compiled modules the build writes `asyncstate/_compiled.stamp`, the digests of
the sources they were compiled from, so that an edited source is never shadowed by an
out-of-date compiled module.
"""

import glob
import os
import runpy
import sys
import sysconfig
import tempfile

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError

_compiled = runpy.run_path(os.path.join("asyncstate", "_compiled.py"))

# What a build without a usable compiler raises (CompileError and LinkError are
# CCompilerErrors; a missing compiler executable is an ExecError or an OSError).
_BUILD_ERRORS = (CCompilerError, ExecError, PlatformError, OSError)
# Commands that only write metadata: pip runs them before the build, each in a process of
# its own, and they need no compiled modules (mypyc would type-check everything for nothing).
_METADATA_COMMANDS = {"egg_info", "dist_info"}
_BUILD_COMMANDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "install", "develop"}


def _warn_pure_python(reason: str) -> None:
    print(f"WARNING: asyncstate's hot path was not compiled ({reason}). Installing the Python "
          "sources instead: the same code, slower. To compile it, install a C compiler and "
          "the Python headers and reinstall; to choose the Python sources without this "
          f"warning, set {_compiled['PURE_PYTHON_ENV']}=1 while installing.",
          file=sys.stderr, flush=True)


class BuildExtWithStamp(build_ext):
    def run(self) -> None:
        in_source_tree = self.inplace  # True for editable installs
        if in_source_tree:
            self._remove_leftovers(keep=self.extensions)
        try:
            super().run()
        except _BUILD_ERRORS as exc:
            if not self.extensions:
                raise
            self._fall_back(exc, in_source_tree)
            return
        if self.extensions:
            package_dir = os.path.dirname(self.get_ext_fullpath("asyncstate._compiled"))
            os.makedirs(package_dir, exist_ok=True)
            _compiled["write_stamp"](os.path.join(package_dir, _compiled["STAMP_NAME"]),
                                     os.path.dirname(os.path.abspath(__file__)))

    def _fall_back(self, exc: BaseException, in_source_tree: bool) -> None:
        """Install without compiled modules: remove what the failed build left."""
        self.inplace = False  # setuptools leaves it so when its build raises
        for ext in self.extensions:
            path = self.get_ext_fullpath(ext.name)
            if os.path.exists(path):
                os.remove(path)
        self.inplace = in_source_tree
        if in_source_tree:
            self._remove_leftovers(keep=[])
        self.extensions = []  # nothing to copy or to list as output
        _warn_pure_python(f"building the extension modules failed: {exc}")

    def _remove_leftovers(self, keep: list) -> None:
        # A module no longer compiled must not stay shadowed by its old extension module.
        wanted = {os.path.abspath(self.get_ext_fullpath(ext.name)) for ext in keep}
        found = glob.glob(os.path.join("asyncstate", "**", "*.so"), recursive=True)
        found += glob.glob("asyncstate__mypyc*.so")
        for path in found:
            if os.path.abspath(path) not in wanted:
                os.remove(path)
        stamp = os.path.join("asyncstate", _compiled["STAMP_NAME"])
        if not keep and os.path.exists(stamp):
            os.remove(stamp)


def _compiler_problem() -> str | None:
    """Why C extensions cannot be built here, or None when a test compile works.

    Compiles a file that includes Python.h with the compiler the build would use (CC and
    CFLAGS are honoured), before mypyc spends its time generating code for it.
    """
    from distutils.ccompiler import new_compiler
    from distutils.sysconfig import customize_compiler

    compiler = new_compiler()
    customize_compiler(compiler)
    with tempfile.TemporaryDirectory(prefix="asyncstate-cc-") as tmp:
        source = os.path.join(tmp, "probe.c")
        with open(source, "w", encoding="ascii") as f:
            f.write("#include <Python.h>\nint asyncstate_probe(void) { return 0; }\n")
        try:
            compiler.compile([source], output_dir=tmp,
                             include_dirs=[sysconfig.get_paths()["include"]])
        except _BUILD_ERRORS as exc:
            return f"the C compiler does not work: {exc}"
    return None


def _metadata_only() -> bool:
    args = set(sys.argv[1:])
    return bool(args & _METADATA_COMMANDS) and not args & _BUILD_COMMANDS


def ext_modules() -> list:
    if os.environ.get(_compiled["PURE_PYTHON_ENV"], "") not in ("", "0") or _metadata_only():
        return []
    problem = _compiler_problem()
    if problem is not None:
        _warn_pure_python(problem)
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        _warn_pure_python(f"mypyc cannot be imported: {exc}")
        return []

    paths = [os.path.join(*module.split(".")) + ".py" for module in _compiled["COMPILED_MODULES"]]
    # The isolated build environment lacks the runtime dependencies' type information, so
    # values from them are Any here; strictness is checked by `mypy`, not by this build.
    relaxed = ["--ignore-missing-imports", "--no-warn-unused-ignores", "--no-warn-return-any"]
    try:
        return mypycify([*relaxed, *paths], opt_level="3", group_name="asyncstate")
    except SystemExit as exc:  # mypyc reports errors in the sources, then exits
        _warn_pure_python(f"mypyc rejected the sources (exit status {exc.code})")
        return []


setup(ext_modules=ext_modules(), cmdclass={"build_ext": BuildExtWithStamp})
