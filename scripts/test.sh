#!/usr/bin/env bash
# Run the test suite twice: on the compiled hot-path modules and on their Python sources
# (the reference implementation, see asyncstate/_compiled.py). Installs asyncstate with its
# test dependencies into ./.venv first unless the install there is up to date
# (scripts/install.py decides).
#
# The two passes run side by side, one per core (each pytest process runs on one): the
# Python sources' output is kept in a file and shown when both are done. Spark tests (marker
# `spark`) run after them, on the compiled modules only, with the machine to themselves:
# they cost minutes, start a JVM that wants every core, and the bridge itself is Python
# either way.
# Extra arguments are passed to pytest, e.g. `bash scripts/test.sh -k buffer -x`.
# With ASYNCSTATE_PURE_PYTHON=1 only the Python-sources pass runs, and nothing is compiled.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# Exit status 5 (every selected test deselected, as for `scripts/test.sh tests/spark` in a
# pass without Spark) is fine.
passed() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ]; }

pure_pass() {
    ASYNCSTATE_PURE_PYTHON=1 ASYNCSTATE_EXPECT_IMPLEMENTATION=python .venv/bin/python -m pytest \
        -m "not spark" "$@"
}

case "${ASYNCSTATE_PURE_PYTHON:-}" in
    "" | 0)
        unset ASYNCSTATE_PURE_PYTHON
        "${PYTHON:-python3}" scripts/install.py --extras test --require-compiled
        ;;
    *)
        "${PYTHON:-python3}" scripts/install.py --extras test
        echo "== tests on the Python sources (ASYNCSTATE_PURE_PYTHON=1)"
        status=0
        pure_pass "$@" || status=$?
        passed "$status" || exit "$status"
        exit 0
        ;;
esac

# Each pass gets its own pytest temporary directory, so neither cleans up the other's, and
# the side pass its own cache directory (what `--lf` reads) too.
work="$(mktemp -d "${TMPDIR:-/tmp}/asyncstate-tests.XXXXXX")"
trap 'rm -rf "$work"' EXIT

echo "== tests on the compiled modules; the Python sources (ASYNCSTATE_PURE_PYTHON=1) run" \
     "alongside, their output follows"
pure_status=0
pure_pass -o cache_dir="$work/pure-cache" --basetemp "$work/pure" "$@" > "$work/pure.log" 2>&1 &
pure_pid=$!
compiled_status=0
ASYNCSTATE_EXPECT_IMPLEMENTATION=compiled .venv/bin/python -m pytest -m "not spark" \
    --basetemp "$work/compiled" "$@" || compiled_status=$?
wait "$pure_pid" || pure_status=$?
echo "== tests on the Python sources (ASYNCSTATE_PURE_PYTHON=1)"
cat "$work/pure.log"

spark_status=0
if passed "$compiled_status" && passed "$pure_status"; then
    echo "== Spark tests, on the compiled modules"
    ASYNCSTATE_EXPECT_IMPLEMENTATION=compiled .venv/bin/python -m pytest -m spark \
        --basetemp "$work/spark" "$@" || spark_status=$?
else
    echo "== Spark tests skipped: a pass above failed"
fi

failed=0
for pass in compiled pure spark; do
    status_var="${pass}_status"
    if ! passed "${!status_var}"; then
        echo "== the $pass pass failed (exit status ${!status_var})"
        failed="${!status_var}"
    fi
done
exit "$failed"
