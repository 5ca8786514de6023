#!/usr/bin/env bash
# Run the demo job (`asyncstate demo`): the same job on the heap backend and on RocksDB side
# by side. Installs asyncstate into ./.venv first unless the install there is up to date
# (scripts/install.py decides). Extra arguments are passed to the demo, e.g.
# `bash scripts/demo.sh --backend all`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

"${PYTHON:-python3}" scripts/install.py --extras rocksdb
exec .venv/bin/python -m asyncstate demo "$@"
