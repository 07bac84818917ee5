"""The fleet's response over a run: `/metrics` scraped every interval, beside the client's own view.

While the requests go out, `ServerSampler` scrapes each metrics URL every `interval_s` seconds (a
URL that does not answer is skipped for that sample). After the run, `build_timeline` puts each
sample beside what the client saw at the same instant, computed exactly from every request's
times. One row of the timeline (None where unknown):

    {"elapsed_s": 12.0,              # seconds after the run's start, when the scrape began
     "target_rate": 20.0,            # the schedule's rate then (requests/s; None for an infinite rate)
     "current_replicas": 3, "desired_replicas": 4, "ready_replicas": 2,   # the autoscaler's gauges
     "num_requests_waiting": 17,     # the autoscaler's count, else the sum of the engines' gauges
     "num_sent": 230, "num_in_flight": 21,          # issued so far; issued and not finished
     "num_completed": 205, "num_failed": 4,         # finished so far (cancelled ones are neither)
     "ttft_p50_ms": 180.2, "ttft_max_ms": 412.0}    # of first tokens that arrived since the last row

Gauges are summed over every series of that name on every URL (one autoscaler, or several pools).
"""

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import numpy as np

from services.bench import server_metrics
from services.bench.schedule import RateSchedule
from services.bench.stats import RequestOutput

REPLICA_GAUGES = {
    "current_replicas": "strata:autoscaler_current_replicas",
    "desired_replicas": "strata:autoscaler_desired_replicas",
    "ready_replicas": "strata:autoscaler_ready_replicas",
}
AUTOSCALER_WAITING = "strata:autoscaler_num_requests_waiting"
ENGINE_WAITING = "strata:num_requests_waiting"
MAX_SCRAPE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class TimelineSettings:
    metrics_urls: tuple[str, ...]
    interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.metrics_urls:
            raise ValueError("a timeline needs at least one metrics URL (--timeline-metrics-url)")
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ValueError(f"--timeline-interval {self.interval_s:g} must be > 0 seconds")


def _number(value: float | None) -> int | float | None:
    if value is None:
        return None
    return int(value) if float(value).is_integer() else round(float(value), 3)


def _gauge_sum(snapshots: list[server_metrics.Snapshot], name: str) -> float | None:
    values = [value for snapshot in snapshots for key, (kind, value) in snapshot.items()
              if kind == "gauge" and key.partition("{")[0] == name]
    return sum(values) if values else None


def server_columns(snapshots: list[server_metrics.Snapshot | None]) -> dict[str, int | float | None]:
    """The replica and waiting-request figures of one sample's scrapes (None where no URL had them)."""
    scraped = [snapshot for snapshot in snapshots if snapshot]
    columns = {column: _number(_gauge_sum(scraped, name)) for column, name in REPLICA_GAUGES.items()}
    waiting = _gauge_sum(scraped, AUTOSCALER_WAITING)
    columns["num_requests_waiting"] = _number(waiting if waiting is not None else _gauge_sum(scraped, ENGINE_WAITING))
    return columns


class ServerSampler:
    """Scrapes the metrics URLs at `start + k * interval_s` (k = 0, 1, ...) until its task is cancelled;
    a scrape that overruns skips the ticks it missed. `samples` holds (elapsed_s, server_columns)."""

    def __init__(self, session: aiohttp.ClientSession, settings: TimelineSettings) -> None:
        self._session, self._settings = session, settings
        self._timeout_s = min(MAX_SCRAPE_TIMEOUT_S, max(settings.interval_s, 0.25))
        self.samples: list[tuple[float, dict]] = []

    async def sample(self, start: float) -> None:
        elapsed = time.perf_counter() - start
        snapshots = await asyncio.gather(*(server_metrics.scrape(self._session, url, self._timeout_s)
                                           for url in self._settings.metrics_urls))
        self.samples.append((elapsed, server_columns(list(snapshots))))

    async def run(self, start: float) -> None:
        interval, tick = self._settings.interval_s, 0
        while True:
            await self.sample(start)
            tick = max(tick + 1, math.ceil((time.perf_counter() - start) / interval))
            await asyncio.sleep(max(0.0, start + tick * interval - time.perf_counter()))


def _sorted(times) -> np.ndarray:
    return np.sort(np.fromiter(times, dtype=np.float64))


def _count_until(sorted_times: np.ndarray, t: float) -> int:
    return int(np.searchsorted(sorted_times, t, side="right"))


def build_timeline(server_samples: list[tuple[float, dict]], outputs: list[RequestOutput],
                   rate_at: Callable[[float], float | None]) -> list[dict]:
    """One row per server sample, with the client's figures at the same instant (see the module doc)."""
    sent = _sorted(o.sent_s for o in outputs if o.sent_s is not None)
    done = _sorted(o.done_s for o in outputs if o.done_s is not None)
    completed = _sorted(o.done_s for o in outputs if o.success)
    failed = _sorted(o.done_s for o in outputs if o.done_s is not None and not o.success and not o.cancelled)
    successes = sorted((o for o in outputs if o.success), key=lambda o: o.first_token_s)
    first_tokens = np.array([o.first_token_s for o in successes], dtype=np.float64)
    ttfts_ms = np.array([o.ttft * 1000.0 for o in successes], dtype=np.float64)
    rows, previous = [], -math.inf
    for elapsed, columns in server_samples:
        num_sent, num_done = _count_until(sent, elapsed), _count_until(done, elapsed)
        window = ttfts_ms[_count_until(first_tokens, previous):_count_until(first_tokens, elapsed)]
        rows.append({"elapsed_s": round(elapsed, 3), "target_rate": rate_at(elapsed), **columns,
                     "num_sent": num_sent, "num_in_flight": num_sent - num_done,
                     "num_completed": _count_until(completed, elapsed),
                     "num_failed": _count_until(failed, elapsed),
                     "ttft_p50_ms": round(float(np.median(window)), 3) if window.size else None,
                     "ttft_max_ms": round(float(window.max()), 3) if window.size else None})
        previous = elapsed
    return rows


def segment_summaries(schedule: RateSchedule, outputs: list[RequestOutput], timeline: list[dict]) -> list[dict]:
    """Per schedule segment: the requests that arrived in it (by send time) and how they fared, and the
    fewest and most current replicas the timeline saw during it (None when not scraped)."""
    summaries = []
    for start, segment in zip(schedule.starts_s, schedule.segments):
        end = start + segment.duration_s
        mine = [o for o in outputs if o.sent_s is not None and start <= o.sent_s < end]
        done = [o for o in mine if o.success]
        tpots = [o.tpot for o in done if o.output_tokens > 1]
        replicas = [row["current_replicas"] for row in timeline
                    if start <= row["elapsed_s"] < end and row.get("current_replicas") is not None]
        summaries.append({
            "rate": segment.rate, "duration_s": segment.duration_s, "start_s": start, "end_s": end,
            "num_sent": len(mine), "num_completed": len(done),
            "num_failed": sum(1 for o in mine if not o.success and not o.cancelled),
            "median_ttft_ms": round(float(np.median([o.ttft for o in done])) * 1000.0, 3) if done else None,
            "median_tpot_ms": round(float(np.median(tpots)) * 1000.0, 3) if tpots else None,
            "min_replicas": min(replicas) if replicas else None,
            "max_replicas": max(replicas) if replicas else None,
        })
    return summaries
