#!/usr/bin/env bash
# Creates .venv (Python 3.11+) and installs Strata with everything its services, tests and
# benchmarks need. Safe to run again: pip skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch==2.13.0 is pinned in pyproject.toml (its CPU build is what the project is tested with).
.venv/bin/python -m pip install -q -e ".[all]"
