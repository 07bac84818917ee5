"""Sends a workload on an arrival schedule and measures it: one sweep point of `bench serve`.

Arrivals follow vLLM: gaps are Gamma(shape=burstiness, scale=1/(rate*burstiness)) — burstiness 1
is a Poisson process, lower is burstier, higher is steadier; an infinite rate sends everything at
once. With a `schedule` the rate changes over the run (`schedule.py`) and the schedule decides how
many requests there are. `max_concurrency` caps the requests in flight (a closed loop when the rate
is infinite).
Every run ends by itself: after the last request (and not before its schedule's end), or at
`max_duration`, when requests still in flight are cancelled and those not yet sent are dropped (both
counted as `cancelled`).
With `timeline` settings, `/metrics` is scraped through the run as well (`timeline.py`).
"""

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import numpy as np

from services.bench import server_metrics
from services.bench.client import RequestSettings, send_request, short_reason
from services.bench.client import settle as settle_request
from services.bench.datasets import BenchRequest
from services.bench.results import RunResult
from services.bench.schedule import RateSchedule
from services.bench.stats import RequestOutput, compute_metrics
from services.bench.timeline import ServerSampler, TimelineSettings, build_timeline, segment_summaries

# A server may count a request just after sending its last byte (in a generator's `finally`):
# wait this long after the last response before scraping, so that count lands on the right side.
METRICS_SETTLE_S = 0.2


@dataclass(frozen=True)
class RunPlan:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    max_duration: float | None = None
    seed: int = 0
    schedule: RateSchedule | None = None  # replaces request_rate when set

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate {self.request_rate} must be > 0 (inf sends all at once)")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness {self.burstiness} must be > 0 (1.0 is Poisson)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency {self.max_concurrency} must be at least 1")
        if self.max_duration is not None and not self.max_duration > 0:
            raise ValueError(f"--max-duration {self.max_duration} must be > 0 seconds")

    @property
    def label(self) -> str:
        parts = []
        if self.schedule is not None:
            parts.append(f"schedule={self.schedule}")
        elif math.isfinite(self.request_rate):
            parts.append(f"request_rate={self.request_rate:g}")
        if self.max_concurrency is not None:
            parts.append(f"max_concurrency={self.max_concurrency}")
        return ",".join(parts) or "request_rate=inf"

    def offsets(self, num_requests: int | None = None) -> np.ndarray:
        """Send times (s after the start), the same for the same seed: `num_requests` of them at
        `request_rate`, or the schedule's arrivals (the first `num_requests` when given)."""
        rng = np.random.default_rng(self.seed)
        if self.schedule is None:
            return arrival_offsets(num_requests or 0, self.request_rate, self.burstiness, rng)
        return self.schedule.arrival_offsets(self.burstiness, rng)[:num_requests]

    def rate_at(self, t_s: float) -> float | None:
        """The target rate `t_s` seconds into the run; None for an infinite rate."""
        if self.schedule is not None:
            return self.schedule.rate_at(t_s)
        return self.request_rate if math.isfinite(self.request_rate) else None


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float,
                    rng: np.random.Generator) -> np.ndarray:
    """Send time of each request in seconds after the start; the first goes at 0."""
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    return np.concatenate(([0.0], np.cumsum(gaps[:-1]))) if num_requests else np.zeros(0)


# The streams' events kept unread (`client.send_request`) before the run reads them while it goes on.
MAX_UNREAD_BYTES = 256 << 20


async def send_all(session: aiohttp.ClientSession, settings: RequestSettings, requests: list[BenchRequest],
                   plan: RunPlan, on_done: Callable[[], None] | None = None,
                   start: float | None = None, settle: bool = True) -> tuple[list[RequestOutput], float]:
    """Send `requests` as `plan` says; returns one output per request and the run's duration (s).

    The run starts at `start` (a `time.perf_counter()` value; default: now); every output's `sent_s`
    and `done_s` are seconds after it. A request waiting for a --max-concurrency slot counts as sent.
    The streams' events are read after the run (`settle_all`; ``settle=False``: by the caller), or
    while it goes on whenever those kept unread pass `MAX_UNREAD_BYTES`.
    """
    offsets = plan.offsets(len(requests))
    outputs = [RequestOutput(cancelled=True, error="stopped by --max-duration") for _ in requests]
    semaphore = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
    unread_bytes = 0

    async def one(index: int, request: BenchRequest) -> None:
        nonlocal unread_bytes
        placeholder = outputs[index]  # stays, cancelled, if the run stops first
        try:
            if semaphore is None:
                output = await send_request(session, settings, request)
            else:
                async with semaphore:
                    output = await send_request(session, settings, request)
        except Exception as exc:  # a malformed response must fail this request, not the run
            output = RequestOutput(error=short_reason(f"client error: {type(exc).__name__}: {exc}"))
        finally:
            placeholder.done_s = time.perf_counter() - start
        output.sent_s, output.done_s = placeholder.sent_s, placeholder.done_s
        outputs[index] = output
        if output.unread is not None:
            unread_bytes += output.unread.events.size
            if unread_bytes > MAX_UNREAD_BYTES:
                settle_all(outputs)
                unread_bytes = 0
        if on_done is not None:
            on_done()

    start = time.perf_counter() if start is None else start
    deadline = start + plan.max_duration if plan.max_duration else math.inf
    tasks = []
    for index, (request, offset) in enumerate(zip(requests, offsets)):
        send_at = start + float(offset)
        if send_at >= deadline:
            break
        delay = send_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        outputs[index].sent_s = time.perf_counter() - start
        tasks.append(asyncio.create_task(one(index, request)))
    if plan.schedule is not None:  # a schedule runs to its end, even when it ends quiet (a scale-down)
        end = min(start + plan.schedule.total_duration_s, deadline)
        while (remaining := end - time.perf_counter()) > 0:  # uvloop's timers may fire up to a millisecond early
            await asyncio.sleep(remaining)
    if tasks:
        timeout = deadline - time.perf_counter() if math.isfinite(deadline) else None
        _, pending = await asyncio.wait(tasks, timeout=None if timeout is None else max(timeout, 0.0))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    duration = time.perf_counter() - start
    if settle:
        settle_all(outputs)
    return outputs, duration


def settle_all(outputs: list[RequestOutput]) -> None:
    """Reads the events of every output that streamed (`client.settle`)."""
    for output in outputs:
        try:
            settle_request(output)
        except Exception as exc:  # a malformed response must fail this request, not the run
            output.success = False
            output.error = short_reason(f"client error: {type(exc).__name__}: {exc}")


def request_samples(outputs: list[RequestOutput]) -> list[dict]:
    """Per-request samples in ms, as stored with `--save-detailed` and used by the plots."""
    return [{"success": o.success, "error": o.error, "prompt_tokens": o.prompt_tokens,
             "cached_tokens": o.cached_tokens, "output_tokens": o.output_tokens, "ttft_ms": o.ttft * 1000.0,
             "e2el_ms": o.latency * 1000.0,
             "itl_ms": [gap * 1000.0 for gap in o.itl]} for o in outputs]


def error_counts(outputs: list[RequestOutput]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in outputs:
        if not o.success and not o.cancelled:
            counts[o.error] = counts.get(o.error, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


async def run_point(session: aiohttp.ClientSession, settings: RequestSettings, requests: list[BenchRequest],
                    warmups: list[BenchRequest], plan: RunPlan, metrics_url: str | None,
                    percentiles: list[float], goodput_slos_ms: dict[str, float],
                    on_done: Callable[[], None] | None = None, timeline: TimelineSettings | None = None) -> RunResult:
    """Warm up (not counted), scrape `/metrics`, run (scraping `timeline`'s URLs throughout, when
    given), scrape again, summarise."""
    if warmups:
        await send_all(session, settings, warmups, RunPlan(max_concurrency=plan.max_concurrency, seed=plan.seed))
        await asyncio.sleep(METRICS_SETTLE_S)  # so the warmups' counts land before the first scrape
    before = await server_metrics.scrape(session, metrics_url) if metrics_url else None
    sampler = ServerSampler(session, timeline) if timeline else None
    start = time.perf_counter()
    sampling = asyncio.create_task(sampler.run(start)) if sampler else None
    outputs, duration = await send_all(session, settings, requests, plan, on_done, start)
    if sampling is not None:
        sampling.cancel()
        await asyncio.gather(sampling, return_exceptions=True)
        await sampler.sample(start)  # the fleet as the run ends
    rows = build_timeline(sampler.samples, outputs, plan.rate_at) if sampler else None
    if before is not None:
        await asyncio.sleep(METRICS_SETTLE_S)
    after = await server_metrics.scrape(session, metrics_url) if before is not None else None
    if plan.schedule is None:
        params = {"request_rate": plan.request_rate if math.isfinite(plan.request_rate) else "inf"}
    else:
        params = {"request_rate_schedule": str(plan.schedule)}
    params.update(burstiness=plan.burstiness, max_concurrency=plan.max_concurrency, num_prompts=len(requests))
    return RunResult(label=plan.label, params=params,
                     metrics=compute_metrics(outputs, duration, percentiles, goodput_slos_ms),
                     server_metrics=server_metrics.diff(before, after), errors=error_counts(outputs),
                     samples=request_samples(outputs), timeline=rows,
                     segments=segment_summaries(plan.schedule, outputs, rows or []) if plan.schedule else None)
