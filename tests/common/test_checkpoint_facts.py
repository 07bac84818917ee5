"""The engine and the tokenizer service take a checkpoint's EOS ids and longest sequence from one
place (`services.common.checkpoint_facts`), so they agree, on checkpoints written the ways published
ones are: Llama-3 (tokenizer eos + a generation_config list), Qwen2 (tokenizer eos not the first of
generation_config's), Mistral/Llama-2 (no generation_config, the eos in a legacy special_tokens_map
and config.json), and a tokenizer eos that generation_config does not list at all."""

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer
from tokenizers.models import WordLevel

from services.common import checkpoint_facts
from services.engine.models.config import load_model_config
from services.tokenizer.checkpoint_tokenizer import CheckpointTokenizer

SPECIALS = ["<s>", "</s>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>", "<|endoftext|>"]  # ids 1..6


def write_checkpoint(path, tokenizer_config: dict, generation_config: dict | None, config_eos,
                     special_tokens_map: dict | None = None, max_positions: int | None = 4096) -> str:
    path.mkdir()
    vocab = {"<unk>": 0, **{token: i for i, token in enumerate(SPECIALS, start=1)}, "hello": 7, "world": 8}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "vocab_size": 16, "hidden_size": 8,
              "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-5, "eos_token_id": config_eos}
    if max_positions:
        config["max_position_embeddings"] = max_positions
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    if special_tokens_map is not None:
        (path / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    return str(path)


@pytest.mark.parametrize("style, kwargs, expected", [
    ("llama3", dict(tokenizer_config={"eos_token": "<|eot_id|>"}, generation_config={"eos_token_id": [3, 4]},
                    config_eos=3), (4, 3)),
    ("qwen2", dict(tokenizer_config={"eos_token": "<|im_end|>", "model_max_length": 131072},
                   generation_config={"eos_token_id": [5, 6]}, config_eos=6), (5, 6)),
    ("mistral", dict(tokenizer_config={}, generation_config=None, config_eos=2,
                     special_tokens_map={"eos_token": {"content": "</s>", "lstrip": False}}), (2,)),
    ("eos-not-in-generation-config", dict(tokenizer_config={"eos_token": "<|im_end|>"},
                                          generation_config={"eos_token_id": 6}, config_eos=6), (5, 6)),
    ("config-only", dict(tokenizer_config={}, generation_config={}, config_eos=[2, 3]), (2, 3)),
])
def test_engine_and_tokenizer_agree_on_the_eos_ids(tmp_path, style, kwargs, expected):
    model_dir = write_checkpoint(tmp_path / style, **kwargs)
    assert checkpoint_facts.eos_token_ids(model_dir) == expected
    assert load_model_config(model_dir).eos_token_ids == expected
    assert CheckpointTokenizer.from_dir(model_dir).eos_token_ids == expected


def test_engine_and_tokenizer_agree_on_the_longest_sequence(tmp_path):
    from_config = write_checkpoint(tmp_path / "config", {"model_max_length": 100}, None, 2, max_positions=4096)
    from_tokenizer = write_checkpoint(tmp_path / "tokenizer", {"model_max_length": 100}, None, 2, max_positions=None)
    for model_dir, expected in ((from_config, 4096), (from_tokenizer, 100)):
        assert load_model_config(model_dir).max_position_embeddings == expected
        assert CheckpointTokenizer.from_dir(model_dir).max_model_len == expected
    neither = write_checkpoint(tmp_path / "neither", {"model_max_length": 10**30}, None, 2, max_positions=None)
    with pytest.raises(ValueError, match="no max_position_embeddings"):
        checkpoint_facts.max_model_len(neither)


@pytest.mark.parametrize("rope, legacy, expected", [
    ({"rope_type": "linear", "factor": 4.0}, True, 16384),  # vicuna-7b-v1.5-16k
    ({"type": "linear", "factor": 4.0}, True, 16384),  # the older key
    ({"rope_type": "dynamic", "factor": 2.0}, False, 8192),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, True, 4096),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 512}, False, 4096),  # Llama 3.1 states its extended length
    ({"rope_type": "default"}, False, 4096),
    (None, True, 4096),
])
def test_rope_scaling_extends_the_longest_sequence_as_vllm_derives_it(tmp_path, rope, legacy, expected):
    model_dir = Path(write_checkpoint(tmp_path / "model", {"model_max_length": 100}, None, 2, max_positions=4096))
    config = json.loads((model_dir / "config.json").read_text())
    if rope is not None:
        config["rope_scaling" if legacy else "rope_parameters"] = rope
    (model_dir / "config.json").write_text(json.dumps(config))
    assert checkpoint_facts.max_model_len(model_dir) == expected
    assert CheckpointTokenizer.from_dir(model_dir).max_model_len == expected


@pytest.mark.parametrize("text, message", [('{"temperature": 0.7,', "is not valid JSON"),
                                           ("[1, 2]", "must hold a JSON object, not list"),
                                           (b"\xff\xfe{}", "is not valid JSON")])
def test_a_file_that_holds_no_json_object_is_refused_by_name(tmp_path, text, message):
    path = tmp_path / "generation_config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError) as info:
        checkpoint_facts.read_json(path)
    assert str(path) in str(info.value) and message in str(info.value)
    assert checkpoint_facts.read_json(tmp_path / "absent.json") == {}
