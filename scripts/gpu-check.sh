#!/usr/bin/env bash
# The GPU checks in one run, on a machine with an NVIDIA GPU whose python3 already holds torch,
# triton and transformers (no install here), and a protobuf at least as new as services/common/pb's
# generated code (7.35; carry a wheel where the machine's is older): the Triton kernels and the
# engine on CUDA (eager and CUDA graphs) against HF transformers, then the kernel and engine
# benchmarks, each beside its baseline. Logs go to $OUT (default /tmp/gpu-check).
# Usage: bash scripts/gpu-check.sh [quick] (quick: the tests and the small model only, no 8B shape).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
step() { echo "=== $(date +%T) $*"; }
offline=($py -m services.bench offline --device cuda --dtype bfloat16)
status=0

step environment
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())" || exit 1

step "tests: the Triton kernels, the engine on CUDA against HF, CUDA graphs"
timeout 240 $py -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/engine/test_triton_kernels.py \
    tests/engine/test_triton_backend.py tests/engine/test_cuda_graphs.py \
    2>&1 | tee "$out/tests.txt" | tail -n 40 || status=1

step "kernels: paged decode and prefill against torch SDPA"
timeout 90 $py -m services.bench kernels 2>&1 | tee "$out/kernels.txt" || status=1

step "engine, small shape: CUDA graphs against eager against HF generate"
workload=(--num-prompts 64 --input-len 64,512 --output-len 64,256 --step-dtypes bfloat16
          --kv-cache-memory-bytes $((16 << 30)))
timeout 150 "${offline[@]}" --shape small "${workload[@]}" --baselines hf-batch1 2>&1 | tee "$out/small-graphs.txt" || status=1
timeout 150 "${offline[@]}" --shape small "${workload[@]}" --baselines none --enforce-eager 2>&1 \
    | tee "$out/small-eager.txt" || status=1
[ "${1:-}" = quick ] && exit $status

step "engine, Llama-3-8B shape (random bfloat16 weights): CUDA graphs against eager, and the floors"
model=/tmp/llama3-8b-shape
timeout 150 $py -c "from services.bench.checkpoints import write_random_llama as w
w('$model', 'llama3-8b-shape', dtype='bfloat16', device='cuda')" || exit 1
timeout 200 "${offline[@]}" --model $model "${workload[@]}" --baselines floor 2>&1 | tee "$out/8b-graphs.txt" || status=1
timeout 200 "${offline[@]}" --model $model "${workload[@]}" --baselines none --enforce-eager 2>&1 \
    | tee "$out/8b-eager.txt" || status=1
exit $status
