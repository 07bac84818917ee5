"""PNG plots of a serving benchmark (matplotlib, Agg backend, so no display is needed):
throughput against latency across the sweep, and the TTFT and ITL distributions of each run."""

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
