from services.bench.report import format_comparison, format_run, pair_runs
from services.bench.results import BenchResult, RunResult
from services.bench.stats import RequestOutput, compute_metrics


def serve_result(*runs: RunResult) -> BenchResult:
    return BenchResult(kind="serve", config={}, runs=list(runs))


def test_comparison_ratio_and_direction():
    a = serve_result(RunResult("x", metrics={"output_throughput": 100.0, "p99_ttft_ms": 50.0, "completed": 10}))
    b = serve_result(RunResult("y", metrics={"output_throughput": 150.0, "p99_ttft_ms": 60.0, "completed": 10}))
    rows = {line.split()[0]: line.split()[1:] for line in format_comparison(a, b).splitlines()[3:]}
    assert rows["output_throughput"] == ["100", "150", "1.500", "better"]
    assert rows["p99_ttft_ms"] == ["50", "60", "1.200", "worse"]
    assert rows["completed"] == ["10", "10", "1.000"]


def test_sweeps_pair_by_label():
    a = serve_result(RunResult("max_concurrency=1"), RunResult("max_concurrency=4"))
    b = serve_result(RunResult("max_concurrency=4"), RunResult("max_concurrency=16"))
    assert [(x.label, y.label) for x, y in pair_runs(a, b)] == [("max_concurrency=4", "max_concurrency=4")]
    c = serve_result(RunResult("request_rate=1"), RunResult("request_rate=2"))
    assert format_comparison(a, c).startswith("no runs to compare")


def test_run_table_prints_vllm_lines_and_compacts_shared_labels():
    metrics = compute_metrics([RequestOutput(success=True, ttft=0.01, latency=0.05, itl=[0.01] * 4,
                                             prompt_tokens=8, output_tokens=5)], 1.0, [99])
    server = {"counters": {'strata:generation_tokens_total{model_name="m"}': 5.0,
                           'strata:request_success_total{finished_reason="length",model_name="m"}': 1.0},
              "gauges": {'strata:num_requests_running{model_name="m"}': 0.0, "process_open_fds": 9.0}}
    run = RunResult("max_concurrency=2", params={"max_concurrency": 2, "request_rate": "inf"},
                    metrics=metrics, server_metrics=server, errors={"HTTP 503: busy": 2})
    text = format_run(run, ["ttft", "itl"], [99])
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert "Successful requests:                     1         " in lines
    assert "Maximum request concurrency:             2         " in lines
    assert "Mean TTFT (ms):                          10.00     " in lines
    assert "P99 ITL (ms):                            10.00     " in lines
    assert "TPOT" not in text and "     2  HTTP 503: busy" in lines
    assert '(all series: model_name="m")' in lines
    assert "strata:generation_tokens_total           5         " in lines
    assert 'strata:request_success_total{finished_reason="length"} 1         ' in lines
    assert "process_open_fds" not in text
    assert "Cached input tokens" not in text  # the server did not say


def test_run_table_shows_the_prefix_cache_share_of_the_input():
    outputs = [RequestOutput(success=True, ttft=0.01, latency=0.05, prompt_tokens=40, cached_tokens=cached,
                             output_tokens=5) for cached in (32, 0)]
    text = format_run(RunResult("x", metrics=compute_metrics(outputs, 1.0, [99])), [], [99])
    assert "Cached input tokens (prefix cache):      32 (40.0%)" in text.splitlines()
