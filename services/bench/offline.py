"""`strata bench offline`: the engine in-process against Hugging Face `generate`, same checkpoint,
same requests, same run, so the ratios are the claim.

Workload: `--num-prompts` requests with prompt lengths uniform in `--input-len` (lo,hi) and output
lengths uniform in `--output-len` (lo,hi), random token ids, every request runs to its length
(EOS ignored), greedy unless `--sampling` names how they sample (a JSON object of temperature, top_p,
top_k, min_p and repetition_penalty, the keys of a checkpoint's generation_config.json; HF `generate`
samples the same way). Baselines:
  hf-batch1  HF `generate` one request at a time (on the first `--hf-batch1-prompts` requests,
             as tok/s, which does not depend on how many are run);
  hf-static  HF `generate` on all requests as one left-padded static batch that runs until the
             longest output is done; only the tokens each request asked for count;
  floor      not a run: this machine's floor for the workload (`services/bench/floor.py`), the
             work no engine can skip at rates measured in this run; strata's ratio to it is < 1.
Then, per `--step-dtypes`, the batch-1 decode step beside its linear-only and bandwidth floors
(`services/bench/decode_floors.py`), at a `--step-context`-token context.
The checkpoint is `--model DIR`, or a random-weight Llama of a shape from `SHAPES` (`--shape`),
written to a temporary directory (drawn on `--device`, in `--dtype`). The engine warms up as a server
does before the workload: graphs compiled on the CPU where the native step leaves them steps to
serve (cached on disk; the first start takes minutes), CUDA graphs captured on a GPU; `--enforce-eager`
runs without them.
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from services.bench.arg_types import length_range, positive_int
from services.bench.checkpoints import SHAPES, write_random_llama
from services.bench.decode_floors import format_decode_floors, run_decode_floors
from services.bench.floor import measure_read_bandwidth, run_floor

BASELINES = ("hf-batch1", "hf-static", "floor")
DEFAULT_STEP_DTYPES = "float32,bfloat16"
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # HF generate's names too


def build_parser() -> argparse.ArgumentParser:
    from services.engine.engine_args import add_engine_args

    parser = argparse.ArgumentParser(prog="strata bench offline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES),
                        help="random-weight Llama shape when --model is not given (default: %(default)s)")
    parser.add_argument("--num-prompts", type=positive_int, default=64,
                        help="requests (default: %(default)s)")
    parser.add_argument("--input-len", type=length_range, default="64,512",
                        help="prompt length range lo,hi, or one length N (default: %(default)s)")
    parser.add_argument("--output-len", type=length_range, default="64,256",
                        help="output length range lo,hi, or one length N (default: %(default)s)")
    parser.add_argument("--baselines", default=",".join(BASELINES),
                        help="comma list of %s, or none (default: all)" % ", ".join(BASELINES))
    parser.add_argument("--hf-batch1-prompts", type=int, default=6,
                        help="requests the batch-1 baseline runs (default: %(default)s)")
    parser.add_argument("--workload-seed", type=int, default=0, help="seed of the workload (default: %(default)s)")
    parser.add_argument("--sampling", type=parse_sampling, default={"temperature": 0.0},
                        help="how the requests sample, a JSON object of %s, e.g. Qwen2.5 Instruct's '{\"temperature\": "
                             "0.7, \"top_p\": 0.8, \"top_k\": 20, \"repetition_penalty\": 1.05}' (default: greedy)"
                             % ", ".join(SAMPLING_KEYS))
    parser.add_argument("--step-dtypes", default=DEFAULT_STEP_DTYPES,
                        help="batch-1 decode step section: comma list of dtypes, or none (default: %(default)s)")
    parser.add_argument("--step-context", type=positive_int, default=256,
                        help="context of the batch-1 steps, tokens (default: %(default)s)")
    parser.add_argument("--step-repeats", type=positive_int, default=50,
                        help="steps (and linear-floor passes) per median (default: %(default)s)")
    parser.add_argument("--save-result", action="store_true", help="write the JSON result file")
    parser.add_argument("--result-dir", default="results", help="where --save-result writes (default: %(default)s)")
    parser.add_argument("--result-filename", default=None, help="the JSON file's name (default: "
                        "offline-<date-time>.json)")
    return parser


def parse_sampling(text: str) -> dict[str, float]:
    """--sampling: a JSON object of SAMPLING_KEYS, checked as a request's would be."""
    from services.engine.sampling_params import SamplingParams

    try:
        sampling = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(sampling, dict) or set(sampling) - set(SAMPLING_KEYS):
        raise argparse.ArgumentTypeError(f"a JSON object of {', '.join(SAMPLING_KEYS)}, got {text!r}")
    try:
        SamplingParams(**sampling)
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return sampling


def make_workload(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                  seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(*input_len))] for _ in range(num_prompts)]
    return prompts, [rng.randint(*output_len) for _ in range(num_prompts)]


def run_strata(config, prompts, output_lens, sampling: dict[str, float]) -> dict[str, float]:
    from services.engine.llm import LLM
    from services.engine.sampling_params import SamplingParams

    try:
        llm = LLM(config)
    except ValueError as exc:  # flags or a checkpoint the engine refuses: its reason, not a traceback
        raise SystemExit(f"strata bench offline: {exc}") from None
    llm.core.warmup()  # as a server starts: the compiled (CPU) or captured (CUDA) graphs, unless --enforce-eager
    llm.generate([prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up, not counted
    params = [SamplingParams(**sampling, max_tokens=n, ignore_eos=True) for n in output_lens]
    started = time.perf_counter()
    completions = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    num_out = sum(len(c.token_ids) for c in completions)
    stats = llm.core.stats()
    return {"duration_s": seconds, "completed": len(completions), "total_output_tokens": num_out,
            "total_input_tokens": sum(map(len, prompts)), "output_throughput": num_out / seconds,
            "num_preemptions": stats.num_preemptions}


def _hf_model(model_dir: str, dtype: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype, "auto")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # every request runs to its length, as ignore_eos
    return model


def hf_sampling(sampling: dict[str, float]) -> dict:
    """``generate``'s arguments for the same sampling: what it does not name is off, as in ours (HF's own
    default generation config would add top_k 50)."""
    if sampling.get("temperature", 1.0) == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0, **sampling}


def run_hf_batch1(model, prompts, output_lens, sampling: dict[str, float]) -> dict[str, float]:
    import torch

    num_out, started = 0, time.perf_counter()
    with torch.inference_mode():
        for prompt, n in zip(prompts, output_lens):
            ids = torch.tensor([prompt], device=model.device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, pad_token_id=0,
                                 **hf_sampling(sampling))
            num_out += out.shape[1] - len(prompt)
    seconds = time.perf_counter() - started
    return {"duration_s": seconds, "completed": len(prompts), "total_output_tokens": num_out,
            "output_throughput": num_out / seconds}


def run_hf_static(model, prompts, output_lens, sampling: dict[str, float]) -> dict[str, float]:
    import torch

    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding, as HF batching of decoder-only models wants
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    started = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=max(output_lens), pad_token_id=0, **hf_sampling(sampling))
    seconds = time.perf_counter() - started
    useful = sum(output_lens)  # tokens past a request's own length are waste, not output
    return {"duration_s": seconds, "completed": len(prompts), "total_output_tokens": useful,
            "output_throughput": useful / seconds}


def parse_step_dtypes(value: str) -> list[str]:
    """--step-dtypes: a comma list of the engine's dtypes; none (or nothing) skips the batch-1 step
    section. Checked before anything runs, not after the workload."""
    from services.engine.config import DTYPES

    names = [name.strip() for name in value.split(",") if name.strip() and name.strip() != "none"]
    unknown = sorted(set(names) - set(DTYPES))
    if unknown:
        raise SystemExit(f"strata bench offline: --step-dtypes: unknown dtype(s) {unknown}; "
                         f"use a comma list of {', '.join(DTYPES)}, or none")
    return names


def main(argv: list[str] | None = None) -> int:
    import torch

    from services.bench.results import BenchResult, RunResult, save_result
    from services.engine.engine_args import config_from_args
    from services.engine.models.quantized_weights import INT8_AT_LOAD

    args = build_parser().parse_args(argv)
    baselines = [] if args.baselines == "none" else args.baselines.split(",")
    unknown = set(baselines) - set(BASELINES)
    if unknown:
        raise SystemExit(f"strata bench offline: unknown baseline(s) {sorted(unknown)}")
    step_dtypes = parse_step_dtypes(args.step_dtypes)
    if args.quantization == INT8_AT_LOAD and set(step_dtypes) - {"bfloat16"}:
        if args.step_dtypes != DEFAULT_STEP_DTYPES:
            raise SystemExit("strata bench offline: --quantization int8 serves bfloat16 only: --step-dtypes bfloat16")
        step_dtypes = ["bfloat16"]  # (the default's float32 row cannot run with int8 weights)
    with tempfile.TemporaryDirectory() as tmp:
        if not args.model:  # drawn on the engine's device, in its dtype (float32 for "auto")
            dtype = "float32" if args.dtype == "auto" else args.dtype
            print(f"writing a random-weight '{args.shape}' Llama checkpoint in {dtype} ...", file=sys.stderr)
            args.model = str(write_random_llama(Path(tmp) / args.shape, args.shape, dtype=dtype, device=args.device))
        config = config_from_args(args)
        device = torch.device(config.device)
        from services.engine.models.config import load_model_config

        model_config = load_model_config(config.model)
        prompts, output_lens = make_workload(args.num_prompts, args.input_len, args.output_len,
                                             model_config.vocab_size, args.workload_seed)
        runs = [RunResult("strata", params={"max_num_seqs": config.max_num_seqs, "sampling": args.sampling},
                          metrics=run_strata(config, prompts, output_lens, args.sampling))]
        _print_progress(runs[-1])
        if {"hf-batch1", "hf-static"} & set(baselines):
            model = _hf_model(config.model, config.dtype, config.device)
            if "hf-batch1" in baselines:
                k = min(args.hf_batch1_prompts, len(prompts))
                runs.append(RunResult("hf-batch1", params={"num_prompts": k, "sampling": args.sampling},
                                      metrics=run_hf_batch1(model, prompts[:k], output_lens[:k], args.sampling)))
                _print_progress(runs[-1])
            if "hf-static" in baselines:
                runs.append(RunResult("hf-static", params={"batch_size": len(prompts), "sampling": args.sampling},
                                      metrics=run_hf_static(model, prompts, output_lens, args.sampling)))
                _print_progress(runs[-1])
        read_bytes_per_s = measure_read_bandwidth(device=device) if "floor" in baselines or step_dtypes else 0.0
        if "floor" in baselines:
            runs.append(RunResult("floor", params={}, metrics=run_floor(
                model_config, model_config.resolve_dtype(config.dtype, device), prompts, output_lens, read_bytes_per_s,
                device)))
        step_rows = run_decode_floors(config, step_dtypes, args.step_context, args.step_repeats, read_bytes_per_s)
    print(format_table(runs))
    floor = next((run.metrics for run in runs if run.label == "floor"), None)
    if floor:
        print(f"floor: {floor['tflops']:.2f} TFLOP at {floor['gemm_gflops_per_s']:.0f} GFLOP/s (best GEMM here) + "
              f"{floor['kv_read_gb']:.1f} GB of K/V reads at {floor['read_gb_per_s']:.1f} GB/s")
    if step_rows:
        print(format_decode_floors(step_rows))
    # after the table, which lists the workload's runs only; `compare` pairs these by label too
    runs += [RunResult(f"decode-step-{row['dtype']}", params={"batch_size": 1, "context": row["context"]},
                       metrics={k: v for k, v in row.items() if k != "dtype"}) for row in step_rows]
    result = BenchResult("offline", config=vars(args), runs=runs)
    if args.save_result:
        name = args.result_filename or f"offline-{time.strftime('%Y%m%d-%H%M%S')}.json"
        print(f"result: {save_result(result, Path(args.result_dir) / name)}")
    return 0


def _print_progress(run) -> None:
    m = run.metrics
    print(f"  {run.label:<10} {m['total_output_tokens']:>7} tokens in {m['duration_s']:7.2f}s", file=sys.stderr)


def format_table(runs) -> str:
    strata = runs[0].metrics["output_throughput"]
    lines = ["=========== Offline benchmark: output tokens/s ===========",
             f"{'run':<12}{'tokens':>10}{'seconds':>10}{'tok/s':>10}{'strata / run':>14}"]
    for run in runs:
        m = run.metrics
        ratio = strata / m["output_throughput"]
        lines.append(f"{run.label:<12}{m['total_output_tokens']:>10}{m['duration_s']:>10.2f}"
                     f"{m['output_throughput']:>10.1f}{ratio:>13.2f}x")
    return "\n".join(lines)
