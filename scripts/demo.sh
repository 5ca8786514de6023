#!/usr/bin/env bash
# Install asyncstate into ./.venv (created when missing) and run the demo job on the default
# (embedded heap) backend. Extra arguments are passed to the demo.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# pip's build backend prints harmless warnings even with -q; show its log only on failure.
log="$(mktemp)"
if ! .venv/bin/python -m pip install -q -e . >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    exit 1
fi
rm -f "$log"
exec .venv/bin/python -m asyncstate.demo "$@"
