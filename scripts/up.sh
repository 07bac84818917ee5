#!/usr/bin/env bash
# Sets up the environment and starts the whole stack on loopback (tokenizer, engine, gateway)
# on the built-in default model. Arguments go to `strata up` (e.g. --model DIR --port 8000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/strata up "$@"
