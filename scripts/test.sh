#!/usr/bin/env bash
# Run the test suite twice: on the compiled hot-path modules, then on their Python sources
# (the reference implementation, see asyncstate/_compiled.py). Installs asyncstate with its
# test dependencies into ./.venv first unless the install there is up to date
# (scripts/install.py decides).
# Extra arguments are passed to pytest, e.g. `bash scripts/test.sh -k buffer -x`.
# With ASYNCSTATE_PURE_PYTHON=1 only the Python-sources run happens, and nothing is compiled.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

case "${ASYNCSTATE_PURE_PYTHON:-}" in
    "" | 0)
        unset ASYNCSTATE_PURE_PYTHON
        "${PYTHON:-python3}" scripts/install.py --extras test --require-compiled
        echo "== tests on the compiled modules"
        ASYNCSTATE_EXPECT_IMPLEMENTATION=compiled .venv/bin/python -m pytest "$@"
        ;;
    *)
        "${PYTHON:-python3}" scripts/install.py --extras test
        ;;
esac
echo "== tests on the Python sources (ASYNCSTATE_PURE_PYTHON=1)"
ASYNCSTATE_PURE_PYTHON=1 ASYNCSTATE_EXPECT_IMPLEMENTATION=python .venv/bin/python -m pytest "$@"
