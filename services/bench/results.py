"""The benchmark result format, shared by `strata bench serve`, `strata bench offline` and
`strata bench compare`.

A result file is one JSON object:

    {
      "schema": "strata.bench/1",
      "kind": "serve" | "offline",
      "created": "2025-01-31T12:00:00+00:00",
      "config": {...},                  # the invocation: flags, model, dataset (free-form)
      "runs": [                         # one per sweep point (serve) or per engine (offline)
        {
          "label": "max_concurrency=16",  # what distinguishes this run; compare pairs runs by it
          "params": {...},                # the swept parameters of this run
          "metrics": {"request_throughput": 12.3, "mean_ttft_ms": 41.0, ...},
          "server_metrics": {"counters": {"strata:prompt_tokens_total": 812.0, ...},
                             "gauges": {...}},   # empty when the target has no /metrics
          "errors": {"HTTP 400: ...": 3},         # failure reason -> count
          "samples": [...] | null,        # per-request samples, only when asked for
          "timeline": [...] | null,       # serve, with a schedule or --timeline-metrics-url: one row
                                          # per scrape of the fleet (`timeline.py` has the row's keys)
          "segments": [...] | null        # serve with a schedule: each segment's rate, duration and
                                          # outcome (`timeline.segment_summaries`)
        }
      ]
    }

Metric names follow `vllm bench serve`'s JSON (`request_throughput`, `output_throughput`,
`total_token_throughput`, `mean_ttft_ms`, `p99_itl_ms`, ...): a float per name, times in ms,
throughputs per second. A writer may add names of its own; `compare` reads any name that both
files carry, so `offline` and `serve` results compare on what they share.
"""

import datetime
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "strata.bench/1"
KINDS = ("serve", "offline")


@dataclass
class RunResult:
    """One measured run: a sweep point of `serve`, or one engine of `offline`."""

    label: str
    params: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    server_metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    samples: list[dict[str, Any]] | None = None
    timeline: list[dict[str, Any]] | None = None
    segments: list[dict[str, Any]] | None = None


@dataclass
class BenchResult:
    kind: str
    config: dict[str, Any]
    runs: list[RunResult]
    created: str = field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    schema: str = SCHEMA

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"result kind {self.kind!r} is not one of {KINDS}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BenchResult":
        schema = data.get("schema")
        if schema != SCHEMA:
            raise ValueError(f"not a Strata benchmark result: schema is {schema!r}, expected {SCHEMA!r}")
        runs = [RunResult(**run) for run in data["runs"]]
        return cls(kind=data["kind"], config=data.get("config", {}), runs=runs,
                   created=data.get("created", ""), schema=schema)


def save_result(result: BenchResult, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_dict(), indent=2, allow_nan=False, default=str) + "\n")
    return path


def load_result(path: str | Path) -> BenchResult:
    with open(path) as f:
        return BenchResult.from_dict(json.load(f))


def is_higher_better(metric: str) -> bool | None:
    """Which direction is an improvement for a metric name; None when neither is."""
    if "throughput" in metric or "goodput" in metric:
        return True
    if metric.endswith("_ms") or metric == "failed":
        return False
    return None  # counts and durations depend on the workload as much as on the server
