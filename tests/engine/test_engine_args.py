"""The engine's flags are built from EngineConfig: one flag per field, with the field's default and
help, so a flag's default cannot drift from the class's."""

import argparse
import dataclasses

import pytest

from services.engine.config import EngineConfig
from services.engine.engine_args import add_engine_args, add_engine_passthrough_args, config_from_args


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


def test_no_flags_make_the_class_defaults():
    parsed = config_from_args(engine_parser().parse_args(["--model", "ckpt"]))
    assert parsed == EngineConfig(model="ckpt")


def test_every_field_is_a_flag_with_help_and_every_flag_a_field():
    parser = engine_parser()
    flags = {action.dest: action for action in parser._actions if action.dest != "help"}
    assert set(flags) == {field.name for field in dataclasses.fields(EngineConfig)}
    for dest, action in flags.items():
        assert action.help and "default" in action.help, dest
        assert action.option_strings[0] == "--" + dest.replace("_", "-")


@pytest.mark.parametrize("argv, expected", [
    (["--dtype", "bfloat16", "--block-size", "32", "--num-kv-blocks", "9", "--max-model-len", "77"],
     {"dtype": "bfloat16", "block_size": 32, "num_kv_blocks": 9, "max_model_len": 77}),
    (["--no-enable-prefix-caching", "--enforce-eager", "--num-threads", "2", "--stream-interval", "4"],
     {"enable_prefix_caching": False, "enforce_eager": True, "num_threads": 2, "stream_interval": 4}),
    (["--attention-backend", "torch", "--replica-id", "engine-3", "--seed", "7", "--prefix-cache-hash-seed", "5"],
     {"attention_backend": "torch", "replica_id": "engine-3", "seed": 7, "prefix_cache_hash_seed": 5}),
])
def test_flags_set_their_fields(argv, expected):
    config = config_from_args(engine_parser().parse_args(["--model", "ckpt", *argv]))
    assert {name: getattr(config, name) for name in expected} == expected


@pytest.mark.parametrize("argv, expected", [
    (["--max-model-len", "32K", "--max-num-batched-tokens", "8k", "--kv-cache-memory-bytes", "4G"],
     {"max_model_len": 32768, "max_num_batched_tokens": 8000, "kv_cache_memory_bytes": 4 << 30}),
    (["--max-model-len", "25.6k", "--max-num-batched-tokens", " 4096 "],
     {"max_model_len": 25600, "max_num_batched_tokens": 4096}),
    (["--max-model-len", "auto"], {"max_model_len": None}),
    (["--max-model-len", "-1"], {"max_model_len": None}),
    (["--max-model-len", "1m", "--kv-cache-memory-bytes", "1.5g"], {"max_model_len": 10**6,
                                                                   "kv_cache_memory_bytes": 1_500_000_000}),
])
def test_counts_read_as_vllm_reads_them(argv, expected):
    """vLLM's human-readable counts: lower-case suffixes decimal, upper-case binary; auto or -1 for
    --max-model-len leaves it to the engine."""
    config = config_from_args(engine_parser().parse_args(["--model", "ckpt", *argv]))
    assert {name: getattr(config, name) for name in expected} == expected


@pytest.mark.parametrize("argv", [["--dtype", "float8"], ["--attention-backend", "cuda"], ["--block-size", "x"],
                                  ["--max-model-len", "1.5K"], ["--max-model-len", "32KB"],
                                  ["--max-num-batched-tokens", "lots"], ["--max-model-len", ""]])
def test_bad_values_are_refused_by_the_parser(argv):
    with pytest.raises(SystemExit):
        engine_parser().parse_args(argv)


@pytest.mark.parametrize("argv", [["--max-model-len", "0"], ["--kv-cache-memory-bytes", "0"]])
def test_counts_below_one_are_refused_by_the_config(argv):
    with pytest.raises(SystemExit, match="must be >= 1"):
        config_from_args(engine_parser().parse_args(["--model", "ckpt", *argv]))


@pytest.mark.parametrize("argv, message", [
    (["--tensor-parallel-size", "2"], "holds the whole model on one device; serve more copies with strata up "
                                      "--replicas N"),
    (["--kv-cache-dtype", "fp8"], "fp8 K/V is not supported"),
])
def test_vllm_flags_strata_cannot_honour_are_refused_saying_why(argv, message):
    assert config_from_args(engine_parser().parse_args(["--model", "ckpt", "--tensor-parallel-size", "1",
                                                        "--kv-cache-dtype", "auto"])) == EngineConfig(model="ckpt")
    with pytest.raises(SystemExit, match=message):
        config_from_args(engine_parser().parse_args(["--model", "ckpt", *argv]))


def test_passed_through_flags_default_to_not_given_and_state_the_engines_default():
    parser = argparse.ArgumentParser()
    add_engine_passthrough_args(parser, ["max_num_seqs", "dtype", "enable_prefix_caching"])
    assert vars(parser.parse_args([])) == {"max_num_seqs": None, "dtype": None, "enable_prefix_caching": None}
    assert parser.parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    helps = {action.dest: action.help for action in parser._actions}
    assert helps["max_num_seqs"].endswith("(default: 64)")
    assert helps["dtype"].endswith("(default: auto)")
