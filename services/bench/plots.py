"""PNG plots of a serving benchmark (matplotlib, Agg backend, so no display is needed):
throughput against latency across the sweep, the TTFT and ITL distributions of each run, and the
fleet's timeline of a run that recorded one."""

from pathlib import Path

import numpy as np

from services.bench.results import RunResult


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(runs: list[RunResult], directory: Path, stem: str) -> list[Path]:
    """Writes `<stem>_throughput_latency.png`, `<stem>_ttft.png`, `<stem>_itl.png`; returns the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"{stem}_throughput_latency.png", directory / f"{stem}_ttft.png",
             directory / f"{stem}_itl.png"]
    plot_throughput_latency(runs, paths[0])
    plot_distribution(runs, "ttft_ms", "Time to first token", paths[1])
    plot_distribution(runs, "itl_ms", "Inter-token latency", paths[2])
    return paths


def plot_throughput_latency(runs: list[RunResult], path: Path) -> None:
    plt = _pyplot()
    fig, (ax_ttft, ax_itl) = plt.subplots(1, 2, figsize=(11, 4.2))
    throughput = [run.metrics["output_throughput"] for run in runs]
    for ax, series in ((ax_ttft, (("median_ttft_ms", "median TTFT"), ("p99_ttft_ms", "p99 TTFT"))),
                       (ax_itl, (("mean_tpot_ms", "mean TPOT"), ("median_itl_ms", "median ITL"),
                                 ("p99_itl_ms", "p99 ITL")))):
        plotted = [key for key, _ in series if all(key in run.metrics for run in runs)]
        for key, name in series:
            if key in plotted:
                ax.plot(throughput, [run.metrics[key] for run in runs], marker="o", label=name)
        for run, x in zip(runs, throughput):  # name each sweep point beside its lowest marker
            y = min((run.metrics[key] for key in plotted), default=0.0)
            ax.annotate(run.label.replace(",", "\n"), (x, y), fontsize=7, xytext=(0, -12),
                        textcoords="offset points", ha="center")
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel("latency (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_ttft.set_title("Throughput vs time to first token")
    ax_itl.set_title("Throughput vs per-token latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _values(run: RunResult, key: str) -> np.ndarray:
    values: list[float] = []
    for sample in run.samples or []:
        if not sample.get("success"):
            continue
        value = sample.get(key)
        values.extend(value if isinstance(value, list) else [value])
    return np.asarray(values, dtype=np.float64)


def plot_distribution(runs: list[RunResult], key: str, title: str, path: Path) -> None:
    """Histogram and empirical CDF of one per-request sample (`ttft_ms` or `itl_ms`) per run."""
    plt = _pyplot()
    fig, (ax_hist, ax_cdf) = plt.subplots(1, 2, figsize=(11, 4.2))
    per_run = [(run.label, np.sort(_values(run, key))) for run in runs]
    per_run = [(label, values) for label, values in per_run if values.size]
    everything = np.concatenate([values for _, values in per_run]) if per_run else np.zeros(0)
    bins = np.histogram_bin_edges(everything, bins=min(50, max(5, everything.size // 4))) if everything.size else 10
    for label, values in per_run:  # one set of bins, so the runs' histograms line up
        ax_hist.hist(values, bins=bins, alpha=0.5, label=label)
        ax_cdf.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=label)
    ax_hist.set_title(f"{title}: histogram")
    ax_hist.set_xlabel("ms")
    ax_hist.set_ylabel("count")
    ax_cdf.set_title(f"{title}: CDF")
    ax_cdf.set_xlabel("ms")
    ax_cdf.set_ylabel("fraction of samples")
    for ax in (ax_hist, ax_cdf):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_timeline_plots(runs: list[RunResult], directory: Path, stem: str) -> list[Path]:
    """`<stem>_timeline.png` for the one run with a timeline (`<stem>_timeline_<k>.png`, k = 1, 2, ...
    in run order, when several have one); nothing when none has."""
    with_timeline = [run for run in runs if run.timeline]
    if not with_timeline:
        return []
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, run in enumerate(with_timeline, 1):
        path = directory / (f"{stem}_timeline.png" if len(with_timeline) == 1 else f"{stem}_timeline_{k}.png")
        plot_timeline(run, path)
        paths.append(path)
    return paths


def _column(rows: list[dict], key: str) -> np.ndarray:
    return np.array([np.nan if row.get(key) is None else row[key] for row in rows], dtype=np.float64)


def plot_timeline(run: RunResult, path: Path) -> None:
    """Three panels over the run's time: replicas with the target rate, waiting and in-flight
    requests, and TTFT (median and max of the first tokens since the previous sample)."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    rows = run.timeline or []
    elapsed = _column(rows, "elapsed_s")
    fig, (ax_replicas, ax_queue, ax_ttft) = plt.subplots(3, 1, sharex=True, figsize=(11, 8.5))

    for key, name, style in (("current_replicas", "current", "-"), ("desired_replicas", "desired", "--"),
                             ("ready_replicas", "ready", ":")):
        values = _column(rows, key)
        if np.isfinite(values).any():
            ax_replicas.step(elapsed, values, style, where="post", linewidth=2, label=f"{name} replicas")
    if not ax_replicas.get_lines():
        ax_replicas.text(0.5, 0.5, "no autoscaler replica gauges scraped", transform=ax_replicas.transAxes,
                         ha="center", va="center", color="gray")
    else:  # headroom above the most replicas, so the lines stay clear of the frame
        ax_replicas.set_ylim(top=max(np.nanmax(line.get_ydata()) for line in ax_replicas.get_lines()) + 1)
    ax_replicas.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_replicas.set_ylabel("replicas")
    ax_rate = ax_replicas.twinx()
    if run.segments:  # the schedule itself, not its samples: the steps land where they happen
        times = [s["start_s"] for s in run.segments] + [run.segments[-1]["end_s"]]
        rates = [s["rate"] for s in run.segments] + [run.segments[-1]["rate"]]
        ax_rate.step(times, rates, where="post", color="gray", linestyle="-.", label="target rate")
    elif np.isfinite(_column(rows, "target_rate")).any():
        ax_rate.step(elapsed, _column(rows, "target_rate"), where="post", color="gray", linestyle="-.",
                     label="target rate")
    ax_rate.set_ylabel("target rate (req/s)")
    if ax_rate.get_lines():
        ax_rate.set_ylim(0, max(np.nanmax(line.get_ydata()) for line in ax_rate.get_lines()) * 1.3 or 1.0)
    handles = [h for ax in (ax_replicas, ax_rate) for h in ax.get_legend_handles_labels()[0]]
    if handles:
        ax_replicas.legend(handles=handles, fontsize=8, loc="upper left")
    ax_replicas.set_title(f"Fleet timeline: {run.label}")

    for key, name in (("num_requests_waiting", "waiting (server)"), ("num_in_flight", "in flight (client)")):
        values = _column(rows, key)
        if np.isfinite(values).any():
            ax_queue.step(elapsed, values, where="post", label=name)
    ax_queue.set_ylabel("requests")

    for key, name, style in (("ttft_p50_ms", "TTFT p50", "o-"), ("ttft_max_ms", "TTFT max", "^--")):
        ax_ttft.plot(elapsed, _column(rows, key), style, markersize=3, label=name)
    ax_ttft.set_ylabel("TTFT (ms)")
    ax_ttft.set_xlabel("seconds since the run's start")

    boundaries = [s["end_s"] for s in run.segments or []][:-1]
    for ax in (ax_replicas, ax_queue, ax_ttft):
        for x in boundaries:
            ax.axvline(x, color="black", alpha=0.25, linestyle=":")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax is not ax_replicas and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
