"""Turns per-request measurements into the summary metrics of a serving benchmark.

The definitions are `vllm bench serve`'s, so numbers can be read side by side:
- TTFT: send to the first chunk that carries a generated token.
- TPOT: (E2E latency - TTFT) / (output tokens - 1), over requests with more than one output token.
- ITL: every gap between tokens after the first, pooled over all requests (a chunk carrying k
  tokens after a gap g contributes k gaps of g/k; see `sse.py`).
- Goodput: completed requests per second that met every SLO given (`ttft`, `tpot`, `e2el`, in ms);
  a one-token request has TPOT 0 there, as in vLLM.
- Percentiles: numpy's linear interpolation; std is the population std (numpy's default).
Empty sample sets summarise to 0.0, so a result stays valid JSON when everything failed.
"""

from dataclasses import dataclass, field
from typing import Any

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestOutput:
    """What the client saw of one request. Times are seconds; lists are in arrival order."""

    success: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # of prompt_tokens, found in the server's prefix cache (when it says)
    output_tokens: int = 0
    cancelled: bool = False
    sent_s: float | None = None  # when the runner issued it, in seconds after the run's start; None: never
    done_s: float | None = None  # when it finished, failed or was cancelled, on the same clock
    unread: Any = None  # a streamed request's events until `client.settle` reads them (when the run is over)

    @property
    def first_token_s(self) -> float:
        """When the first token arrived, on the runner's clock (a completed request only)."""
        return self.done_s - self.latency + self.ttft

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first; 0.0 for a single-token output."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def summarize(values: list[float] | np.ndarray, percentiles: list[float], scale: float = 1.0) -> dict[str, float]:
    """mean, median, std and each percentile of `values` times `scale`; zeros when empty."""
    data = np.asarray(values, dtype=np.float64) * scale
    if data.size == 0:
        data = np.zeros(1)
    out = {"mean": float(np.mean(data)), "median": float(np.median(data)), "std": float(np.std(data))}
    for p in percentiles:
        out[f"p{format_percentile(p)}"] = float(np.percentile(data, p))
    return out


def format_percentile(p: float) -> str:
    """99 -> "99", 99.9 -> "99.9" (the key vLLM writes: `p99_ttft_ms`, `p99.9_ttft_ms`)."""
    return str(int(p)) if float(p).is_integer() else str(p)


def count_good(outputs: list[RequestOutput], slos_ms: dict[str, float]) -> int:
    """Completed requests that meet every SLO in `slos_ms` (keys from GOODPUT_METRICS)."""
    unknown = set(slos_ms) - set(GOODPUT_METRICS)
    if unknown:
        raise ValueError(f"unknown goodput metric(s) {sorted(unknown)}; use {', '.join(GOODPUT_METRICS)}")
    good = 0
    for out in outputs:
        if not out.success:
            continue
        measured = {"ttft": out.ttft, "tpot": out.tpot, "e2el": out.latency}
        if all(measured[name] * 1000.0 <= slo for name, slo in slos_ms.items()):
            good += 1
    return good


def compute_metrics(outputs: list[RequestOutput], duration_s: float, percentiles: list[float],
                    goodput_slos_ms: dict[str, float] | None = None) -> dict[str, float]:
    """The flat metric dict of one run, named as in vLLM's result JSON."""
    done = [o for o in outputs if o.success]
    total_input = sum(o.prompt_tokens for o in done)
    total_output = sum(o.output_tokens for o in done)
    duration_s = max(duration_s, 1e-9)
    metrics: dict[str, float] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": sum(1 for o in outputs if not o.success and not o.cancelled),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    cached = [o.cached_tokens for o in done if o.cached_tokens is not None]
    if cached:  # a run whose prompts an earlier one left in the prefix cache is not a cold one
        metrics["total_cached_input_tokens"] = sum(cached)
    cancelled = sum(1 for o in outputs if o.cancelled)
    if cancelled:
        metrics["cancelled"] = cancelled
    if goodput_slos_ms:
        metrics["request_goodput"] = count_good(outputs, goodput_slos_ms) / duration_s
    samples = {
        "ttft": [o.ttft for o in done],
        "tpot": [o.tpot for o in done if o.output_tokens > 1],
        "itl": [gap for o in done for gap in o.itl],
        "e2el": [o.latency for o in done],
    }
    for name in LATENCY_METRICS:
        for stat, value in summarize(samples[name], percentiles, scale=1000.0).items():
            metrics[f"{stat}_{name}_ms"] = value
    return metrics


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:200", "tpot:50"] -> {"ttft": 200.0, "tpot": 50.0} (milliseconds, as vLLM)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {item!r}: expected NAME:MS with NAME one of {', '.join(GOODPUT_METRICS)}")
        slo = float(value)
        if slo < 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be >= 0 ms")
        slos[name] = slo
    return slos
