"""`strata bench overhead`: what serving costs. The same requests run twice in one invocation:
through the whole stack (gateway → engine gRPC → detokenized in the gateway → SSE, streamed by
concurrent clients) and in-process on the engine alone; output tokens/s of both and their ratio,
and the median time per output token (TPOT, after the first) of both: at one stream the in-process
TPOT is the engine's decode step, so their ratio is what the stack adds per token.

Both runs use the same engine settings, with `--max-num-seqs` set to `--max-concurrency`, so the
in-process engine batches as many requests as the clients keep in flight. Requests are token-id
prompts of `--input-len` tokens ± `--range-ratio`, each generating `--output-len` tokens (EOS
ignored, greedy).

On a machine whose speed drifts (a shared VM: 20-40% between runs minutes apart), `--repeats N`
runs the pair N times, in-process then stack each time, with the engine loaded and the stack
started once; it prints every pair and the median of the pairs' ratios, the figure to quote. Pair k
draws its requests with seed `--workload-seed` + k: both engines' prefix caches still hold the
earlier pairs' prompts, which the same requests again would find there.

Both engines hold the model and a KV pool. Where the device has no room for both at once (on the CPU:
what loading the in-process engine took plus its whole KV pool, against what /proc/meminfo says is
still available; on a GPU: its allocated memory against the GPU's free memory; a tenth to spare), or
with `--run-order phased`, the in-process runs all go first, that engine is freed, and then
the stack starts for its runs: the pairs no longer alternate, so a drift of the machine's speed
between the phases shows in the ratios.

Where the stack's time goes: the CPU each of its processes (engine, gateway, tokenizer) spent per
generated token during the stack runs, from /proc (Linux), median over the pairs; beside it the
clients' (this process during the stack runs) and the in-process engine's. On a machine whose cores
the engine's threads fill, the other processes' CPU is about what the engine's steps lose: the last
line turns it into the stack's expected rate, in-process engine CPU over that plus the others'
(gateway, tokenizer, clients) per token. Measured ratios land near it: above where the engine's idle
threads spin (at one stream), below where preemption costs more than the CPU taken. What shows the
latter: the share of the cores' time that was idle during each kind of run (/proc/stat, the whole
machine). The engine's kernel threads end each phase of a step together, so when another process
takes the core of one of them mid-phase, the other finishes the phase's other work items (taking
over the rest of the taken thread's run of them once it makes no progress, `work_split.h`) and then
waits for the item in the taken thread's hands with its core idle (Linux does not move a thread that
just ran to another core at once): the stack's runs idle more than the in-process ones although its
other processes need CPU (small, bfloat16, 64 streams on 2 cores: 6.3-7.4% against 5.0-6.0%).

Python run between decode steps costs more here than alone: each step streams the weights and the
K/V through both cores' caches, so the gateway, the clients and the engine's own serving code start
each round cold. The gateway's per-token path took 14 us of CPU in one process fed replies back to
back (the same classes, a loopback socket) against ~2.4x that in the stack (small, bfloat16, 64
streams); the engine's handing each output on and building the step's message 2.3 us per output alone
(without the gRPC write) against ~7.5 in the stack (with it).
"""

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import uvloop

from services.bench.arg_types import positive_int
from services.bench.checkpoints import SHAPES, write_random_llama


def build_parser() -> argparse.ArgumentParser:
    from services.engine.engine_args import add_engine_args

    parser = argparse.ArgumentParser(prog="strata bench overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--shape", choices=sorted(SHAPES),
                        help="a random-weight Llama of this shape (vocabulary of the built-in tokenizer) "
                             "instead of --model (default: none)")
    parser.add_argument("--num-prompts", type=positive_int, default=128, help="requests per run (default: %(default)s)")
    parser.add_argument("--max-concurrency", type=positive_int, default=32,
                        help="streams in flight, and both runs' --max-num-seqs (default: %(default)s)")
    parser.add_argument("--input-len", type=positive_int, default=128, help="mean prompt tokens (default: %(default)s)")
    parser.add_argument("--output-len", type=positive_int, default=64,
                        help="mean tokens generated (default: %(default)s)")
    parser.add_argument("--range-ratio", type=float, default=0.5,
                        help="lengths uniform in len·(1±r) (default: %(default)s)")
    parser.add_argument("--workload-seed", type=int, default=0, help="seed of the workload (default: %(default)s)")
    parser.add_argument("--run-order", choices=("auto", "interleaved", "phased"), default="auto",
                        help="interleaved: in-process and stack runs alternate, both engines loaded; phased: "
                             "every in-process run, then the engine freed, then the stack's runs; auto: "
                             "interleaved where both engines fit in memory (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the in-process and stack pair this many times, alternating, and report the "
                             "median ratio (default: %(default)s)")
    return parser


def make_workload(args, vocab_size: int, pair: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.workload_seed + pair)

    def length(mean: int) -> int:
        return rng.randint(max(1, int(mean * (1 - args.range_ratio))), max(1, int(mean * (1 + args.range_ratio))))

    prompts = [[rng.randrange(vocab_size) for _ in range(length(args.input_len))] for _ in range(args.num_prompts)]
    return prompts, [length(args.output_len) for _ in prompts]


class Run(NamedTuple):
    """One run of the requests: output tokens, seconds, and the median TPOT over requests (as a
    streaming client sees it: from each request's first token to its last)."""
    tokens: int
    seconds: float
    tpot: float


def run_in_process(llm, prompts, output_lens) -> Run:
    """The requests on ``llm`` (an `LLM`, warmed up)."""
    from services.engine.sampling_params import SamplingParams

    core = llm.core
    first_at, last_at, num_tokens = {}, {}, {}
    started = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(prompts, output_lens)):
        core.add_request(f"run-{started}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    while core.has_unfinished_requests():
        outputs = core.step()
        now = time.perf_counter()
        for output in outputs:
            if output.new_token_ids:
                first_at.setdefault(output.request_id, now)
                last_at[output.request_id] = now
                num_tokens[output.request_id] = num_tokens.get(output.request_id, 0) + len(output.new_token_ids)
    seconds = time.perf_counter() - started
    tpots = [(last_at[r] - first_at[r]) / (n - 1) for r, n in num_tokens.items() if n > 1]
    return Run(sum(num_tokens.values()), seconds, statistics.median(tpots) if tpots else 0.0)


async def _stream_all(base_url: str, model: str, prompts, output_lens, concurrency: int,
                      stack) -> tuple[Run, dict[str, int], dict[str, float], float, float | None]:
    """The requests streamed through the gateway, their errors (how many requests failed with each), the
    CPU seconds that each of ``stack``'s processes and this one (the clients) spent while they streamed
    (not the warm-up's, nor the client session's setup, which a short run's per-token figure would
    carry), and the share of the cores' time that was idle meanwhile."""
    from services.bench.client import RequestSettings, open_session
    from services.bench.datasets import BenchRequest
    from services.bench.runner import RunPlan, error_counts, send_all, settle_all

    settings = RequestSettings(url=base_url + "/v1/completions", model=model, chat=False, ignore_eos=True,
                               temperature=0.0)
    requests = [BenchRequest(prompt_len=len(p), output_len=n, prompt=p) for p, n in zip(prompts, output_lens)]
    async with open_session(600) as session:
        warm_up = [BenchRequest(prompt_len=8, output_len=2, prompt=[1] * 8)] * 2  # not a measured prompt: no
        await send_all(session, settings, warm_up, RunPlan(max_concurrency=2))   # cache hit for the stack alone
        before, started_cpu, cores_before = cpu_seconds(stack), time.process_time(), core_times()
        outputs, seconds = await send_all(session, settings, requests, RunPlan(max_concurrency=concurrency),
                                          settle=False)
        after, client_cpu_s = cpu_seconds(stack), time.process_time() - started_cpu
        idle = idle_share(cores_before, core_times())
    settle_all(outputs)  # (after the run: reading the events is no CPU taken from the stack)
    done = [o for o in outputs if o.success]
    tpots = [o.tpot for o in done if o.output_tokens > 1]
    return (Run(sum(o.output_tokens for o in done), seconds, statistics.median(tpots) if tpots else 0.0),
            error_counts(outputs), {name: after[name] - before[name] for name in before.keys() & after.keys()},
            client_cpu_s, idle)


@contextmanager
def clients_on(cores: set[int] | None):
    """The calling thread (the clients' event loop) runs on ``cores`` meanwhile (None: where it was).
    The clients stand in for remote ones, whose CPU the stack does not pay; here they share its cores,
    and they take those `strata up` gives the services beside its engine (`Stack.front_cores`): on
    the engine's first core they would hold up the serial part of its steps. (Through `strata up` on
    2 cores, small, bfloat16, the gateway on the second core: 64 streams, 0.92x, 0.91x, 0.93x, 0.94x the
    in-process tok/s with the clients there too, against 0.92x, 0.94x, 0.91x, 0.91x, 0.91x; one
    stream, TPOT 1.12x, 1.08x, 1.11x against 1.14x, 1.12x, 1.12x.)"""
    if not cores:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextmanager
def running_stack(config, engine_argv: list[str]):
    """`strata up` on ``config``'s model with ``engine_argv``, on loopback; yields the `Stack`."""
    from services.launcher import Stack, StackConfig, find_free_port

    with tempfile.TemporaryDirectory() as logs:
        stack_config = StackConfig(model=config.model, port=find_free_port(), served_model_name="bench",
                                   engine_args=engine_argv, gateway_args=["--log-level", "warning"],
                                   log_dir=Path(logs), echo_logs=False)
        with Stack(stack_config) as stack:
            yield stack


def cpu_seconds(stack) -> dict[str, float]:
    """User + system CPU seconds so far of each of the stack's processes, all threads; {} off Linux."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    seconds = {}
    for service in stack.services:
        try:
            fields = Path(f"/proc/{service.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        seconds[service.name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return seconds


def core_times() -> tuple[int, int] | None:
    """(idle, all) time of every core so far, in clock ticks, from /proc/stat; None off Linux."""
    try:
        ticks = [int(field) for field in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return ticks[3] + ticks[4], sum(ticks)  # idle + iowait, of user .. steal


def idle_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the cores' time between two `core_times` that was idle; None where unknown."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def resident_bytes() -> int | None:
    """This process's resident memory; None off Linux."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def available_bytes() -> int | None:
    """The memory Linux says new work can still get (MemAvailable); None where it does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def both_engines_fit(engine_bytes: int | None, available: int | None) -> bool:
    """Whether a second engine of ``engine_bytes`` fits in what is still available, with a tenth to
    spare; True when either is unknown."""
    if engine_bytes is None or available is None:
        return True
    return engine_bytes * 1.1 <= available


def _engine_and_available_bytes(llm, device: str, resident_before: int | None) -> tuple[int | None, int | None]:
    """What the loaded in-process engine holds on its device, and what that device has free."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.memory_allocated(device), torch.cuda.mem_get_info(device)[0]
    if resident_before is None:
        return None, None
    # What loading touched (the weights), plus the whole KV pool: most of it has no page yet (zeroed
    # pages stay unmapped until a request writes them), which the runs will change.
    kv_pool_bytes = sum(k.nbytes + v.nbytes for k, v in llm.core.model_runner.kv_caches)
    return resident_bytes() - resident_before + kv_pool_bytes, available_bytes()


def _engine_argv(config) -> list[str]:
    argv = ["--dtype", config.dtype, "--device", config.device, "--block-size", str(config.block_size),
            "--max-num-seqs", str(config.max_num_seqs),
            "--max-num-batched-tokens", str(config.max_num_batched_tokens)]
    if config.num_kv_blocks is not None:
        argv += ["--num-kv-blocks", str(config.num_kv_blocks)]
    if not config.enable_prefix_caching:
        argv.append("--no-enable-prefix-caching")
    if config.num_threads is not None:
        argv += ["--num-threads", str(config.num_threads)]
    if config.enforce_eager:
        argv.append("--enforce-eager")
    if not config.bind_threads:
        argv.append("--no-bind-threads")
    if config.stream_interval != 1:
        argv += ["--stream-interval", str(config.stream_interval)]
    return argv


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.max_num_seqs = args.max_concurrency
    with tempfile.TemporaryDirectory() as tmp:
        if args.shape:
            args.model = str(write_random_llama(Path(tmp) / args.shape, args.shape, servable=True))
        return _run(args)


@dataclass(frozen=True)
class Pair:
    """One in-process run and one stack run of the same requests, and the CPU seconds each stack
    process spent in the stack run."""
    engine: Run
    stack: Run
    errors: dict[str, int]  # of the stack run's failed requests: how many failed with each
    stack_cpu_s: dict[str, float]
    engine_cpu_s: float  # this process's CPU seconds in the in-process run
    client_cpu_s: float  # this process's CPU seconds in the stack run: the clients
    engine_idle: float | None  # the share of the cores' time idle in the in-process run (`idle_share`)
    stack_idle: float | None  # ... and in the stack run

    @property
    def throughput_ratio(self) -> float:
        return (self.stack.tokens / self.stack.seconds) / (self.engine.tokens / self.engine.seconds)

    @property
    def tpot_ratio(self) -> float:
        return self.stack.tpot / self.engine.tpot if self.engine.tpot else float("nan")


def _run(args) -> int:
    from services.engine.cpu_allocator import release_freed_memory
    from services.engine.engine_args import config_from_args
    from services.engine.llm import LLM
    from services.engine.models.config import load_model_config
    from services.engine.sampling_params import SamplingParams

    if args.repeats < 1:
        raise SystemExit(f"strata bench overhead: --repeats {args.repeats} must be at least 1")
    config = config_from_args(args)
    vocab_size = load_model_config(config.model).vocab_size
    workloads = [make_workload(args, vocab_size, pair) for pair in range(args.repeats)]
    print(f"{args.num_prompts} requests, {sum(workloads[0][1])} output tokens, concurrency {args.max_concurrency}"
          + (f", {args.repeats} pairs, new requests each" if args.repeats > 1 else ""), file=sys.stderr)
    resident_before = resident_bytes()
    llm = LLM(config)
    llm.generate([[1] * 8], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    engine_bytes, available = _engine_and_available_bytes(llm, config.device, resident_before)
    phased = args.run_order == "phased" or (args.run_order == "auto" and not both_engines_fit(engine_bytes, available))
    if phased:
        reason = ("--run-order phased" if args.run_order == "phased" else
                  f"the stack's engine would not fit beside this one ({engine_bytes / 2**30:.1f} GiB with its KV "
                  f"pool, {available / 2**30:.1f} GiB available)")
        print(f"{reason}: every in-process run first, then the stack's", file=sys.stderr)

    def in_process(prompts, output_lens) -> tuple[Run, float, float | None]:
        started_cpu, cores_before = time.process_time(), core_times()
        run = run_in_process(llm, prompts, output_lens)
        return run, time.process_time() - started_cpu, idle_share(cores_before, core_times())

    def streamed(running, front_cores, prompts, output_lens
                 ) -> tuple[Run, dict[str, int], dict[str, float], float, float | None]:
        gc.collect()
        with clients_on(front_cores):
            return uvloop.run(_stream_all(running.base_url, "bench", prompts, output_lens, args.max_concurrency,
                                          running))

    engine_runs = [in_process(prompts, output_lens) for prompts, output_lens in workloads] if phased else None
    if phased:
        del llm  # its weights and KV pool go back to the system before the stack's engine loads
        gc.collect()
        release_freed_memory()
    pairs = []
    with running_stack(config, _engine_argv(config)) as running:
        front_cores = running.front_cores  # (the engine's flags parsed once)
        for k, (prompts, output_lens) in enumerate(workloads):
            engine, engine_cpu_s, engine_idle = engine_runs[k] if phased else in_process(prompts, output_lens)
            stack, errors, stack_cpu_s, client_cpu_s, stack_idle = streamed(running, front_cores, prompts, output_lens)
            pairs.append(Pair(engine, stack, errors, stack_cpu_s, engine_cpu_s, client_cpu_s, engine_idle, stack_idle))
    print("============ Serving overhead: output tokens/s ============")
    print(f"{'run':<26}{'tokens':>8}{'seconds':>9}{'tok/s':>9}{'TPOT ms':>9}")
    for k, pair in enumerate(pairs):
        suffix = f" #{k + 1}" if len(pairs) > 1 else ""
        for name, (tokens, seconds, tpot) in ((f"engine in-process{suffix}", pair.engine),
                                              (f"gateway, streamed{suffix}", pair.stack)):
            print(f"{name:<26}{tokens:>8}{seconds:>9.2f}{tokens / seconds:>9.1f}{tpot * 1e3:>9.2f}")
    throughput = statistics.median(p.throughput_ratio for p in pairs)
    tpot = statistics.median(p.tpot_ratio for p in pairs)
    added_ms = statistics.median((p.stack.tpot - p.engine.tpot) * 1e3 for p in pairs)
    failed = sum(sum(p.errors.values()) for p in pairs)
    label = f"median of {len(pairs)} pairs" if len(pairs) > 1 else "gateway / engine"
    print(f"{label}: {throughput:.2f}x tok/s, {tpot:.2f}x TPOT (+{added_ms:.2f} ms per token)"
          + (f"  ({failed} requests failed)" if failed else ""))
    for k, pair in enumerate(pairs):
        for error, count in pair.errors.items():
            print(f"  failed in stack run #{k + 1}: {count} x {error}")
    def median_ms(cpu: str, run: str) -> float:
        return statistics.median(getattr(p, cpu) / max(getattr(p, run).tokens, 1) * 1e3 for p in pairs)

    names = [name for name in pairs[0].stack_cpu_s if name != "nats" and all(name in p.stack_cpu_s for p in pairs)]
    if names:
        per_token = {name: statistics.median(p.stack_cpu_s[name] / max(p.stack.tokens, 1) * 1e3 for p in pairs)
                     for name in names}
        clients_ms, engine_ms = median_ms('client_cpu_s', 'stack'), median_ms('engine_cpu_s', 'engine')
        print("stack CPU per output token: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in per_token.items())
              + f" (sum {sum(per_token.values()):.3f} ms); clients {clients_ms:.3f} ms; "
              f"in-process engine {engine_ms:.3f} ms")
        beside_ms = sum(ms for name, ms in per_token.items() if name != "engine") + clients_ms
        if engine_fills_the_cores(config):
            rate = shared_cores_rate(engine_ms, beside_ms)
            print(f"cores shared: the other processes and the clients took {beside_ms:.3f} ms of CPU per token beside "
                  f"the engine's {engine_ms:.3f} ms, on cores its threads fill: were all of the engine's CPU work, "
                  f"the stack would keep {rate:.2f}x of the in-process tok/s ({1 / rate:.2f}x its TPOT)")
    if front_cores:
        print(f"placement: the stack's tokenizer and gateway, and the clients, on cores "
              f"{','.join(map(str, sorted(front_cores)))} (all but the engine's first)")
    if all(p.engine_idle is not None and p.stack_idle is not None for p in pairs):
        print(f"cores idle: {statistics.median(p.engine_idle for p in pairs):.1%} of the cores' time in the "
              f"in-process runs, {statistics.median(p.stack_idle for p in pairs):.1%} in the stack's (whole machine)")
    return 1 if failed else 0


def engine_fills_the_cores(config) -> bool:
    """Whether the engine's kernel threads (may) run on every core this process may use, so that the
    stack's other processes take their CPU from the engine's."""
    from services.engine.threads import resolve_num_threads, usable_cores

    return config.device == "cpu" and resolve_num_threads(config.num_threads, os.environ) >= usable_cores()


def shared_cores_rate(engine_ms: float, beside_ms: float) -> float:
    """What an engine whose threads fill the cores keeps of its in-process rate when other processes need
    ``beside_ms`` of CPU per token on the same cores, where it alone spends ``engine_ms``, if every
    millisecond they run is one the engine does not. Its idle threads' spinning is CPU it spends without
    working, which the others take at no cost (the stack can do better); a thread taken away in the
    middle of a phase holds the others up (worse)."""
    return engine_ms / (engine_ms + beside_ms) if engine_ms > 0 else float("nan")
