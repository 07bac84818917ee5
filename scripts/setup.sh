#!/usr/bin/env bash
# Creates .venv (Python 3.11+) and installs Strata (editable) with the extras named by the first
# argument, a comma list of pyproject.toml's extras (default: all: the services, the tests and the
# benchmarks; scripts/up.sh asks for serve, and gpu where an NVIDIA GPU is present).
# Quiet when nothing changed: pip runs only when an extra asked for is not installed yet or
# pyproject.toml changed since the last install (.venv/.strata-installed lists what was installed).
# torch==2.13.0 is pinned in pyproject.toml; PyPI's wheel is the CUDA build on Linux x86_64. For the
# CPU-only build, install it into .venv first (README: "Without a GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${1:-all}
PYTHON=${PYTHON:-python3}
STAMP=.venv/.strata-installed
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi

installed() {  # every extra asked for is installed, and pyproject.toml has not changed since
  [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] || return 1
  local have extra
  have=" $(tr '\n' ' ' < "$STAMP") "
  case "$have" in *" all "*) have="$have engine gpu test bench serve " ;; esac  # all holds every package
  for extra in ${EXTRAS//,/ }; do
    case "$have" in *" $extra "*) ;; *) return 1 ;; esac
  done
}

if ! installed; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$EXTRAS]"
  if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ]; then
    echo "${EXTRAS//,/ }" >> "$STAMP"
  else
    echo "${EXTRAS//,/ }" > "$STAMP"
  fi
fi

case ",$EXTRAS," in
  *,all,*|*,test,*)
    # A real Prometheus (Debian's package) for the observability tests: promtool checks the compose
    # stack's scrape config, and an end-to-end test scrapes a running stack with it.
    if ! command -v promtool >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
      SUDO=""
      if [ "$(id -u)" != 0 ]; then SUDO="sudo -n"; fi
      $SUDO apt-get install -y -q --no-install-recommends prometheus >/dev/null \
        || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q --no-install-recommends prometheus >/dev/null; } \
        || echo "setup: could not install prometheus (apt-get); the observability tests will say so" >&2
    fi
    ;;
esac
