"""`strata bench routing`: what prefix-aware routing buys. The same shared-prefix requests run twice
in one invocation, each time through a fresh stack of `--replicas` engines behind the router: once
with the router's `cache-aware` policy (prefix-cache overlap while the load is balanced), once with
`round-robin` (the baseline, blind to caches). Printed per policy: the engines' prefix-cache hit
rate (cached prompt tokens / prompt tokens looked up), output tokens/s, and time to first token;
then cache-aware / round-robin. The default pools (`--num-kv-blocks`) hold about five of the eight
system prompts each: enough for half of them, as a router that splits them would place them, not
for all of them, as round-robin asks.

Workload: `--prefix-num` system prompts of `--prefix-len` tokens, each request one of them (chosen at
random) followed by `--suffix-len` tokens of its own, generating `--output-len` tokens (EOS
ignored, greedy), `--max-concurrency` in flight. Requests are token ids from the model's vocabulary.
"""

import argparse
import random
import shlex
import sys
import tempfile
from pathlib import Path

import numpy as np
import uvloop

from services.bench.arg_types import positive_int
from services.bench.checkpoints import SHAPES, write_random_llama
from services.launcher import Stack, StackConfig, find_free_port  # first: it turns gRPC's fork handlers off

POLICIES = ("cache-aware", "round-robin")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata bench routing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the built-in model)")
    parser.add_argument("--shape", choices=sorted(SHAPES),
                        help="a random-weight Llama of this shape instead (default: none)")
    parser.add_argument("--replicas", type=int, default=2, help="engines behind the router (default: %(default)s)")
    parser.add_argument("--num-prompts", type=positive_int, default=128,
                        help="requests per policy (default: %(default)s)")
    parser.add_argument("--max-concurrency", type=positive_int, default=8,
                        help="requests in flight (default: %(default)s)")
    parser.add_argument("--prefix-num", type=positive_int, default=8, help="system prompts (default: %(default)s)")
    parser.add_argument("--prefix-len", type=positive_int, default=512,
                        help="tokens per system prompt (default: %(default)s)")
    parser.add_argument("--suffix-len", type=int, default=32,
                        help="tokens of each request's own question (default: %(default)s)")
    parser.add_argument("--output-len", type=positive_int, default=16,
                        help="tokens generated per request (default: %(default)s)")
    parser.add_argument("--num-kv-blocks", type=positive_int, default=160,
                        help="each engine's pool (default: %(default)s)")
    parser.add_argument("--workload-seed", type=int, default=0, help="seed of the prompts (default: %(default)s)")
    parser.add_argument("--engine-args", default="",
                        help="more flags for every engine, one quoted string, as `strata up --engine-args`, e.g. "
                             "\"--dtype bfloat16\" (a single flag: --engine-args=--enforce-eager) (default: none)")
    return parser


def make_workload(args, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.workload_seed)
    prefixes = [[rng.randrange(vocab_size) for _ in range(args.prefix_len)] for _ in range(args.prefix_num)]
    return [rng.choice(prefixes) + [rng.randrange(vocab_size) for _ in range(args.suffix_len)]
            for _ in range(args.num_prompts)]


async def _send(base_url: str, prompts: list[list[int]], output_len: int, concurrency: int):
    from services.bench.client import RequestSettings, open_session
    from services.bench.datasets import BenchRequest
    from services.bench.runner import RunPlan, send_all

    settings = RequestSettings(url=base_url + "/v1/completions", model="bench", chat=False, ignore_eos=True,
                               temperature=0.0)
    requests = [BenchRequest(prompt_len=len(p), output_len=output_len, prompt=p) for p in prompts]
    async with open_session(600) as session:
        return await send_all(session, settings, requests, RunPlan(max_concurrency=concurrency))


def run_policy(args, model_dir: str, policy: str, prompts: list[list[int]]) -> dict[str, float]:
    import grpc

    from services.common.pb import engine_pb2, engine_pb2_grpc

    with tempfile.TemporaryDirectory() as logs:
        config = StackConfig(model=model_dir, port=find_free_port(), served_model_name="bench", replicas=args.replicas,
                             engine_args=["--num-kv-blocks", str(args.num_kv_blocks),
                                          "--max-num-seqs", str(args.max_concurrency), *shlex.split(args.engine_args)],
                             router_args=["--policy", policy], gateway_args=["--log-level", "warning"],
                             log_dir=Path(logs), echo_logs=False)
        with Stack(config) as stack:
            _wait_for_replicas(stack.engine_addr, args.replicas * args.num_kv_blocks)
            outputs, seconds = uvloop.run(_send(stack.base_url, prompts, args.output_len, args.max_concurrency))
            with grpc.insecure_channel(stack.engine_addr) as channel:
                load = engine_pb2_grpc.EngineStub(channel).Load(engine_pb2.LoadRequest(), timeout=10)
    done = [o for o in outputs if o.success]
    ttfts = np.array([o.ttft for o in done]) * 1000
    return {"failed": len(outputs) - len(done), "seconds": seconds,
            "output_throughput": sum(o.output_tokens for o in done) / seconds,
            "prefix_hit_rate": load.prefix_cache_hits / max(load.prefix_cache_queries, 1),
            "mean_ttft_ms": float(ttfts.mean()), "p90_ttft_ms": float(np.percentile(ttfts, 90))}


def _wait_for_replicas(router_addr: str, total_kv_blocks: int, timeout_s: float = 60.0) -> None:
    """Until the router has checked every replica healthy (its Info sums their pools)."""
    import time

    import grpc

    from services.common.pb import engine_pb2, engine_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(router_addr) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        while stub.Info(engine_pb2.EngineInfoRequest(), timeout=10).num_kv_blocks < total_kv_blocks:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the router did not see {total_kv_blocks} KV blocks in {timeout_s:.0f} s")
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.replicas < 2:
        raise SystemExit("strata bench routing: --replicas must be >= 2")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if args.shape:
            model_dir = str(write_random_llama(Path(tmp) / args.shape, args.shape, servable=True))
        if model_dir is None:
            from services.default_model.model import ensure_default_model
            model_dir = str(ensure_default_model())
        from services.engine.models.config import load_model_config

        prompts = make_workload(args, load_model_config(model_dir).vocab_size)
        results = {}
        for policy in POLICIES:
            print(f"  {policy}: {len(prompts)} requests through {args.replicas} replicas ...", file=sys.stderr)
            results[policy] = run_policy(args, model_dir, policy, prompts)
    print(format_table(results))
    return 1 if any(r["failed"] for r in results.values()) else 0


def format_table(results: dict[str, dict[str, float]]) -> str:
    rows = [("prefix-cache hit rate", "prefix_hit_rate", "{:.1%}"), ("output tokens/s", "output_throughput", "{:.1f}"),
            ("mean TTFT (ms)", "mean_ttft_ms", "{:.1f}"), ("P90 TTFT (ms)", "p90_ttft_ms", "{:.1f}")]
    aware, base = results["cache-aware"], results["round-robin"]
    lines = ["============ Routing: cache-aware vs round-robin ============",
             f"{'':<24}{'cache-aware':>12}{'round-robin':>14}{'aware / rr':>12}"]
    for label, key, fmt in rows:
        ratio = aware[key] / base[key] if base[key] else float("nan")
        lines.append(f"{label:<24}{fmt.format(aware[key]):>12}{fmt.format(base[key]):>14}{ratio:>11.2f}x")
    return "\n".join(lines)
