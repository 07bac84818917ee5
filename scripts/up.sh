#!/usr/bin/env bash
# Sets up the environment and starts the whole stack on loopback (tokenizer, engine, gateway)
# on the built-in default model. Arguments go to `strata up` (e.g. --model DIR --port 8000).
# Installs the `serve` extra (no Triton), and `gpu` (Triton) where an NVIDIA GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=serve
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  EXTRAS=serve,gpu
fi
bash scripts/setup.sh "$EXTRAS"
exec .venv/bin/strata up "$@"
