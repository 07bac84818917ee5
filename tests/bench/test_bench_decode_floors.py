"""The batch-1 decode section of `strata bench offline`: the bytes behind its bandwidth floor,
counted against the checkpoint's own parameters, and the projections its linear floor runs."""

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from services.bench.checkpoints import write_random_llama
from services.bench.decode_floors import decode_step_bytes, projections
from services.engine.config import EngineConfig
from services.engine.model_runner import ModelRunner
from services.engine.models.config import load_model_config


def test_step_reads_every_weight_once_and_one_embedding_row(tmp_path):
    model_dir = write_random_llama(tmp_path / "tiny", "tiny")
    mc = load_model_config(model_dir)
    hf = LlamaForCausalLM.from_pretrained(model_dir)
    num_params = sum(p.numel() for p in hf.parameters())
    read = decode_step_bytes(mc, 4, context=10)
    # untied: the embedding table is read one row at a time, the logits' matrix in full
    assert read.weights == 4 * (num_params - mc.vocab_size * mc.hidden_size + mc.hidden_size)
    assert read.kv == 4 * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 10
    assert decode_step_bytes(mc, 2, context=10) == type(read)(read.weights // 2, read.kv // 2)


def test_biases_and_tied_embeddings_are_counted(tmp_path):
    hf = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=96, vocab_size=300,
                                      attention_bias=True, mlp_bias=True, tie_word_embeddings=True))
    hf.save_pretrained(tmp_path / "biased")
    mc = load_model_config(tmp_path / "biased")
    num_params = sum(p.numel() for p in hf.parameters())  # the tied table once: it is the logits' matrix
    assert decode_step_bytes(mc, 4, context=0).weights == 4 * (num_params + mc.hidden_size)


def test_int8_weights_count_a_byte_a_weight_and_their_scales(tmp_path):
    """--quantization int8: the projections and the head's matrix at one byte a weight with a float32
    scale per output row, as the loaded model holds them; the rest (norms, an embedding row, K/V) bfloat16."""
    model_dir = write_random_llama(tmp_path / "tiny", "tiny")
    mc = load_model_config(model_dir)
    runner = ModelRunner(EngineConfig(model=str(model_dir), quantization="int8", num_kv_blocks=4))
    layers = [m for m in runner.model.modules() if hasattr(m, "scales")]
    matrices = sum(m.out_features * m.in_features for m in layers)
    scales = sum(m.scales.nbytes for m in layers)
    others = 2 * (mc.num_layers * 2 * mc.hidden_size + 2 * mc.hidden_size)  # the norms, one embedding row
    bf16 = decode_step_bytes(mc, 2, context=10)
    int8 = decode_step_bytes(mc, 2, context=10, int8_weights=True)
    assert bf16.weights == 2 * matrices + others
    assert int8.weights == matrices + scales + others
    assert int8.kv == bf16.kv


@pytest.mark.slow  # loads three architectures
def test_projections_are_the_loaded_modules_in_layer_order(tmp_path):
    model_dir = write_random_llama(tmp_path / "tiny", "tiny")
    runner = ModelRunner(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=4))
    model, mc = runner.model, runner.model_config
    steps = projections(model)
    assert len(steps) == 4 * mc.num_layers + 1
    layer = model.model.layers[1]
    q_size, qkv_size = mc.num_heads * mc.head_dim, (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
    assert steps[4:8] == [(layer.self_attn.qkv_proj, mc.hidden_size), (layer.self_attn.o_proj, q_size),
                          (layer.mlp.gate_up_proj, mc.hidden_size), (layer.mlp.down_proj, mc.intermediate_size)]
    assert all(isinstance(module, nn.Module) for module, _ in steps[:-1])
    assert steps[-1] == (model.compute_logits, mc.hidden_size)
    widths = [qkv_size, mc.hidden_size, 2 * mc.intermediate_size, mc.hidden_size] * mc.num_layers + [mc.vocab_size]
    with torch.inference_mode():
        assert [module(torch.randn(1, width)).shape[1] for module, width in steps] == widths
