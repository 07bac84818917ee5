#!/usr/bin/env bash
# Sets up the environment and runs the whole test suite. Extra arguments go to pytest, e.g.
#   bash scripts/test.sh -m "not slow"     # the fast loop: no service processes, stacks or big sweeps
#   bash scripts/test.sh tests/engine
# Where torch sees no GPU, tests/conftest.py runs the Triton kernels in Triton's interpreter; on a
# GPU they run compiled.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
