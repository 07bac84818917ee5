"""`strata bench structured`: what structured output costs, on one stack, in one run.

1. Throughput: the same prompts at --max-concurrency streams, first each constrained to a JSON schema
   (a 20-property object by default, --schema for your own), then unconstrained with each request's
   max_tokens set to the length its constrained run produced (eos ignored), so both runs generate
   the same tokens per request. Prints both output tok/s and their ratio.
2. Compilation: one stream, requests of one token: unconstrained, then each with a schema the engine
   has not seen (the default schema with renamed properties), then one schema repeated. The median
   time to first token of each, and what a new and a repeated schema add.

Starts `strata up` on --model (default: the built-in model) unless --base-url names a running server.
"""

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import uvloop

from services.bench.arg_types import positive_int
from services.bench.client import RequestSettings, open_session
from services.bench.datasets import BenchRequest
from services.bench.runner import RunPlan, send_all


def default_schema(suffix: str = "") -> dict:
    """20 properties of every common kind, bounded so a model with random weights finishes too."""
    kinds = [{"type": "string", "maxLength": 12}, {"type": "integer", "minimum": 0, "maximum": 1000},
             {"type": "number", "minimum": -1, "maximum": 1}, {"type": "boolean"},
             {"enum": ["red", "green", "blue"]},
             {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
             {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
             {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["x"], "additionalProperties": False}]
    properties = {f"field_{i}{suffix}": kinds[i % len(kinds)] for i in range(20)}
    return {"type": "object", "properties": properties, "required": list(properties)[:15],
            "additionalProperties": False}


def response_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata bench structured", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint to serve (default: the built-in model)")
    parser.add_argument("--base-url", help="a running server instead of starting one (default: none)")
    parser.add_argument("--served-model-name", default="bench",
                        help="model name to request (with --base-url) (default: %(default)s)")
    parser.add_argument("--engine-args", default="",
                        help="extra engine flags when starting the stack, one quoted string (default: none)")
    parser.add_argument("--schema", help="a JSON schema file (default: a 20-property object)")
    parser.add_argument("--num-prompts", type=positive_int, default=128,
                        help="requests of the throughput runs, each (default: %(default)s)")
    parser.add_argument("--max-concurrency", type=positive_int, default=64,
                        help="streams in flight, and the started engine's --max-num-seqs (default: %(default)s)")
    parser.add_argument("--prompt-len", type=positive_int, default=64,
                        help="prompt tokens (random ids) (default: %(default)s)")
    parser.add_argument("--max-tokens", type=positive_int, default=400,
                        help="max_tokens of the constrained requests (default: %(default)s)")
    parser.add_argument("--num-compile-probes", type=int, default=5,
                        help="requests per compilation probe (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts (default: %(default)s)")
    return parser


def _engine_mask_figures(before: dict, after: dict) -> str:
    """The engine's own account of the constrained run: per step with constrained requests, the time
    filling their masks and the part of it the step waited for after the model ran."""
    def delta(name: str) -> float:
        key = next((k for k in after if k.startswith(name)), None)
        return after[key][1] - before.get(key, ("", 0.0))[1] if key else 0.0

    steps = delta("strata:structured_output_mask_seconds_count")
    if not steps:
        return ""
    fill = delta("strata:structured_output_mask_seconds_sum") / steps
    wait = delta("strata:structured_output_mask_wait_seconds_sum") / steps
    compiled = delta("strata:structured_output_compile_seconds_count")
    return (f"engine, per constrained step ({steps:.0f} steps): masks filled in {fill * 1e3:.2f} ms while the "
            f"model ran, {wait * 1e3:.2f} ms waited for after it; {compiled:.0f} grammars compiled")


async def _throughput(base_url: str, model: str, schema: dict, args) -> tuple[float, float, int]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, 4000) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    url = base_url + "/v1/completions"
    constrained = RequestSettings(url=url, model=model, chat=False, temperature=1.0, extra_body=response_format(schema))
    plan = RunPlan(max_concurrency=args.max_concurrency)
    async with open_session(600) as session:
        await send_all(session, constrained, [BenchRequest(args.prompt_len, 8, prompts[0])], RunPlan())  # compiles it
        outputs, constrained_s = await send_all(
            session, constrained, [BenchRequest(len(p), args.max_tokens, p) for p in prompts], plan)
        failed = sum(not o.success for o in outputs)
        lengths = [max(o.output_tokens, 1) for o in outputs]
        free = RequestSettings(url=url, model=model, chat=False, temperature=1.0, ignore_eos=True)
        free_outputs, free_s = await send_all(session, free, [BenchRequest(len(p), n, p)
                                                              for p, n in zip(prompts, lengths)], plan)
        failed += sum(not o.success for o in free_outputs)
    return (sum(o.output_tokens for o in outputs) / constrained_s,
            sum(o.output_tokens for o in free_outputs) / free_s, failed)


async def _first_token_times(base_url: str, model: str, args) -> dict[str, float]:
    url = base_url + "/v1/completions"
    request = [BenchRequest(8, 1, list(range(100, 108)))]
    medians = {}
    async with open_session(120) as session:
        async def ttfts(bodies: list[dict]) -> float:
            times = []
            for body in bodies:
                settings = RequestSettings(url=url, model=model, chat=False, extra_body=body)
                (output,), _ = await send_all(session, settings, request, RunPlan())
                if not output.success:
                    raise RuntimeError(f"a probe failed: {output.error}")
                times.append(output.ttft)
            return statistics.median(times)

        n = args.num_compile_probes
        await ttfts([{}])  # warm-up
        medians["unconstrained"] = await ttfts([{}] * n)
        tag = random.Random().randrange(1 << 30)  # new to this engine, even on a reused server
        medians["new schema"] = await ttfts([response_format(default_schema(f"_{tag}_{i}")) for i in range(n)])
        medians["repeated schema"] = await ttfts([response_format(default_schema(f"_{tag}_0"))] * n)
    return medians


def _report(base_url: str, model: str, args, engine_metrics_url: str | None = None) -> int:
    schema = json.loads(Path(args.schema).read_text()) if args.schema else default_schema()
    before = _scrape(engine_metrics_url)
    constrained_tps, free_tps, failed = uvloop.run(_throughput(base_url, model, schema, args))
    masks = _engine_mask_figures(before, _scrape(engine_metrics_url)) if engine_metrics_url else ""
    ttft = uvloop.run(_first_token_times(base_url, model, args))
    print(f"============ Structured output: {args.num_prompts} requests, {args.max_concurrency} streams "
          f"============")
    print(f"{'run':<34}{'output tok/s':>14}")
    print(f"{'unconstrained (same lengths)':<34}{free_tps:>14.1f}")
    print(f"{'JSON schema':<34}{constrained_tps:>14.1f}")
    print(f"constrained / unconstrained: {constrained_tps / free_tps:.2f}x")
    if masks:
        print(masks)
    print(f"time to first token, one stream, median of {args.num_compile_probes}:")
    for name, seconds in ttft.items():
        print(f"  {name:<32}{seconds * 1e3:>9.1f} ms")
    print(f"a new schema adds {(ttft['new schema'] - ttft['unconstrained']) * 1e3:.1f} ms, a repeated one "
          f"{(ttft['repeated schema'] - ttft['unconstrained']) * 1e3:.1f} ms")
    if failed:
        print(f"{failed} requests failed", file=sys.stderr)
    return 1 if failed else 0


def _scrape(url: str | None) -> dict:
    if url is None:
        return {}
    import urllib.request

    from services.bench.server_metrics import parse_metrics

    with urllib.request.urlopen(url, timeout=5) as response:
        return parse_metrics(response.read().decode())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.base_url:
        return _report(args.base_url.rstrip("/"), args.served_model_name, args)
    from services.default_model.model import ensure_default_model
    from services.launcher import Stack, StackConfig, find_free_port

    model = args.model or str(ensure_default_model())
    engine_args = ["--max-num-seqs", str(args.max_concurrency), *args.engine_args.split()]
    with tempfile.TemporaryDirectory() as logs:
        config = StackConfig(model=model, port=find_free_port(), served_model_name="bench", engine_args=engine_args,
                             gateway_args=["--log-level", "warning"], log_dir=Path(logs), echo_logs=False)
        with Stack(config) as stack:
            return _report(stack.base_url, "bench", args, stack.metrics_urls.get("engine"))


if __name__ == "__main__":
    raise SystemExit(main())
