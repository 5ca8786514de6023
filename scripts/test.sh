#!/usr/bin/env bash
# Install the test dependencies into ./.venv (created when missing) and run the test suite
# twice: on the compiled hot-path modules, then on their Python sources (the reference
# implementation, see asyncstate/_compiled.py). Spark tests (marker `spark`) run in the first
# pass only: they cost minutes, and the bridge itself is Python either way.
# Extra arguments are passed to pytest, e.g. `bash scripts/test.sh -k buffer -x`.
set -euo pipefail
# The install compiles the hot path; the first run below must test that build.
unset ASYNCSTATE_PURE_PYTHON

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# pip's build backend prints harmless warnings even with -q; show its log only on failure.
log="$(mktemp)"
if ! .venv/bin/python -m pip install -q -e '.[test]' >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    exit 1
fi
rm -f "$log"
echo "== tests on the compiled modules"
ASYNCSTATE_EXPECT_IMPLEMENTATION=compiled .venv/bin/python -m pytest "$@"
echo "== tests on the Python sources (ASYNCSTATE_PURE_PYTHON=1)"
# Exit status 5 (every selected test deselected, as for `scripts/test.sh tests/spark`) is fine.
status=0
ASYNCSTATE_PURE_PYTHON=1 ASYNCSTATE_EXPECT_IMPLEMENTATION=python .venv/bin/python -m pytest \
    -m "not spark" "$@" || status=$?
if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then
    exit "$status"
fi
