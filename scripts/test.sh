#!/usr/bin/env bash
# Install the test dependencies into ./.venv (created when missing) and run the test suite.
# Extra arguments are passed to pytest, e.g. `bash scripts/test.sh -k buffer -x`.
set -euo pipefail

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
exec .venv/bin/python -m pytest "$@"
