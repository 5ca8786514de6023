"""Build hook: compiles the hot-path modules with mypyc (metadata lives in pyproject.toml).

Set ASYNCSTATE_PURE_PYTHON=1 while installing to skip the compilation; the package then runs
its Python sources, which are the reference implementation (see asyncstate/_compiled.py).
Next to the compiled modules the build writes `asyncstate/_compiled.stamp`, the digests of
the sources they were compiled from, so that an edited source is never shadowed by an
out-of-date compiled module.
"""

import glob
import os
import runpy

from setuptools import setup
from setuptools.command.build_ext import build_ext

_compiled = runpy.run_path(os.path.join("asyncstate", "_compiled.py"))


class BuildExtWithStamp(build_ext):
    def run(self) -> None:
        if self.inplace:
            self._remove_leftovers()
        super().run()
        if self.extensions:
            package_dir = os.path.dirname(self.get_ext_fullpath("asyncstate._compiled"))
            os.makedirs(package_dir, exist_ok=True)
            _compiled["write_stamp"](os.path.join(package_dir, _compiled["STAMP_NAME"]),
                                     os.path.dirname(os.path.abspath(__file__)))


    def _remove_leftovers(self) -> None:
        # A module no longer compiled must not stay shadowed by its old extension module.
        wanted = {self.get_ext_fullpath(module) for module in _compiled["COMPILED_MODULES"]}
        for path in glob.glob(os.path.join("asyncstate", "**", "*.so"), recursive=True):
            if os.path.abspath(path) not in {os.path.abspath(w) for w in wanted}:
                os.remove(path)


def ext_modules() -> list:
    if os.environ.get(_compiled["PURE_PYTHON_ENV"], "") not in ("", "0"):
        return []
    from mypyc.build import mypycify

    paths = [os.path.join(*module.split(".")) + ".py" for module in _compiled["COMPILED_MODULES"]]
    # The isolated build environment lacks the runtime dependencies' type information, so
    # values from them are Any here; strictness is checked by `mypy`, not by this build.
    relaxed = ["--ignore-missing-imports", "--no-warn-unused-ignores", "--no-warn-return-any"]
    return mypycify([*relaxed, *paths], opt_level="3", group_name="asyncstate")


setup(ext_modules=ext_modules(), cmdclass={"build_ext": BuildExtWithStamp})
