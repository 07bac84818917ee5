"""`strata bench serve`: load-test a running OpenAI-compatible server (flags as `vllm bench serve`).

Sends traffic only to --base-url (proxy variables are ignored). Each sweep point (every
--request-rate x --max-concurrency value) gets its own seed-derived workload, so prefix caching
carries nothing from one point to the next. Another invocation with the same --seed sends the same
prompts again: where the server reports cached prompt tokens (`usage.prompt_tokens_details`), the
result shows how many of the input tokens its prefix cache already held ("Cached input tokens"), so
that such a warm run is not read as a cold one (on the small model through `strata up`, 64 streams in
bfloat16: 2,150-2,280 output tokens/s with fresh prompts, 2,650-3,060 repeating an earlier run's).

With --baseline-url, every sweep point runs twice, on --base-url and then on the baseline server,
with the same requests (same seed), and a side-by-side table with the ratios ends the output;
--save-result then also writes the baseline's result as `<name>-<baseline-name>.json`, which
`strata bench compare` reads like any other.

With --request-rate-schedule RATE:SECONDS,... the arrival rate steps through the segments in one
run (a ramp, or a step sweep); the schedule decides how many requests there are. A schedule, or
--timeline-metrics-url, also records a timeline: every --timeline-interval seconds the metrics URLs
are scraped for the autoscaler's replica counts and the waiting requests, beside the client's rate,
in-flight count and TTFT; it goes into the result JSON and `<name>_timeline.png`.
"""

import argparse
import datetime
import itertools
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import uvloop

from services.bench import report, server_metrics
from services.bench.client import RequestSettings, open_session
from services.bench.datasets import DATASETS, DatasetSpec, sample_requests
from services.bench.progress import make_progress
from services.bench.results import BenchResult, RunResult, save_result
from services.bench.runner import RunPlan, run_point
from services.bench.schedule import RateSchedule
from services.bench.stats import LATENCY_METRICS, parse_goodput
from services.bench.timeline import TimelineSettings

DEFAULT_NUM_PROMPTS = 1000


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _schedule(text: str) -> RateSchedule:
    try:
        return RateSchedule.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default: %(default)s)")
    target.add_argument("--endpoint", default="/v1/completions",
                        help="/v1/completions or /v1/chat/completions (default: %(default)s)")
    target.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    target.add_argument("--baseline-url", default=None,
                        help="a second OpenAI-compatible server to run the same workload on, e.g. llama-server "
                             "(default: none)")
    target.add_argument("--baseline-model", default=None, help="model name there (default: its first of /v1/models)")
    target.add_argument("--baseline-name", default="baseline",
                        help="the baseline's name in tables and file names (default: %(default)s)")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    data = p.add_argument_group("workload")
    data.add_argument("--dataset-name", default="random", choices=DATASETS,
                      help="random: random prompts of --random-input-len; fixed: one prompt repeated; shared-prefix: "
                           "--prefix-num system prompts before each user's question; custom: --dataset-path "
                           "(default: %(default)s)")
    data.add_argument("--dataset-path", default=None, help="custom: ShareGPT JSON or JSONL of {prompt, output_tokens}")
    data.add_argument("--num-prompts", type=int, default=None,
                      help=f"requests per sweep point (default: {DEFAULT_NUM_PROMPTS}); with "
                           "--request-rate-schedule the schedule sets the count, and this, when given, is a bound "
                           "it must not exceed")
    data.add_argument("--num-warmups", type=int, default=0,
                      help="requests sent first and not counted (default: %(default)s)")
    data.add_argument("--prompt-format", default="auto", choices=("auto", "token-ids", "text"),
                      help="auto: token ids on /v1/completions, text on chat (default: %(default)s)")
    data.add_argument("--random-input-len", type=int, default=1024,
                      help="prompt tokens (random, fixed; random: their mean with --random-range-ratio) "
                           "(default: %(default)s)")
    data.add_argument("--random-output-len", type=int, default=128,
                      help="max_tokens of each request (random: their mean with a range ratio; custom: when a "
                           "conversation has no reply) (default: %(default)s)")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="random: lengths uniform in len x (1 ± r), r in [0, 1) (default: %(default)s: exact "
                           "lengths)")
    data.add_argument("--random-output-range-ratio", type=float, default=None,
                      help="the outputs' own range ratio (default: --random-range-ratio)")
    data.add_argument("--random-vocab-size", type=int, default=256,
                      help="token-id prompts draw ids from [0, N); keep N within the model's vocabulary "
                           "(default: %(default)s)")
    data.add_argument("--prefix-num", type=int, default=4,
                      help="shared-prefix: number of system prompts (default: %(default)s)")
    data.add_argument("--prefix-len", type=int, default=512,
                      help="shared-prefix: tokens per system prompt (default: %(default)s)")
    data.add_argument("--suffix-len", type=int, default=64,
                      help="shared-prefix: tokens of each user's question (default: %(default)s)")
    data.add_argument("--custom-output-len", type=int, default=None,
                      help="custom: max_tokens for every request (default: each conversation's own)")
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=_floats, default=None,
                      help="requests/s, Poisson arrivals; inf = all at once (default); a comma list sweeps")
    load.add_argument("--request-rate-schedule", type=_schedule, default=None, metavar="RATE:SECONDS,...",
                      help="a rate that changes during one run, e.g. 2:60,20:120,2:120: each segment's rate "
                           "(requests/s, finite, 0 pauses) for its seconds, in order; replaces --request-rate")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the gaps (1.0 = Poisson) (default: %(default)s)")
    load.add_argument("--max-concurrency", type=_ints, default=[None],
                      help="cap on requests in flight; a comma list sweeps (default: none)")
    load.add_argument("--max-duration", type=float, default=None,
                      help="stop each sweep point after this many seconds (default: none)")
    load.add_argument("--request-timeout", type=float, default=600.0,
                      help="seconds to wait for any response byte (default: %(default)s)")
    load.add_argument("--seed", type=int, default=0,
                      help="seed of the workload; sweep point i uses seed + i (default: %(default)s)")
    fleet = p.add_argument_group("timeline (recorded with a schedule or --timeline-metrics-url)")
    fleet.add_argument("--timeline-metrics-url", action="append", default=None, metavar="URL",
                       help="Prometheus /metrics to scrape during the run for the autoscaler's replica counts "
                            "and waiting requests (the autoscaler's, or every engine's: strata up lists them); "
                            "repeat or comma-separate (default: the target's /metrics)")
    fleet.add_argument("--timeline-interval", type=float, default=1.0,
                       help="seconds between timeline samples (default: %(default)s)")
    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (exact output lengths)")
    sampling.add_argument("--temperature", type=float, default=None,
                          help="sent as temperature (default: not sent, the server's default)")
    sampling.add_argument("--continuous-usage-stats", action="store_true",
                          help="ask for usage in every chunk (vLLM extension): exact tokens per chunk")
    sampling.add_argument("--extra-body", type=json.loads, default={},
                          help="JSON merged into every request body (default: none)")
    out = p.add_argument_group("output")
    out.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                     help="sections to print, a comma list (default: %(default)s)")
    out.add_argument("--metric-percentiles", type=_floats, default=[90.0, 99.0],
                     help="percentiles printed per metric, a comma list (default: 90,99)")
    out.add_argument("--goodput", nargs="+", default=None,
                     help="SLOs in ms, e.g. ttft:200 tpot:50 (default: none, no goodput)")
    out.add_argument("--save-result", action="store_true", help="write the JSON result and PNG plots")
    out.add_argument("--save-detailed", action="store_true", help="keep per-request samples in the JSON")
    out.add_argument("--result-dir", default=".", help="where --save-result writes (default: %(default)s)")
    out.add_argument("--result-filename", default=None,
                     help="the JSON file's name (default: serve-<dataset>-<model>-<date-time>.json)")
    out.add_argument("--no-plots", action="store_true", help="with --save-result, skip the PNGs")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar (default: one per sweep point)")
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
    timeline: TimelineSettings | None = None


def resolve_load(args: argparse.Namespace) -> None:
    """Fills --request-rate's and --num-prompts' defaults, which depend on --request-rate-schedule."""
    if args.request_rate_schedule is None:
        args.request_rate = args.request_rate or [math.inf]
        args.num_prompts = DEFAULT_NUM_PROMPTS if args.num_prompts is None else args.num_prompts
        return
    if args.request_rate is not None:
        raise ValueError("--request-rate-schedule sets the rate over the run; leave out --request-rate "
                         "(a schedule such as 1:30,2:30,4:30 is a step sweep in one run)")


def timeline_settings(args: argparse.Namespace, base_url: str, explicit: bool) -> TimelineSettings | None:
    """What to scrape during a run on `base_url`: --timeline-metrics-url where `explicit`, else its own
    /metrics; None (no timeline) without a schedule or --timeline-metrics-url."""
    urls = [u.strip() for item in args.timeline_metrics_url or [] for u in item.split(",") if u.strip()]
    if args.timeline_metrics_url is not None and not urls:
        raise ValueError("--timeline-metrics-url is empty; give a URL such as http://127.0.0.1:8000/metrics")
    if args.request_rate_schedule is None and not urls:
        return None
    if not (explicit and urls):
        urls = [server_metrics.metrics_url(base_url)]
    return TimelineSettings(tuple(urls), args.timeline_interval)


def plan_size(plan: RunPlan, num_prompts: int | None) -> int:
    """How many requests a sweep point sends: --num-prompts, or what its schedule generates."""
    if plan.schedule is None:
        return num_prompts
    num_scheduled = len(plan.offsets())
    if num_scheduled == 0:
        raise ValueError(f"--request-rate-schedule {plan.schedule} generates no request with seed {plan.seed}; "
                         "raise a rate or a duration")
    if num_prompts is not None and num_scheduled > num_prompts:
        raise ValueError(f"--request-rate-schedule {plan.schedule} generates {num_scheduled} requests with seed "
                         f"{plan.seed}, more than --num-prompts {num_prompts}; raise --num-prompts or leave it "
                         "out (with a schedule the schedule sets the count)")
    return num_scheduled


async def run(args: argparse.Namespace) -> tuple[BenchResult, BenchResult | None]:
    """The result on --base-url and, with --baseline-url, the baseline's on the same requests."""
    chat = args.endpoint.rstrip("/").endswith("chat/completions")
    spec = dataset_spec(args, chat)
    slos = parse_goodput(args.goodput)
    metrics_shown = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if set(metrics_shown) - set(LATENCY_METRICS):
        raise ValueError(f"--percentile-metrics {args.percentile_metrics}: use {','.join(LATENCY_METRICS)}")
    resolve_load(args)
    if (args.num_prompts is not None and args.num_prompts < 1) or args.num_warmups < 0:
        raise ValueError("--num-prompts must be >= 1 and --num-warmups >= 0")
    rates = [math.inf] if args.request_rate_schedule is not None else args.request_rate
    plans = [RunPlan(request_rate=rate, burstiness=args.burstiness, max_concurrency=conc,
                     max_duration=args.max_duration, seed=args.seed + i, schedule=args.request_rate_schedule)
             for i, (rate, conc) in enumerate(itertools.product(rates, args.max_concurrency))]
    sizes = [plan_size(plan, args.num_prompts) for plan in plans]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # explicit --timeline-metrics-url watch the fleet behind --base-url; a baseline is watched on its own
    urls_models = [("strata", args.base_url, args.model, timeline_settings(args, args.base_url, explicit=True))]
    if args.baseline_url:
        urls_models.append((args.baseline_name, args.baseline_url, args.baseline_model,
                            timeline_settings(args, args.baseline_url, explicit=False)))
    async with open_session(args.request_timeout, headers) as session:
        targets = []
        for name, url, model, timeline in urls_models:
            url = url.rstrip("/")
            settings = RequestSettings(url=url + args.endpoint, model=model or await first_model(session, url),
                                       chat=chat, ignore_eos=args.ignore_eos, temperature=args.temperature,
                                       continuous_usage_stats=args.continuous_usage_stats, extra_body=args.extra_body)
            targets.append(Target(name, url, settings, timeline))
        runs: dict[str, list[RunResult]] = {target.name: [] for target in targets}
        for plan, num_requests in zip(plans, sizes):
            sampled = sample_requests(spec, num_requests + args.num_warmups, plan.seed)
            requests, warmups = sampled[:num_requests], sampled[num_requests:]
            for target in targets:
                label = plan.label if len(targets) == 1 else f"{target.name}: {plan.label}"
                progress = make_progress(len(requests), label, disabled=args.disable_tqdm)
                result = await run_point(session, target.settings, requests, warmups, plan,
                                         server_metrics.metrics_url(target.base_url), args.metric_percentiles, slos,
                                         on_done=progress.update, timeline=target.timeline)
                progress.close()
                if len(targets) > 1:
                    print(f"--- {target.name} ({target.base_url}) ---")
                print(report.format_run(result, metrics_shown, args.metric_percentiles), flush=True)
                if result.segments:
                    print(report.format_segments(result.segments), flush=True)
                runs[target.name].append(result)
    for target in targets:
        if len(plans) > 1:
            if len(targets) > 1:
                print(f"{target.name}:")
            print(report.format_sweep(runs[target.name]), flush=True)
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    if args.request_rate_schedule is None:
        config["request_rate"] = [r if math.isfinite(r) else "inf" for r in args.request_rate]
    else:
        config["request_rate_schedule"] = [{"rate": s.rate, "duration_s": s.duration_s}
                                           for s in args.request_rate_schedule.segments]
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
        from services.bench.plots import write_plots, write_timeline_plots

        paths += write_plots(result.runs, directory, stem)
        paths += write_timeline_plots(result.runs, directory, stem)
    if not args.save_detailed:
        for run in result.runs:
            run.samples = None
    paths.insert(0, save_result(result, directory / filename))
    return paths


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        # uvloop: the clients share the machine's cores with the server; on asyncio's own loop they took a
        # fifth more CPU per streamed token (0.20 against 0.16 ms at one stream, `strata bench overhead`)
        result, baseline = uvloop.run(run(args))
    except (ValueError, aiohttp.ClientError) as exc:
        print(f"strata bench serve: {exc}", file=sys.stderr)
        return 2
    if args.save_result:
        for path in write_outputs(result, args, baseline):
            print(f"wrote {path}")
    runs = result.runs + (baseline.runs if baseline else [])
    return 0 if all(run.metrics["completed"] > 0 for run in runs) else 1
