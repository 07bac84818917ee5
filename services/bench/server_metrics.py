"""Server-side figures: the target's Prometheus `/metrics`, scraped before and after a run.

Names are treated generically: every counter that changed is reported as its delta (histograms
and summaries as the deltas of their `_count` and `_sum`), every gauge as its value after the run.
A target without `/metrics` (404, refused, not Prometheus text) is skipped quietly. Deltas include
any other traffic the server took during the run.
"""

import asyncio
import math
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT_S = 5.0

Snapshot = dict[str, tuple[str, float]]  # series key -> ("counter" | "gauge", value)


def metrics_url(base_url: str) -> str:
    """`/metrics` on the same scheme, host and port as the base URL."""
    parts = urlsplit(base_url)
    return urlunsplit((parts.scheme, parts.netloc, "/metrics", "", ""))


def series_key(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def parse_metrics(text: str) -> Snapshot:
    """Prometheus text format -> {series: (kind, value)} for counters and gauges."""
    snapshot: Snapshot = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created") or not math.isfinite(sample.value):
                continue
            if family.type == "counter":
                kind = "counter"
            elif family.type in ("histogram", "summary", "gaugehistogram"):
                if not sample.name.endswith(("_count", "_sum")):
                    continue
                kind = "counter"
            elif family.type == "unknown":  # untyped: `_total` is the counter convention
                kind = "counter" if sample.name.endswith("_total") else "gauge"
            elif family.type == "gauge":
                kind = "gauge"
            else:
                continue
            snapshot[series_key(sample.name, sample.labels)] = (kind, float(sample.value))
    return snapshot


async def scrape(session: aiohttp.ClientSession, url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> Snapshot | None:
    """One scrape, or None when the target has no usable `/metrics`."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                return None
            return parse_metrics(await response.text()) or None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


def diff(before: Snapshot | None, after: Snapshot | None) -> dict[str, dict[str, float]]:
    """{"counters": changed counter deltas, "gauges": gauge values after}; {} when not scraped."""
    if before is None or after is None:
        return {}
    counters, gauges = {}, {}
    for key, (kind, value) in sorted(after.items()):
        if kind == "gauge":
            gauges[key] = value
            continue
        delta = value - before.get(key, (kind, 0.0))[1]
        if delta != 0:
            counters[key] = delta
    return {"counters": counters, "gauges": gauges}
