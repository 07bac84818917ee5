"""The engine's batch-1 decode step beside its two floors, per dtype (`strata bench offline`).

- **step**: `EngineCore.step()` of one request at a fixed context, median over steps, as served
  (scheduling, the model, sampling).
- **linear floor**: the same step's projections alone: the loaded model's own linear modules
  (q/k/v, o, gate/up, down of every layer, then the logits), each run on one row in layer order,
  median over repetitions. What the step costs beyond this is attention, norms, rotary, sampling
  and the engine around them.
- **bandwidth floor**: the bytes one step must read (every weight once, one embedding row, the
  request's K/V) over the read bandwidth measured in this run (`floor.measure_read_bandwidth`: a
  summing pass over a buffer larger than the caches). At batch 1 decode is bound by memory, so it is
  the floor of a step that reads its weights from memory; weights that stay in the last-level cache
  between steps read faster (the small shape's 53-105 MB in a 480 MB L3: steps at 0.54-0.63x this
  floor), and so do reads spread over several streams per thread (`floor.py`).
"""

import dataclasses
import statistics
import time

import torch

from services.bench.floor import layer_projection_params, timed
from services.engine.config import EngineConfig
from services.engine.models.config import ModelConfig
from services.engine.models.quantized_weights import INT8_AT_LOAD


@dataclasses.dataclass(frozen=True)
class StepBytes:
    weights: int  # every weight once (the logits' matrix included), one embedding row
    kv: int  # the K/V of `context` positions, every layer


def decode_step_bytes(mc: ModelConfig, element_size: int, context: int, int8_weights: bool = False) -> StepBytes:
    """The bytes a batch-1 decode step at `context` positions cannot avoid reading; with
    ``int8_weights`` (``--quantization int8``) the projections' and the logits' matrices are one byte an
    element, with a float32 scale per output row."""
    hidden, q_size, kv_size = mc.hidden_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    matrices = mc.num_layers * layer_projection_params(mc) + mc.vocab_size * hidden  # the logits' too
    rows = mc.num_layers * (q_size + 2 * kv_size + hidden + 2 * mc.intermediate_size + hidden) + mc.vocab_size
    layer = (q_size + 2 * kv_size) * mc.attention_bias + hidden * mc.o_proj_bias
    layer += (2 * mc.intermediate_size + hidden) * mc.mlp_bias
    layer += 2 * hidden  # the two norms
    others = mc.num_layers * layer + hidden + hidden  # final norm, embedding row
    matrix_bytes = matrices + 4 * rows if int8_weights else matrices * element_size
    kv = mc.num_layers * 2 * kv_size * context
    return StepBytes(matrix_bytes + others * element_size, kv * element_size)


def projections(model) -> list[tuple[torch.nn.Module, int]]:
    """The model's projections in the order a decode step runs them, with each one's input width;
    the logits are `model.compute_logits` (the tied or untied head, as loaded)."""
    mc = model.config
    q_size = mc.num_heads * mc.head_dim
    steps = []
    for layer in model.model.layers:
        steps += [(layer.self_attn.qkv_proj, mc.hidden_size), (layer.self_attn.o_proj, q_size),
                  (layer.mlp.gate_up_proj, mc.hidden_size), (layer.mlp.down_proj, mc.intermediate_size)]
    return steps + [(model.compute_logits, mc.hidden_size)]


def time_linear_floor(model, dtype: torch.dtype, repeats: int) -> float:
    """Median seconds of running every projection of `model` once, on one row each (on a GPU, the
    projections' kernels launched back to back, timed to the last one's end)."""
    device = model.model.embed_tokens.weight.device
    calls = [(module, torch.randn(1, width, device=device).to(dtype)) for module, width in projections(model)]

    def run_all() -> None:
        for module, x in calls:
            module(x)

    with torch.inference_mode():
        samples = [timed(run_all, device) for _ in range(repeats + 2)]  # the first two warm up
    return statistics.median(samples[2:])


def time_decode_step(config: EngineConfig, context: int, steps: int) -> tuple[float, object]:
    """Median seconds of a batch-1 decode step at `context` positions (growing by one per step),
    and the engine's model as loaded."""
    from services.engine.engine_core import EngineCore
    from services.engine.sampling_params import SamplingParams

    warmup_steps = 3
    num_blocks = -(-(context + steps + warmup_steps + 1) // config.block_size) + 1
    # a fixed thread count: the adaptive one would time some steps on fewer threads while it probes
    core = EngineCore(dataclasses.replace(config, max_num_seqs=1, num_kv_blocks=num_blocks,
                                          num_threads=config.num_threads or torch.get_num_threads()))
    core.warmup()
    params = SamplingParams(temperature=0.0, max_tokens=steps + warmup_steps + 2, ignore_eos=True)
    core.add_request("decode-step", [(7 * i + 1) % core.vocab_size for i in range(context)], params)
    while core.scheduler.waiting or core.scheduler.running[0].num_computed_tokens < context:
        core.step()  # the prefill
    samples = []
    for _ in range(warmup_steps + steps):
        started = time.perf_counter()
        core.step()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples[warmup_steps:]), core.model_runner.model


def run_decode_floors(config: EngineConfig, dtypes: list[str], context: int, steps: int,
                      read_bytes_per_s: float) -> list[dict[str, float]]:
    """One row per dtype: the step, its floors (ms) and the bytes behind the bandwidth floor."""
    from services.engine.models.config import load_model_config

    mc = load_model_config(config.model)
    rows = []
    for name in dtypes:
        dtype = mc.resolve_dtype(name, config.device)
        step_s, model = time_decode_step(dataclasses.replace(config, dtype=name), context, steps)
        linear_s = time_linear_floor(model, dtype, steps)
        del model
        int8_weights = config.quantization == INT8_AT_LOAD
        read = decode_step_bytes(mc, torch.empty(0, dtype=dtype).element_size(), context, int8_weights)
        bandwidth_s = (read.weights + read.kv) / read_bytes_per_s
        rows.append({"dtype": f"{name}-int8" if int8_weights else name, "context": context,
                     "step_ms": step_s * 1e3, "linear_floor_ms": linear_s * 1e3,
                     "bandwidth_floor_ms": bandwidth_s * 1e3, "weight_mb": read.weights / 1e6,
                     "kv_mb": read.kv / 1e6, "read_gb_per_s": read_bytes_per_s / 1e9,
                     "output_throughput": 1.0 / step_s})
    return rows


def format_decode_floors(rows: list[dict[str, float]]) -> str:
    lines = [f"=========== Batch-1 decode step (context {rows[0]['context']}) ===========",
             f"{'dtype':<14}{'step ms':>9}{'linear ms':>11}{'bw floor ms':>13}{'step/linear':>13}"
             f"{'step/bw':>9}{'read MB':>9}{'GB/s':>7}"]
    for r in rows:
        lines.append(f"{r['dtype']:<14}{r['step_ms']:>9.2f}{r['linear_floor_ms']:>11.2f}{r['bandwidth_floor_ms']:>13.2f}"
                     f"{r['step_ms'] / r['linear_floor_ms']:>12.2f}x{r['step_ms'] / r['bandwidth_floor_ms']:>8.2f}x"
                     f"{r['weight_mb'] + r['kv_mb']:>9.1f}{r['read_gb_per_s']:>7.1f}")
    lines.append("linear: the step's projections alone, one row each; bw floor: weights + K/V read once at the "
                 "measured read bandwidth")
    return "\n".join(lines)
