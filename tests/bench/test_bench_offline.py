"""`strata bench offline` end to end on a tiny shape: it runs the engine and both HF baselines on
the same requests, works out this machine's floor for them, times the batch-1 decode step beside
its floors in both dtypes, prints the tables and writes a result that `strata bench compare` reads."""

import json

import pytest

from services.bench import compare, offline
from services.bench.checkpoints import write_random_llama
from services.bench.decode_floors import decode_step_bytes
from services.bench.floor import workload_cost
from services.bench.results import load_result
from services.engine.models.config import load_model_config


@pytest.mark.slow  # runs the offline bench on a model
def test_offline_bench_runs_engine_and_baselines_and_writes_a_comparable_result(tmp_path, capsys):
    argv = ["--shape", "tiny", "--num-prompts", "4", "--input-len", "8,24", "--output-len", "4,8",
            "--hf-batch1-prompts", "2", "--save-result", "--result-dir", str(tmp_path),
            "--result-filename", "offline.json", "--step-context", "20", "--step-repeats", "2"]
    assert offline.main(argv) == 0
    table = capsys.readouterr().out
    assert "strata / run" in table and "hf-batch1" in table and "hf-static" in table
    assert "floor:" in table and "GB of K/V reads" in table
    assert "Batch-1 decode step (context 20)" in table and "step/linear" in table

    result = load_result(tmp_path / "offline.json")
    assert result.kind == "offline"
    runs = {run.label: run.metrics for run in result.runs}
    assert set(runs) == {"strata", "hf-batch1", "hf-static", "floor", "decode-step-float32", "decode-step-bfloat16"}
    # the floor's work is the workload's, counted (its rates are measured, so not asserted)
    config = load_model_config(write_random_llama(tmp_path / "tiny", "tiny"))
    prompts, output_lens = offline.make_workload(4, (8, 24), (4, 8), config.vocab_size, 0)
    cost = workload_cost(config, 4, [len(p) for p in prompts], output_lens)
    assert runs["floor"]["tflops"] == cost.flops / 1e12 and runs["floor"]["kv_read_gb"] == cost.kv_bytes / 1e9
    # Every request runs to its own length, so the engine and the static batch count the same tokens.
    assert runs["strata"]["total_output_tokens"] == runs["hf-static"]["total_output_tokens"]
    assert runs["strata"]["completed"] == 4 and runs["hf-batch1"]["completed"] == 2
    assert all(m["output_throughput"] > 0 for m in runs.values())
    # the batch-1 steps read the bytes counted for them, at the bandwidth the floor measured
    for dtype, element_size in (("float32", 4), ("bfloat16", 2)):
        step = runs[f"decode-step-{dtype}"]
        read = decode_step_bytes(config, element_size, 20)
        assert (step["weight_mb"], step["kv_mb"]) == (read.weights / 1e6, read.kv / 1e6)
        assert step["read_gb_per_s"] == runs["floor"]["read_gb_per_s"]
        assert step["bandwidth_floor_ms"] == pytest.approx((read.weights + read.kv) / (step["read_gb_per_s"] * 1e9) * 1e3)
    assert json.loads((tmp_path / "offline.json").read_text())["schema"] == "strata.bench/1"

    assert compare.main([str(tmp_path / "offline.json"), str(tmp_path / "offline.json")]) == 0
    assert "output_throughput" in capsys.readouterr().out


@pytest.mark.parametrize("value, names", [("float32,bfloat16", ["float32", "bfloat16"]), (" bfloat16 ,", ["bfloat16"]),
                                          ("none", []), ("", [])])
def test_step_dtypes_parse_and_none_or_nothing_skips_the_section(value, names):
    assert offline.parse_step_dtypes(value) == names


@pytest.mark.parametrize("value", ["512,64", "0", "x", "1,2,3", ""])
def test_a_bad_length_ends_the_command_with_a_usage_error_before_anything_runs(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        offline.main(["--input-len", value])
    assert exit_info.value.code == 2
    assert "argument --input-len" in capsys.readouterr().err


def test_an_unknown_step_dtype_is_refused_before_the_workload_runs(tmp_path):
    with pytest.raises(SystemExit, match=r"--step-dtypes: unknown dtype\(s\) \['fp16'\]"):
        offline.main(["--model", str(tmp_path / "never-read"), "--step-dtypes", "float32,fp16"])


def test_flags_the_engine_refuses_end_it_with_the_reason(tmp_path):
    model = write_random_llama(tmp_path / "tiny", "tiny")
    with pytest.raises(SystemExit, match=r"^strata bench offline: --quantization fp8: .* is not quantized"):
        offline.main(["--model", str(model), "--quantization", "fp8", "--num-prompts", "1", "--baselines", "none",
                      "--step-dtypes", "none"])


def test_int8_weights_time_the_bfloat16_step_alone(tmp_path):
    """--quantization int8 serves bfloat16: the default --step-dtypes drops its float32 row; asking for it
    is refused before anything runs."""
    with pytest.raises(SystemExit, match="serves bfloat16 only"):
        offline.main(["--model", str(tmp_path / "never-read"), "--quantization", "int8", "--step-dtypes", "float32"])


@pytest.mark.slow  # runs the offline bench on a model
def test_sampling_names_how_both_the_engine_and_hf_sample(tmp_path, capsys):
    sampling = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    argv = ["--shape", "tiny", "--num-prompts", "3", "--input-len", "8,16", "--output-len", "4,6", "--baselines",
            "hf-static", "--step-dtypes", "none", "--sampling", json.dumps(sampling), "--save-result",
            "--result-dir", str(tmp_path), "--result-filename", "sampled.json"]
    assert offline.main(argv) == 0
    runs = {run.label: run for run in load_result(tmp_path / "sampled.json").runs}
    assert runs["strata"].params["sampling"] == sampling == runs["hf-static"].params["sampling"]
    assert runs["strata"].metrics["total_output_tokens"] == runs["hf-static"].metrics["total_output_tokens"]
    assert offline.hf_sampling(sampling) == {"do_sample": True, **sampling}
    assert offline.hf_sampling({"top_k": 5}) == {"do_sample": True, "temperature": 1.0, "top_k": 5, "top_p": 1.0,
                                                 "repetition_penalty": 1.0}
    assert offline.hf_sampling({"temperature": 0.0}) == {"do_sample": False}


@pytest.mark.parametrize("text, problem", [("{", "not JSON"), ('{"seed": 1}', "a JSON object of"),
                                           ("[0.5]", "a JSON object of"), ('{"temperature": -1}', "temperature")])
def test_a_sampling_that_requests_could_not_carry_is_refused(text, problem, capsys):
    with pytest.raises(SystemExit):
        offline.build_parser().parse_args(["--sampling", text])
    assert problem in capsys.readouterr().err
