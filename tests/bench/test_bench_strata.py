"""`strata bench serve` against the live Strata stack on the built-in model: what the client
counts equals the server's usage and the deltas of the gateway's `strata:` counters."""

from pathlib import Path

import pytest

from services.bench.__main__ import main as bench_main
from services.bench.results import load_result
from services.launcher import Stack, StackConfig, StartupError, find_free_port

API_KEY = "sk-bench-test"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def strata_url(default_model_dir, tmp_path_factory):
    """The whole stack (tokenizer, engine, gateway processes) on the built-in model, with an API key."""
    config = StackConfig(model=str(default_model_dir), port=find_free_port(), api_key=API_KEY,
                         engine_args=["--max-num-seqs", "8", "--enforce-eager"], gateway_args=["--log-level", "warning"],
                         log_dir=tmp_path_factory.mktemp("bench-stack-logs"), echo_logs=False,
                         startup_timeout_s=120, grace_s=5)
    stack = Stack(config)
    try:
        stack.start()
    except StartupError as error:
        pytest.fail(f"the stack did not start: {error}")
    yield stack.base_url
    stack.stop()


def _counter(run, name: str) -> float:
    """Sum of a counter's deltas over its label sets (e.g. every model_name)."""
    counters = run.server_metrics["counters"]
    return sum(v for k, v in counters.items() if k == name or k.startswith(name + "{"))


def _serve(url: str, out_dir: Path, *extra: str):
    argv = ["serve", "--base-url", url, "--api-key", API_KEY, "--num-prompts", "6", "--max-concurrency", "3",
            "--num-warmups", "1",
            "--ignore-eos", "--continuous-usage-stats", "--save-result", "--save-detailed", "--no-plots",
            "--disable-tqdm", "--result-dir", str(out_dir), "--result-filename", "run.json", *extra]
    assert bench_main(argv) == 0
    return load_result(out_dir / "run.json").runs[0]


def test_token_id_prompts_counts_match_usage_and_metrics(strata_url, tmp_path):
    run = _serve(strata_url, tmp_path, "--random-input-len", "16", "--random-output-len", "8")
    m = run.metrics
    assert (m["completed"], m["failed"]) == (6, 0), run.errors
    assert m["total_input_tokens"] == 6 * 16 and m["total_output_tokens"] == 6 * 8
    for sample in run.samples:
        assert sample["prompt_tokens"] == 16 and sample["output_tokens"] == 8
        assert len(sample["itl_ms"]) == 7  # usage on every chunk: one gap per token after the first
    assert _counter(run, "strata:generation_tokens_total") == m["total_output_tokens"]
    assert _counter(run, "strata:prompt_tokens_total") == m["total_input_tokens"]


def test_chat_text_prompts_counts_match_usage_and_metrics(strata_url, tmp_path):
    run = _serve(strata_url, tmp_path, "--endpoint", "/v1/chat/completions", "--dataset-name", "shared-prefix",
                 "--prefix-num", "2", "--prefix-len", "24", "--suffix-len", "6", "--random-output-len", "5")
    m = run.metrics
    assert (m["completed"], m["failed"]) == (6, 0), run.errors
    assert m["total_output_tokens"] == 6 * 5
    assert m["total_input_tokens"] == sum(s["prompt_tokens"] for s in run.samples) > 6 * 30
    assert _counter(run, "strata:generation_tokens_total") == m["total_output_tokens"]
    assert _counter(run, "strata:prompt_tokens_total") == m["total_input_tokens"]


def test_a_repeated_workload_reports_what_the_prefix_cache_held(strata_url, tmp_path):
    """The same --seed twice: the second run's prompts are in the engine's prefix cache, and the result
    says how much of them (every whole 16-token block before each prompt's last token)."""
    workload = ("--random-input-len", "40", "--random-output-len", "4", "--seed", "11", "--num-warmups", "0")
    cold = _serve(strata_url, tmp_path / "cold", *workload)
    warm = _serve(strata_url, tmp_path / "warm", *workload)
    assert cold.metrics["total_cached_input_tokens"] == 0
    assert warm.metrics["total_cached_input_tokens"] == 6 * 32
    assert [sample["cached_tokens"] for sample in warm.samples] == [32] * 6
