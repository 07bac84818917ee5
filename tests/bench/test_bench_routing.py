"""`strata bench routing` end to end on a small workload: both policies run through real stacks of
two replicas behind the router, every request succeeds, and the table compares them."""

import pytest

from services.bench import routing

pytestmark = pytest.mark.slow  # starts stacks for both policies


def test_routing_bench_runs_both_policies(default_model_dir, capsys):
    argv = ["--model", str(default_model_dir), "--num-prompts", "16", "--max-concurrency", "4",
            "--prefix-num", "2", "--prefix-len", "64", "--suffix-len", "8", "--output-len", "4",
            "--num-kv-blocks", "32", "--engine-args=--enforce-eager"]  # the engines' compiled graphs are tested elsewhere
    assert routing.main(argv) == 0
    table = capsys.readouterr().out
    assert "cache-aware" in table and "round-robin" in table and "prefix-cache hit rate" in table
