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
# A real Prometheus (Debian's package) for the observability tests: promtool checks the compose
# stack's scrape config, and an end-to-end test scrapes a running stack with it.
if ! command -v promtool >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo -n"; fi
  $SUDO apt-get install -y -q --no-install-recommends prometheus >/dev/null \
    || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q --no-install-recommends prometheus >/dev/null; } \
    || echo "setup: could not install prometheus (apt-get); the observability tests will say so" >&2
fi
