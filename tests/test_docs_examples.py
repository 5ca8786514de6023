"""Every docs/examples/*.py runs and prints exactly its stored <name>.out, and the pages
under docs/ show those files verbatim."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.py"))
# Examples that start a Spark session: marked `spark` (run once per suite, see scripts/test.sh)
# and given the time a JVM takes to start on a busy machine.
SPARK_PREFIX = "spark_"
SPARK_TIMEOUT_S = 150


def _example(script: Path) -> object:
    if script.name.startswith(SPARK_PREFIX):
        return pytest.param(script, marks=[pytest.mark.spark,
                                           pytest.mark.timeout(SPARK_TIMEOUT_S + 30)])
    return script


def test_examples_exist() -> None:
    assert EXAMPLES, "no examples found under docs/examples/"


@pytest.mark.parametrize("script", [_example(s) for s in EXAMPLES], ids=lambda p: p.stem)
def test_example_prints_its_expected_output(script: Path) -> None:
    expected_file = script.with_suffix(".out")
    assert expected_file.is_file(), f"{script.name} has no expected output {expected_file.name}"
    # -W error: the examples are held to the suite's `filterwarnings = error`.
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=SPARK_TIMEOUT_S if script.name.startswith(SPARK_PREFIX) else 60,
        check=False,
    )
    assert proc.returncode == 0, (
        f"{script.name} exited with {proc.returncode}\nstderr:\n{proc.stderr}")
    assert proc.stdout == expected_file.read_text(encoding="utf-8"), (
        f"{script.name} printed something other than {expected_file.name}\n"
        f"stderr:\n{proc.stderr}")


# -- pages show the examples verbatim ------------------------------------------------------
#
# A page includes a file by a marker line followed by a fenced block holding the file's
# exact text:
#
#     <!-- include: docs/examples/counter_async.py -->
#     ```python
#     ...the file...
#     ```

_MARKER_LINE = re.compile(r"^<!-- include: \S+ -->$", re.MULTILINE)
_MARKER = re.compile(r"^<!-- include: (?P<path>\S+) -->\n```[a-z]*\n(?P<body>.*?)^```$",
                     re.MULTILINE | re.DOTALL)
PAGES = sorted((ROOT / "docs").glob("*.md"))


def _includes() -> list[tuple[Path, str, str]]:
    return [(page, match["path"], match["body"])
            for page in PAGES
            for match in _MARKER.finditer(page.read_text(encoding="utf-8"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_include_markers_are_followed_by_a_block(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert len(_MARKER_LINE.findall(text)) == len(_MARKER.findall(text)), (
        f"{page.name}: an include marker line is not followed directly by a fenced block")


@pytest.mark.parametrize(("page", "path", "body"), _includes(),
                         ids=[f"{page.name}:{Path(path).name}" for page, path, _ in _includes()])
def test_included_block_equals_file(page: Path, path: str, body: str) -> None:
    target = ROOT / path
    assert target.is_file(), f"{page.name} includes {path}, which does not exist"
    assert body == target.read_text(encoding="utf-8"), (
        f"{page.name}: the block after `<!-- include: {path} -->` differs from the file; "
        "copy the file's text into the page")


def test_every_example_and_output_is_shown_in_a_page() -> None:
    included = {path for _, path, _ in _includes()}
    for script in EXAMPLES:
        for f in (script, script.with_suffix(".out")):
            rel = f.relative_to(ROOT).as_posix()
            assert rel in included, f"{rel} is not included in any docs/*.md page"
