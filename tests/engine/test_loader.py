"""Checkpoint parsing and loading: the three architectures, both rope config forms, sharding, dtypes, errors."""

import json
from unittest.mock import patch

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from services.engine.attention import get_attention_backend
from services.engine.models import loader
from services.engine.models.config import load_model_config
from services.engine.models.loader import load_model
from services.engine.models.rope import rope_inv_freq

from .checkpoints import write_checkpoint

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


def load(path, dtype=torch.float32):
    config = load_model_config(path)
    backend = get_attention_backend("torch", config.num_heads, config.num_kv_heads, config.head_dim, dtype)
    return load_model(path, config, backend, 64, dtype, torch.device("cpu"))


@pytest.mark.parametrize("legacy_rope", [False, True])
def test_llama_config_both_rope_forms(tmp_path, legacy_rope):
    path = write_checkpoint(tmp_path, "llama", legacy_rope=legacy_rope, rope_scaling=LLAMA3, rope_theta=5e5,
                            head_dim=32, attention_bias=True)
    raw = json.loads((path / "config.json").read_text())
    assert ("rope_scaling" in raw) == legacy_rope and ("rope_parameters" in raw) != legacy_rope
    config = load_model_config(path)
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 32)
    assert config.rope.rope_type == "llama3" and config.rope.theta == 5e5
    assert config.rope.params["factor"] == 8.0
    assert config.attention_bias and config.o_proj_bias and not config.mlp_bias
    assert config.eos_token_ids == (2,) and config.layer_sliding_windows == (None, None)


def test_qwen2_and_mistral_specifics(tmp_path):
    qwen = load_model_config(write_checkpoint(tmp_path / "q", "qwen2", tie_word_embeddings=True, sliding_window=32))
    assert qwen.attention_bias and not qwen.o_proj_bias and qwen.tie_word_embeddings
    assert qwen.layer_sliding_windows == (None, None)  # use_sliding_window is false
    mistral = load_model_config(write_checkpoint(tmp_path / "m", "mistral", sliding_window=64))
    assert mistral.layer_sliding_windows == (64, 64) and not mistral.attention_bias
    assert mistral.resolve_max_model_len(None) == 256  # the window does not limit the context
    assert mistral.resolve_max_model_len(48) == 48
    with pytest.raises(ValueError, match="longest sequence 256"):
        qwen.resolve_max_model_len(512)


def test_sliding_window_layers_as_transformers_decides(tmp_path):
    def windows(name, arch, edit=None, **overrides):
        path = write_checkpoint(tmp_path / name, arch, num_hidden_layers=3, **overrides)
        if edit:
            raw = json.loads((path / "config.json").read_text())
            edit(raw)
            (path / "config.json").write_text(json.dumps(raw))
        return load_model_config(path).layer_sliding_windows

    # Qwen2: only with use_sliding_window, from max_window_layers on, or as layer_types names them
    assert windows("q1", "qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=1) == (None, 32, 32)
    assert windows("q2", "qwen2", use_sliding_window=True, sliding_window=32,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"]) == (32, None, 32)
    assert windows("q3", "qwen2", use_sliding_window=False, sliding_window=32, max_window_layers=0) == (None,) * 3
    # Mistral: every layer; null turns it off; a config without the key gets transformers' 4096
    assert windows("m1", "mistral", sliding_window=None) == (None,) * 3
    assert windows("m2", "mistral", edit=lambda raw: raw.pop("sliding_window")) == (4096,) * 3
    # Llama never slides, whatever the config carries
    assert windows("l1", "llama", edit=lambda raw: raw.update(sliding_window=16)) == (None,) * 3
    with pytest.raises(ValueError, match="layer_types"):
        windows("q4", "qwen2", use_sliding_window=True, sliding_window=32,
                edit=lambda raw: raw.update(layer_types=["sliding_attention", "chunked_attention", "full_attention"]))


@pytest.mark.parametrize("rope", [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 2.0},
    LLAMA3,
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16, "mscale": 2.0,
     "mscale_all_dim": 1.0},
])
def test_rope_frequencies_match_hf(tmp_path, rope):
    path = write_checkpoint(tmp_path, "llama", rope_parameters={**rope, "rope_theta": 1e4})
    ours, our_scaling = rope_inv_freq(load_model_config(path).rope, 16)
    hf_config = AutoConfig.from_pretrained(path)
    theirs, their_scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu") if rope["rope_type"] != "default" \
        else (1.0 / (1e4 ** (torch.arange(0, 16, 2).float() / 16)), 1.0)
    torch.testing.assert_close(ours, theirs)
    assert our_scaling == pytest.approx(their_scaling)


@pytest.mark.parametrize("factor", [2.0, 4.0])
def test_dynamic_ntk_rope_is_transformers_base_at_the_extended_length(tmp_path, factor):
    """vLLM's dynamic NTK: one base for every position, the one transformers' dynamic rope reaches at
    factor x max_position_embeddings (transformers keeps the original base below the original length)."""
    path = write_checkpoint(tmp_path, "llama", rope_parameters={"rope_type": "dynamic", "factor": factor,
                                                                "rope_theta": 1e4})
    config = load_model_config(path)
    ours, our_scaling = rope_inv_freq(config.rope, 16)
    extended = int(256 * factor)
    assert config.max_position_embeddings == extended  # as vLLM derives the longest sequence
    theirs, their_scaling = ROPE_INIT_FUNCTIONS["dynamic"](AutoConfig.from_pretrained(path), "cpu", seq_len=extended)
    torch.testing.assert_close(ours, theirs)
    assert our_scaling == their_scaling == 1.0
    original, _ = ROPE_INIT_FUNCTIONS["dynamic"](AutoConfig.from_pretrained(path), "cpu", seq_len=256)
    assert not torch.allclose(ours, original)


def test_sharded_load_fuses_projections(tmp_path):
    path = write_checkpoint(tmp_path, "qwen2", max_shard_size="50KB", tie_word_embeddings=True)
    assert (path / "model.safetensors.index.json").is_file()
    model = load(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    attn = model.model.layers[1].self_attn
    torch.testing.assert_close(attn.qkv_proj.weight, torch.cat([hf[f"model.layers.1.self_attn.{p}_proj.weight"]
                                                                for p in "qkv"]), rtol=0, atol=0)
    torch.testing.assert_close(attn.qkv_proj.bias, torch.cat([hf[f"model.layers.1.self_attn.{p}_proj.bias"]
                                                              for p in "qkv"]), rtol=0, atol=0)
    # tied: the logits projection is the embedding itself (packed for the CPU, not copied from lm_head)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_float16_checkpoint_runs_in_bfloat16_on_the_cpu_unless_asked(tmp_path):
    config = load_model_config(write_checkpoint(tmp_path, "llama", dtype=torch.float16))
    assert config.resolve_dtype("auto", "cpu") == torch.bfloat16  # the native CPU kernels' 16-bit type
    assert config.resolve_dtype("auto", "cuda:0") == torch.float16
    assert config.resolve_dtype("float16", "cpu") == torch.float16


def test_dtypes(tmp_path):
    path = write_checkpoint(tmp_path, "llama", dtype=torch.bfloat16)
    config = load_model_config(path)
    assert config.resolve_dtype("auto", "cpu") == torch.bfloat16
    assert config.resolve_dtype("float16", "cpu") == torch.float16
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()
    model = load(path, torch.float32)  # upcast on load
    assert all(p.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(model.model.layers[0].mlp.down_proj.weight,
                               hf["model.layers.0.mlp.down_proj.weight"].float(), rtol=0, atol=0)


def test_unsupported_architecture(tmp_path):
    path = write_checkpoint(tmp_path, "llama")
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model_config(path)


def test_missing_tensor_named_and_extra_tensor_ignored(tmp_path):
    path = write_checkpoint(tmp_path, "llama")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, path / "model.safetensors")
    load(path)  # the extra tensor is ignored
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load(path)


@pytest.mark.parametrize("max_shard_size", [None, "50KB"])
def test_pytorch_bin_checkpoints_load_like_safetensors(tmp_path, max_shard_size):
    """Older checkpoints hold pytorch_model.bin (or shards and pytorch_model.bin.index.json), as vLLM reads them."""
    path = write_checkpoint(tmp_path / "safetensors", "qwen2")
    tensors = load_file(path / "model.safetensors")
    pickled = tmp_path / "bin"
    pickled.mkdir()
    (pickled / "config.json").write_text((path / "config.json").read_text())
    if max_shard_size is None:
        torch.save(tensors, pickled / "pytorch_model.bin")
    else:
        names = sorted(tensors)
        shards = {f"pytorch_model-0000{i + 1}-of-00003.bin": names[i::3] for i in range(3)}
        for file, shard in shards.items():
            torch.save({name: tensors[name] for name in shard}, pickled / file)
        weight_map = {name: file for file, shard in shards.items() for name in shard}
        (pickled / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with patch.object(loader, "can_pack", lambda device, dtype: False):
        ours, reference = load(pickled), load(path)
    reference_params = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param, reference_params[name], rtol=0, atol=0, msg=name)
    for file in pickled.glob("pytorch_model*"):
        file.unlink()
    with pytest.raises(ValueError, match="has no weights: neither model.safetensors"):
        load(pickled)
