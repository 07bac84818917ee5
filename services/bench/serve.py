"""`strata bench serve`: load-test a running OpenAI-compatible server (flags as `vllm bench serve`).

Sends traffic only to --base-url (proxy variables are ignored). Each sweep point (every
--request-rate x --max-concurrency value) gets its own seed-derived workload, so prefix caching
carries nothing from one point to the next.

With --baseline-url, every sweep point runs twice, on --base-url and then on the baseline server,
with the same requests (same seed), and a side-by-side table with the ratios ends the output;
--save-result then also writes the baseline's result as `<name>-<baseline-name>.json`, which
`strata bench compare` reads like any other.
"""

import argparse
import asyncio
import datetime
import itertools
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from services.bench import report, server_metrics
from services.bench.client import RequestSettings, open_session
from services.bench.datasets import DATASETS, DatasetSpec, sample_requests
from services.bench.progress import make_progress
from services.bench.results import BenchResult, RunResult, save_result
from services.bench.runner import RunPlan, run_point
from services.bench.stats import LATENCY_METRICS, parse_goodput


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, e.g. http://127.0.0.1:8000")
    target.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    target.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    target.add_argument("--baseline-url", default=None,
                        help="a second OpenAI-compatible server to run the same workload on, e.g. llama-server")
    target.add_argument("--baseline-model", default=None, help="model name there (default: its first of /v1/models)")
    target.add_argument("--baseline-name", default="baseline", help="the baseline's name in tables and file names")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    data = p.add_argument_group("workload")
    data.add_argument("--dataset-name", default="random", choices=DATASETS)
    data.add_argument("--dataset-path", default=None, help="custom: ShareGPT JSON or JSONL of {prompt, output_tokens}")
    data.add_argument("--num-prompts", type=int, default=1000, help="requests per sweep point")
    data.add_argument("--num-warmups", type=int, default=0, help="requests sent first and not counted")
    data.add_argument("--prompt-format", default="auto", choices=("auto", "token-ids", "text"),
                      help="auto: token ids on /v1/completions, text on chat")
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0)
    data.add_argument("--random-output-range-ratio", type=float, default=None,
                      help="the outputs' own range ratio (default: --random-range-ratio)")
    data.add_argument("--random-vocab-size", type=int, default=256,
                      help="token-id prompts draw ids from [0, N); keep N within the model's vocabulary")
    data.add_argument("--prefix-num", type=int, default=4, help="shared-prefix: number of system prompts")
    data.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens per system prompt")
    data.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: tokens of each user's question")
    data.add_argument("--custom-output-len", type=int, default=None, help="custom: max_tokens for every request")
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=_floats, default=[math.inf],
                      help="requests/s, Poisson arrivals; inf = all at once; a comma list sweeps")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1.0 = Poisson)")
    load.add_argument("--max-concurrency", type=_ints, default=[None],
                      help="cap on requests in flight; a comma list sweeps")
    load.add_argument("--max-duration", type=float, default=None, help="stop each sweep point after this many seconds")
    load.add_argument("--request-timeout", type=float, default=600.0, help="seconds to wait for any response byte")
    load.add_argument("--seed", type=int, default=0)
    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (exact output lengths)")
    sampling.add_argument("--temperature", type=float, default=None)
    sampling.add_argument("--continuous-usage-stats", action="store_true",
                          help="ask for usage in every chunk (vLLM extension): exact tokens per chunk")
    sampling.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    out = p.add_argument_group("output")
    out.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", help="sections to print")
    out.add_argument("--metric-percentiles", type=_floats, default=[90.0, 99.0])
    out.add_argument("--goodput", nargs="+", default=None, help="SLOs in ms, e.g. ttft:200 tpot:50")
    out.add_argument("--save-result", action="store_true", help="write the JSON result and PNG plots")
    out.add_argument("--save-detailed", action="store_true", help="keep per-request samples in the JSON")
    out.add_argument("--result-dir", default=".")
    out.add_argument("--result-filename", default=None)
    out.add_argument("--no-plots", action="store_true", help="with --save-result, skip the PNGs")
    out.add_argument("--disable-tqdm", action="store_true")
    return p


def dataset_spec(args: argparse.Namespace, chat: bool) -> DatasetSpec:
    token_ids = {"auto": not chat, "token-ids": True, "text": False}[args.prompt_format]
    return DatasetSpec(name=args.dataset_name, chat=chat, token_ids=token_ids, vocab_size=args.random_vocab_size,
                       input_len=args.random_input_len, output_len=args.random_output_len,
                       range_ratio=args.random_range_ratio, output_range_ratio=args.random_output_range_ratio,
                       prefix_num=args.prefix_num,
                       prefix_len=args.prefix_len, suffix_len=args.suffix_len, dataset_path=args.dataset_path,
                       custom_output_len=args.custom_output_len)


async def first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url}/v1/models", timeout=aiohttp.ClientTimeout(total=10.0)) as response:
        response.raise_for_status()
        models = (await response.json()).get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


@dataclass(frozen=True)
class Target:
    """A server under load: where its requests go and what they say."""

    name: str
    base_url: str
    settings: RequestSettings


async def run(args: argparse.Namespace) -> tuple[BenchResult, BenchResult | None]:
    """The result on --base-url and, with --baseline-url, the baseline's on the same requests."""
    chat = args.endpoint.rstrip("/").endswith("chat/completions")
    spec = dataset_spec(args, chat)
    slos = parse_goodput(args.goodput)
    metrics_shown = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if set(metrics_shown) - set(LATENCY_METRICS):
        raise ValueError(f"--percentile-metrics {args.percentile_metrics}: use {','.join(LATENCY_METRICS)}")
    if args.num_prompts < 1 or args.num_warmups < 0:
        raise ValueError("--num-prompts must be >= 1 and --num-warmups >= 0")
    plans = [RunPlan(request_rate=rate, burstiness=args.burstiness, max_concurrency=conc,
                     max_duration=args.max_duration, seed=args.seed + i)
             for i, (rate, conc) in enumerate(itertools.product(args.request_rate, args.max_concurrency))]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    urls_models = [("strata", args.base_url, args.model)]
    if args.baseline_url:
        urls_models.append((args.baseline_name, args.baseline_url, args.baseline_model))
    async with open_session(args.request_timeout, headers) as session:
        targets = []
        for name, url, model in urls_models:
            url = url.rstrip("/")
            settings = RequestSettings(url=url + args.endpoint, model=model or await first_model(session, url),
                                       chat=chat, ignore_eos=args.ignore_eos, temperature=args.temperature,
                                       continuous_usage_stats=args.continuous_usage_stats, extra_body=args.extra_body)
            targets.append(Target(name, url, settings))
        runs: dict[str, list[RunResult]] = {target.name: [] for target in targets}
        for plan in plans:
            sampled = sample_requests(spec, args.num_prompts + args.num_warmups, plan.seed)
            requests, warmups = sampled[:args.num_prompts], sampled[args.num_prompts:]
            for target in targets:
                label = plan.label if len(targets) == 1 else f"{target.name}: {plan.label}"
                progress = make_progress(len(requests), label, disabled=args.disable_tqdm)
                result = await run_point(session, target.settings, requests, warmups, plan,
                                         server_metrics.metrics_url(target.base_url), args.metric_percentiles, slos,
                                         on_done=progress.update)
                progress.close()
                if len(targets) > 1:
                    print(f"--- {target.name} ({target.base_url}) ---")
                print(report.format_run(result, metrics_shown, args.metric_percentiles), flush=True)
                runs[target.name].append(result)
    for target in targets:
        if len(plans) > 1:
            if len(targets) > 1:
                print(f"{target.name}:")
            print(report.format_sweep(runs[target.name]), flush=True)
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    config["request_rate"] = [r if math.isfinite(r) else "inf" for r in args.request_rate]
    results = [BenchResult(kind="serve", runs=runs[target.name],
                           config=dict(config, model=target.settings.model, base_url=target.base_url))
               for target in targets]
    if len(results) == 1:
        return results[0], None
    print(report.format_side_by_side(results[0].runs, results[1].runs, "strata", args.baseline_name), flush=True)
    return results[0], results[1]


def default_stem(args: argparse.Namespace, model: str) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"serve-{args.dataset_name}-{Path(model).name or 'model'}-{stamp}"


def write_outputs(result: BenchResult, args: argparse.Namespace, baseline: BenchResult | None = None) -> list[Path]:
    """The result (and the baseline's beside it, as `<stem>-<baseline-name>.json`), with plots."""
    stem = Path(args.result_filename).stem if args.result_filename else default_stem(args, result.config["model"])
    paths = _write_result(result, args, stem, args.result_filename or f"{stem}.json")
    if baseline is not None:
        paths += _write_result(baseline, args, f"{stem}-{args.baseline_name}", f"{stem}-{args.baseline_name}.json")
    return paths


def _write_result(result: BenchResult, args: argparse.Namespace, stem: str, filename: str) -> list[Path]:
    directory = Path(args.result_dir)
    paths = []
    if not args.no_plots:
        from services.bench.plots import write_plots

        paths += write_plots(result.runs, directory, stem)
    if not args.save_detailed:
        for run in result.runs:
            run.samples = None
    paths.insert(0, save_result(result, directory / filename))
    return paths


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result, baseline = asyncio.run(run(args))
    except (ValueError, aiohttp.ClientError) as exc:
        print(f"strata bench serve: {exc}", file=sys.stderr)
        return 2
    if args.save_result:
        for path in write_outputs(result, args, baseline):
            print(f"wrote {path}")
    runs = result.runs + (baseline.runs if baseline else [])
    return 0 if all(run.metrics["completed"] > 0 for run in runs) else 1
