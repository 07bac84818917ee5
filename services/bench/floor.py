"""The hardware floor of an offline workload: less time than any engine could take on this machine.

It counts the work the requests cannot avoid and charges it at rates measured here, in this run:

- **FLOPs** at the best GEMM rate measured on the model's own projection shapes: every projection of
  every token that passes through the layers (each prompt token, then each output token but the last),
  the logits of every sampled token, and causal attention over each prompt;
- **bytes** at the measured read bandwidth: each decode step reads its request's whole K/V context.

Everything else is left out (norms, rotary, sampling, weight reads at small batch, scheduling, and
the fact that small decode batches run GEMMs far below the best rate), so no real engine reaches the
floor. It tells how far an engine could still go on this machine, and which targets are out of reach.

The read bandwidth is that of torch summing one buffer larger than the caches: one stream of reads
per thread, from memory. Both can be beaten. A core keeps more reads in flight over several streams at
once: on the 2-vCPU Xeon, a native sum over 512 MB read 20-23 GB/s on two threads as one stream each,
27-31 as three streams each (`torch.sum` 22-24); over the scattered 16 KB blocks of a paged pool, one
K block and one V block at a time per thread 22-24 GB/s, two to four pairs at a time 25-28 (the
engine's float32 decode attention reads its K/V at ~19). And what stays in the last-level cache
between steps (the small shape's weights, in the Xeon's 480 MB L3) reads faster still: its batch-1
step runs at 0.54-0.63x the bandwidth floor (`decode_floors.py`). The K/V share of the floor is then
the floor of an engine that reads the K/V from memory one stream per thread.

Both rates are the best of a few passes, and on a machine shared with others the best pass moves from
run to run while a whole workload's rate moves less: on a 2-vCPU Xeon VM the read bandwidth came out
at 25.9 and 30.9 GB/s in two `strata bench offline` runs 18 minutes apart (and 23.5-31.9 within
minutes), and the engine's ratio to the floor at 0.76x and 0.73x, the faster engine run (1,206 against
1,161 tok/s) in the run with the higher bandwidth. Compare ratios from runs whose measured rates agree.
"""

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine.models.config import ModelConfig
from services.engine.models.packed_linear import PackedLinear, can_pack


@dataclass(frozen=True)
class WorkloadCost:
    flops: float
    kv_bytes: float  # K/V bytes the decode steps read


def layer_projection_params(mc: ModelConfig) -> int:
    """Weights of one decoder layer's projections (q/k/v, o, gate/up, down), biases and norms aside."""
    q_size, kv_size = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    return mc.hidden_size * (q_size + 2 * kv_size) + q_size * mc.hidden_size + 3 * mc.hidden_size * mc.intermediate_size


def workload_cost(mc: ModelConfig, element_bytes: int, prompt_lens: list[int], output_lens: list[int]) -> WorkloadCost:
    """The unavoidable work of running each prompt to its output length (greedy, one token per step)."""
    q_size, kv_size = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    layer_params = layer_projection_params(mc)
    through_layers = sum(p + o - 1 for p, o in zip(prompt_lens, output_lens, strict=True))
    flops = 2 * layer_params * mc.num_layers * through_layers
    flops += 2 * mc.hidden_size * mc.vocab_size * sum(output_lens)
    # prefill attention: scores and weighted values, 2 * q_size FLOPs each per (query, key) pair, causal
    flops += mc.num_layers * sum(2 * 2 * q_size * p * (p + 1) // 2 for p in prompt_lens)
    # decode: the step that feeds position c - 1 attends c positions; positions p .. p + o - 2 are fed
    kv_bytes_per_position = mc.num_layers * 2 * kv_size * element_bytes
    decode_positions = sum(sum(range(p + 1, p + o)) for p, o in zip(prompt_lens, output_lens, strict=True))
    return WorkloadCost(float(flops), float(kv_bytes_per_position * decode_positions))


def measure_gemm_flops(mc: ModelConfig, dtype: torch.dtype, rows: int = 512, repeats: int = 5,
                       device: torch.device = torch.device("cpu")) -> float:
    """The best FLOP/s of the model's projections (gate/up and down) over ``rows`` tokens, run the way
    the engine runs them (prepacked on the CPU)."""
    best = 0.0
    for in_features, out_features in ((mc.hidden_size, 2 * mc.intermediate_size), (mc.intermediate_size, mc.hidden_size)):
        weight = torch.randn(out_features, in_features, device=device).to(dtype)
        x = torch.randn(rows, in_features, device=device).to(dtype)
        linear = PackedLinear(weight, None) if can_pack(x.device, dtype) else (lambda t, w=weight: F.linear(t, w))
        linear(x)  # warm-up
        for _ in range(repeats):
            seconds = timed(lambda: linear(x), device)
            best = max(best, 2 * rows * in_features * out_features / seconds)
    return best


def timed(run, device: torch.device) -> float:
    """Seconds ``run()`` takes, waiting for the device's queued work on both sides (on a GPU)."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    synchronize()
    started = time.perf_counter()
    run()
    synchronize()
    return time.perf_counter() - started


def measure_read_bandwidth(num_bytes: int | None = None, repeats: int = 5,
                           device: torch.device = torch.device("cpu")) -> float:
    """The best bytes/s of one pass summing a buffer far larger than the caches (512 MiB on the CPU,
    4 GiB on a GPU, whose L2 holds tens of MB)."""
    num_bytes = num_bytes or (4 << 30 if device.type == "cuda" else 512 << 20)
    buffer = torch.ones(num_bytes // 4, device=device)
    buffer.sum()  # fault the pages in
    best = max(num_bytes / timed(buffer.sum, device) for _ in range(repeats))
    del buffer
    return best


def run_floor(mc: ModelConfig, dtype: torch.dtype, prompts: list[list[int]], output_lens: list[int],
              bytes_per_s: float, device: torch.device = torch.device("cpu")) -> dict[str, float]:
    """The floor as a run of the offline table: the workload's output tokens over the floor time, with
    reads at `bytes_per_s` (`measure_read_bandwidth`, measured once per run by the caller)."""
    cost = workload_cost(mc, torch.empty(0, dtype=dtype).element_size(), [len(p) for p in prompts], output_lens)
    flops_per_s = measure_gemm_flops(mc, dtype, device=device)
    seconds = cost.flops / flops_per_s + cost.kv_bytes / bytes_per_s
    return {"duration_s": seconds, "completed": len(prompts), "total_output_tokens": sum(output_lens),
            "output_throughput": sum(output_lens) / seconds, "tflops": cost.flops / 1e12,
            "gemm_gflops_per_s": flops_per_s / 1e9, "kv_read_gb": cost.kv_bytes / 1e9,
            "read_gb_per_s": bytes_per_s / 1e9}
