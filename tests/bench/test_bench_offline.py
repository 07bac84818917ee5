"""`strata bench offline` end to end on a tiny shape: it runs the engine and both HF baselines on
the same requests, works out this machine's floor for them, prints the table and writes a result
that `strata bench compare` reads."""

import json

from services.bench import compare, offline
from services.bench.checkpoints import write_random_llama
from services.bench.floor import workload_cost
from services.engine.models.config import load_model_config
from services.bench.results import load_result


def test_offline_bench_runs_engine_and_baselines_and_writes_a_comparable_result(tmp_path, capsys):
    argv = ["--shape", "tiny", "--num-prompts", "4", "--input-len", "8,24", "--output-len", "4,8",
            "--hf-batch1-prompts", "2", "--save-result", "--result-dir", str(tmp_path),
            "--result-filename", "offline.json"]
    assert offline.main(argv) == 0
    table = capsys.readouterr().out
    assert "strata / run" in table and "hf-batch1" in table and "hf-static" in table
    assert "floor:" in table and "GB of K/V reads" in table

    result = load_result(tmp_path / "offline.json")
    assert result.kind == "offline"
    runs = {run.label: run.metrics for run in result.runs}
    assert set(runs) == {"strata", "hf-batch1", "hf-static", "floor"}
    # the floor's work is the workload's, counted (its rates are measured, so not asserted)
    config = load_model_config(write_random_llama(tmp_path / "tiny", "tiny"))
    prompts, output_lens = offline.make_workload(4, (8, 24), (4, 8), config.vocab_size, 0)
    cost = workload_cost(config, 4, [len(p) for p in prompts], output_lens)
    assert runs["floor"]["tflops"] == cost.flops / 1e12 and runs["floor"]["kv_read_gb"] == cost.kv_bytes / 1e9
    # Every request runs to its own length, so the engine and the static batch count the same tokens.
    assert runs["strata"]["total_output_tokens"] == runs["hf-static"]["total_output_tokens"]
    assert runs["strata"]["completed"] == 4 and runs["hf-batch1"]["completed"] == 2
    assert all(m["output_throughput"] > 0 for m in runs.values())
    assert json.loads((tmp_path / "offline.json").read_text())["schema"] == "strata.bench/1"

    assert compare.main([str(tmp_path / "offline.json"), str(tmp_path / "offline.json")]) == 0
    assert "output_throughput" in capsys.readouterr().out
