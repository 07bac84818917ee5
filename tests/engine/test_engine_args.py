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


@pytest.mark.parametrize("argv", [["--dtype", "float8"], ["--attention-backend", "cuda"], ["--block-size", "x"]])
def test_bad_values_are_refused_by_the_parser(argv):
    with pytest.raises(SystemExit):
        engine_parser().parse_args(argv)


def test_passed_through_flags_default_to_not_given_and_state_the_engines_default():
    parser = argparse.ArgumentParser()
    add_engine_passthrough_args(parser, ["max_num_seqs", "dtype", "enable_prefix_caching"])
    assert vars(parser.parse_args([])) == {"max_num_seqs": None, "dtype": None, "enable_prefix_caching": None}
    assert parser.parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    helps = {action.dest: action.help for action in parser._actions}
    assert helps["max_num_seqs"].endswith("(default: 64)")
    assert helps["dtype"].endswith("(default: auto)")
