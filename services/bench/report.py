"""Terminal tables: one run in `vllm bench serve`'s layout, and the side-by-side of `compare`."""

import math
import re

from services.bench.results import BenchResult, RunResult, is_higher_better
from services.bench.stats import format_percentile

WIDTH = 50
SECTIONS = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
LIBRARY_GAUGE_PREFIXES = ("process_", "python_")  # prometheus_client's own collectors
MAX_ERROR_LINES = 5


def _title(text: str, fill: str = "=") -> str:
    return f"{text:{fill}^{WIDTH}}"


def _row(label: str, value: object) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value!s:<10}"


def format_run(run: RunResult, percentile_metrics: list[str], percentiles: list[float]) -> str:
    m, params = run.metrics, run.params
    lines = [_title(" Serving Benchmark Result "), _row("Successful requests:", int(m["completed"])),
             _row("Failed requests:", int(m["failed"]))]
    if m.get("cancelled"):
        lines.append(_row("Cancelled at --max-duration:", int(m["cancelled"])))
    if params.get("max_concurrency"):
        lines.append(_row("Maximum request concurrency:", params["max_concurrency"]))
    if "request_rate" in params:
        lines.append(_row("Request rate configured (RPS):", params["request_rate"]))
    if "request_rate_schedule" in params:
        lines.append(_row("Request rate schedule (RPS:s):", params["request_rate_schedule"]))
    lines += [_row("Benchmark duration (s):", m["duration"]),
              _row("Total input tokens:", int(m["total_input_tokens"]))]
    if "total_cached_input_tokens" in m:
        lines.append(_row("Cached input tokens (prefix cache):", _share(m["total_cached_input_tokens"],
                                                                        m["total_input_tokens"])))
    lines += [_row("Total generated tokens:", int(m["total_output_tokens"])),
              _row("Request throughput (req/s):", m["request_throughput"])]
    if "request_goodput" in m:
        lines.append(_row("Request goodput (req/s):", m["request_goodput"]))
    lines += [_row("Output token throughput (tok/s):", m["output_throughput"]),
              _row("Total Token throughput (tok/s):", m["total_token_throughput"])]
    for name in percentile_metrics:
        header, short = SECTIONS[name]
        lines.append(_title(header, "-"))
        lines += [_row(f"Mean {short} (ms):", m[f"mean_{name}_ms"]),
                  _row(f"Median {short} (ms):", m[f"median_{name}_ms"]),
                  _row(f"Std {short} (ms):", m[f"std_{name}_ms"])]
        lines += [_row(f"P{format_percentile(p)} {short} (ms):", m[f"p{format_percentile(p)}_{name}_ms"])
                  for p in percentiles]
    if run.errors:
        lines.append(_title(" Errors ", "-"))
        for reason, count in list(run.errors.items())[:MAX_ERROR_LINES]:
            lines.append(f"{count:>6}  {reason}")
    lines += _server_lines(run.server_metrics)
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _share(part: float, whole: float) -> str:
    """``part`` and its percentage of ``whole``: "812 (43.1%)"."""
    return f"{int(part)} ({100.0 * part / whole:.1f}%)" if whole else str(int(part))


def _server_lines(server: dict[str, dict[str, float]]) -> list[str]:
    if not server:
        return []
    counters = server.get("counters", {})
    gauges = {k: v for k, v in server.get("gauges", {}).items() if not k.startswith(LIBRARY_GAUGE_PREFIXES)}
    shared = _shared_labels([*counters, *gauges])
    lines = [_title(" Server /metrics: counter deltas ", "-")]
    if shared:
        lines.append(f"(all series: {', '.join(sorted(shared))})")
    lines += [_row(_drop_labels(key, shared), _number(value)) for key, value in counters.items()]
    if gauges:
        lines.append(_title(" Server /metrics: gauges after ", "-"))
        lines += [_row(_drop_labels(key, shared), _number(value)) for key, value in gauges.items()]
    return lines


_LABEL = re.compile(r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*"')


def _shared_labels(keys: list[str]) -> set[str]:
    """Label pairs every series carries (e.g. one model_name): printed once, not on each line."""
    label_sets = [set(_LABEL.findall(key.partition("{")[2])) for key in keys]
    return set.intersection(*label_sets) if label_sets else set()


def _drop_labels(key: str, labels: set[str]) -> str:
    name, _, inner = key.partition("{")
    kept = [pair for pair in _LABEL.findall(inner) if pair not in labels]
    return f"{name}{{{','.join(kept)}}}" if kept else name


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else float(value)


def pair_runs(a: BenchResult, b: BenchResult) -> list[tuple[RunResult, RunResult]]:
    """Runs with the same label; a single run on each side pairs regardless of label."""
    if len(a.runs) == 1 and len(b.runs) == 1:
        return [(a.runs[0], b.runs[0])]
    by_label = {run.label: run for run in b.runs}
    return [(run, by_label[run.label]) for run in a.runs if run.label in by_label]


def _fmt(value: float) -> str:
    return f"{value:.2f}" if not float(value).is_integer() else str(int(value))


def format_comparison(a: BenchResult, b: BenchResult, name_a: str = "A", name_b: str = "B") -> str:
    pairs = pair_runs(a, b)
    if not pairs:
        labels_a, labels_b = [r.label for r in a.runs], [r.label for r in b.runs]
        return f"no runs to compare: A has {labels_a}, B has {labels_b}"
    blocks = []
    for run_a, run_b in pairs:
        rows = [(key, run_a.metrics[key], run_b.metrics[key]) for key in run_a.metrics if key in run_b.metrics]
        counters_a = run_a.server_metrics.get("counters", {})
        counters_b = run_b.server_metrics.get("counters", {})
        both = [key for key in counters_a if key in counters_b]
        shared = _shared_labels(both)
        rows += [(f"server {_drop_labels(key, shared)}", counters_a[key], counters_b[key]) for key in both]
        title = f"{run_a.label}  vs  {run_b.label}"
        if shared:
            title += f"  (server series: {', '.join(sorted(shared))})"
        blocks.append(_comparison_table(title, rows, name_a, name_b))
    return "\n\n".join(blocks)


def _comparison_table(title: str, rows: list[tuple[str, float, float]], name_a: str, name_b: str) -> str:
    width = max([len("metric")] + [len(key) for key, _, _ in rows])
    header = f"{'metric':<{width}}  {name_a:>12}  {name_b:>12}  {'B/A':>8}  "
    lines = [title, header, "-" * (len(header) + 6)]
    for key, value_a, value_b in rows:
        ratio = value_b / value_a if value_a else (1.0 if value_b == value_a else math.inf)
        lines.append(f"{key:<{width}}  {_fmt(value_a):>12}  {_fmt(value_b):>12}  {ratio:>8.3f}  "
                     f"{_verdict(key, ratio)}")
    return "\n".join(lines)


def _verdict(metric: str, ratio: float) -> str:
    """'better'/'worse' for B against A where the metric has a direction and moved over 1%."""
    higher = is_higher_better(metric)
    if higher is None or not math.isfinite(ratio) or abs(ratio - 1.0) <= 0.01:
        return ""
    return "better" if (ratio > 1.0) == higher else "worse"


SEGMENT_COLUMNS = (("rate/s", "rate"), ("secs", "duration_s"), ("sent", "num_sent"), ("done", "num_completed"),
                   ("failed", "num_failed"), ("p50 TTFT", "median_ttft_ms"), ("p50 TPOT", "median_tpot_ms"),
                   ("min repl", "min_replicas"), ("max repl", "max_replicas"))


def format_segments(segments: list[dict]) -> str:
    """One line per schedule segment (latencies in ms; `-` where unknown, e.g. no replica gauge)."""
    lines = [_title(" Schedule segments (latencies in ms) ", "-"),
             f"{'#':>3}" + "".join(f"{name:>10}" for name, _ in SEGMENT_COLUMNS)]
    for i, segment in enumerate(segments, 1):
        cells = "".join(f"{'-' if segment[key] is None else _fmt(segment[key]):>10}" for _, key in SEGMENT_COLUMNS)
        lines.append(f"{i:>3}{cells}")
    return "\n".join(lines)


def format_sweep(runs: list[RunResult]) -> str:
    """One line per sweep point: the figures a throughput/latency trade-off is read from."""
    columns = [("req/s", "request_throughput"), ("out tok/s", "output_throughput"),
               ("med TTFT", "median_ttft_ms"), ("p99 TTFT", "p99_ttft_ms"),
               ("mean TPOT", "mean_tpot_ms"), ("med ITL", "median_itl_ms"), ("failed", "failed")]
    width = max(len(run.label) for run in runs)
    lines = [_title(" Sweep (latencies in ms) "),
             f"{'run':<{width}}" + "".join(f"{name:>11}" for name, _ in columns)]
    for run in runs:
        cells = "".join(f"{_fmt(run.metrics[key]) if key in run.metrics else '-':>11}" for _, key in columns)
        lines.append(f"{run.label:<{width}}{cells}")
    return "\n".join(lines)


SIDE_BY_SIDE = (("out tok/s", "output_throughput"), ("med TTFT ms", "median_ttft_ms"),
                ("mean TPOT ms", "mean_tpot_ms"), ("failed", "failed"))


def format_side_by_side(runs_a: list[RunResult], runs_b: list[RunResult], name_a: str, name_b: str) -> str:
    """Two servers on the same sweep points: each figure for both, and the ratio A/B (throughput above
    1 and latencies below 1 favour A)."""
    width = max([len("run")] + [len(run.label) for run in runs_a])
    figures = SIDE_BY_SIDE[:-1]
    lines = [_title(f" {name_a} vs {name_b}, same requests; ratio = {name_a} / {name_b} "),
             f"{'':<{width}}" + "".join(f"  {title:^34}" for title, _ in figures) + f"  {'failed':^13}",
             f"{'run':<{width}}" + f"  {name_a[:10]:>10}  {name_b[:10]:>10}  {'ratio':>10}" * len(figures)
             + f"  {name_a[:6]:>6} {name_b[:6]:>6}"]
    for run_a, run_b in zip(runs_a, runs_b, strict=True):
        cells = ""
        for _, key in figures:
            value_a, value_b = run_a.metrics[key], run_b.metrics[key]
            ratio = f"{value_a / value_b:.2f}x" if value_b else "-"
            cells += f"  {value_a:>10.2f}  {value_b:>10.2f}  {ratio:>10}"
        failed = f"  {int(run_a.metrics['failed']):>6} {int(run_b.metrics['failed']):>6}"
        lines.append(f"{run_a.label:<{width}}{cells}{failed}")
    return "\n".join(lines)
