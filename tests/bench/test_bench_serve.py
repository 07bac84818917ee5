"""`strata bench serve` and `compare` end to end, against the real streaming test server."""

import json

from services.bench.__main__ import main as bench_main
from services.bench.results import BenchResult, RunResult, load_result, save_result

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def serve(base_url, tmp_path, *extra):
    argv = ["serve", "--base-url", base_url, "--save-result", "--result-dir", str(tmp_path),
            "--disable-tqdm", *extra]
    return bench_main(argv)


def test_sweep_counts_match_the_server_and_files_are_written(start_server, tmp_path, capsys):
    base_url, state = start_server()
    rc = serve(base_url, tmp_path, "--num-prompts", "8", "--num-warmups", "2", "--max-concurrency", "1,3",
               "--random-input-len", "12", "--random-output-len", "7", "--ignore-eos",
               "--continuous-usage-stats", "--goodput", "ttft:10000", "--save-detailed",
               "--result-filename", "run.json")
    assert rc == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Sweep (latencies in ms)" in out
    assert "Successful requests:                     8" in out

    # 2 sweep points x (8 measured + 2 warmup) requests, every one answered in full
    assert state.num_requests == 20 and state.num_refused == 0
    assert state.prompt_tokens == 20 * 12 and state.completion_tokens == 20 * 7
    for body in state.bodies:
        assert body["stream"] is True and body["ignore_eos"] is True and body["max_tokens"] == 7
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert len(body["prompt"]) == 12 and all(isinstance(t, int) and 0 <= t < 256 for t in body["prompt"])

    result = load_result(tmp_path / "run.json")
    assert result.kind == "serve" and result.config["model"] == "tiny-test-model"
    assert "api_key" not in result.config
    assert [run.label for run in result.runs] == ["max_concurrency=1", "max_concurrency=3"]
    for run in result.runs:
        m = run.metrics
        assert (m["completed"], m["failed"]) == (8, 0)
        assert (m["total_input_tokens"], m["total_output_tokens"]) == (8 * 12, 8 * 7)
        assert m["request_goodput"] == m["request_throughput"] > 0
        assert run.server_metrics == {} and run.errors == {}
        assert len(run.samples) == 8
        for sample in run.samples:
            # usage on every chunk: the 3-token chunks count 3 gaps, so 7 tokens give 6 gaps
            assert sample["output_tokens"] == 7 and len(sample["itl_ms"]) == 6
            assert 0 < sample["ttft_ms"] <= sample["e2el_ms"]
    for name in ("run_throughput_latency.png", "run_ttft.png", "run_itl.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_chat_shared_prefix_text_prompts(start_server, tmp_path):
    base_url, state = start_server()
    rc = serve(base_url, tmp_path, "--endpoint", "/v1/chat/completions", "--dataset-name", "shared-prefix",
               "--prefix-num", "2", "--prefix-len", "20", "--suffix-len", "5", "--random-output-len", "5",
               "--num-prompts", "6", "--request-rate", "200", "--no-plots", "--result-filename", "chat.json")
    assert rc == 0
    assert state.num_requests == 6
    assert {tuple(m["role"] for m in b["messages"]) for b in state.bodies} == {("system", "user")}
    assert len({b["messages"][0]["content"] for b in state.bodies}) == 2
    run = load_result(tmp_path / "chat.json").runs[0]
    assert run.samples is None  # not asked for with --save-detailed
    assert run.metrics["completed"] == 6 and run.metrics["total_input_tokens"] == state.prompt_tokens
    assert run.metrics["total_output_tokens"] == 6 * 5
    assert list(tmp_path.glob("*.png")) == []


def test_failures_are_counted_with_their_reason(start_server, tmp_path, capsys):
    base_url, state = start_server(fail_every=3)
    rc = serve(base_url, tmp_path, "--num-prompts", "9", "--max-concurrency", "1", "--random-input-len", "4",
               "--random-output-len", "3", "--no-plots", "--result-filename", "fail.json")
    assert rc == 0
    run = load_result(tmp_path / "fail.json").runs[0]
    assert (run.metrics["completed"], run.metrics["failed"]) == (6, 3) == (9 - state.num_refused, state.num_refused)
    assert run.errors == {"HTTP 503: server overloaded": 3}
    assert "HTTP 503: server overloaded" in capsys.readouterr().out


def test_unreachable_server_is_a_clean_error(capsys):
    assert bench_main(["serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 2
    assert "strata bench serve:" in capsys.readouterr().err


def test_compare_two_serve_results_and_an_offline_one(start_server, tmp_path, capsys):
    base_url, _ = start_server()
    for name in ("a.json", "b.json"):
        assert serve(base_url, tmp_path, "--num-prompts", "4", "--random-input-len", "4", "--random-output-len",
                     "3", "--no-plots", "--result-filename", name) == 0
    capsys.readouterr()
    assert bench_main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["completed"][1:4] == ["4", "4", "1.000"]
    assert rows["total_output_tokens"][1:4] == ["12", "12", "1.000"]
    assert "p99_ttft_ms" in rows and "mean_itl_ms" in rows

    offline = BenchResult(kind="offline", config={"engine": "hf"},
                          runs=[RunResult(label="hf", metrics={"output_throughput": 10.0, "duration": 2.0})])
    save_result(offline, tmp_path / "offline.json")
    assert bench_main(["compare", str(tmp_path / "offline.json"), str(tmp_path / "a.json")]) == 0
    out = capsys.readouterr().out
    assert "(offline)" in out and "(serve)" in out
    metric_rows = [line.split()[0] for line in out.splitlines()[6:] if line.strip()]
    assert metric_rows == ["output_throughput", "duration"]  # only what both carry


def test_compare_rejects_a_file_that_is_not_a_result(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "serve"}))
    assert bench_main(["compare", str(bad), str(bad)]) == 2
    assert "not a Strata benchmark result" in capsys.readouterr().err


def test_baseline_gets_the_same_requests_and_a_side_by_side_table(start_server, tmp_path, capsys):
    base_url, state = start_server()
    baseline_url, baseline_state = start_server(token_delay_s=0.004)
    rc = serve(base_url, tmp_path, "--baseline-url", baseline_url, "--baseline-name", "llama.cpp",
               "--num-prompts", "5", "--num-warmups", "1", "--max-concurrency", "1,4", "--random-input-len", "6",
               "--random-output-len", "4", "--random-range-ratio", "0.5", "--ignore-eos", "--no-plots",
               "--result-filename", "pair.json")
    assert rc == 0
    # the same requests; at 4 streams the order they reach a server in is a race between connections
    assert sorted(map(json.dumps, state.bodies)) == sorted(map(json.dumps, baseline_state.bodies))
    assert state.num_requests == 2 * (5 + 1)
    out = capsys.readouterr().out
    table = out[out.index("strata vs llama.cpp, same requests; ratio = strata / llama.cpp"):].splitlines()[:5]
    assert table[2].split()[:4] == ["run", "strata", "llama.cpp", "ratio"]
    assert [line.split()[0] for line in table[3:]] == ["max_concurrency=1", "max_concurrency=4"]

    strata, baseline = load_result(tmp_path / "pair.json"), load_result(tmp_path / "pair-llama.cpp.json")
    assert strata.config["base_url"] == base_url and baseline.config["base_url"] == baseline_url
    for run, other, line in zip(strata.runs, baseline.runs, table[3:], strict=True):
        assert run.label == other.label
        for key in ("completed", "total_input_tokens", "total_output_tokens"):
            assert run.metrics[key] == other.metrics[key]
        cells = line.split()
        assert cells[1:3] == [f"{run.metrics['output_throughput']:.2f}", f"{other.metrics['output_throughput']:.2f}"]
        assert cells[3] == f"{run.metrics['output_throughput'] / other.metrics['output_throughput']:.2f}x"
        assert cells[-2:] == ["0", "0"]
    assert bench_main(["compare", str(tmp_path / "pair-llama.cpp.json"), str(tmp_path / "pair.json")]) == 0
    assert "max_concurrency=4  vs  max_concurrency=4" in capsys.readouterr().out
