"""Quantized checkpoints load as the weights they round to: compressed-tensors' formats made by the
compressed-tensors library itself, GPTQ and AWQ packed as AutoGPTQ and AutoAWQ pack them, FP8 with
block, channel and tensor scales; unsupported methods are refused by name. Loading the quantized
checkpoint gives exactly the model that loading its dequantized weights as a plain checkpoint gives."""

import json
from unittest.mock import patch

import pytest
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from services.engine.attention import get_attention_backend
from services.engine.config import EngineConfig
from services.engine.cpu_kernels import linear as native_linear
from services.engine.llm import LLM
from services.engine.models import loader
from services.engine.models.checkpoint_tensors import CheckpointTensors
from services.engine.models.config import load_model_config
from services.engine.models.int8_linear import Int8Linear
from services.engine.models.loader import load_model
from services.engine.models.quantized_weights import QuantizedWeights
from services.engine.sampling_params import SamplingParams

from .checkpoints import write_checkpoint

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def load(path, dtype=torch.float32):
    config = load_model_config(path)
    backend = get_attention_backend("torch", config.num_heads, config.num_kv_heads, config.head_dim, dtype)
    return load_model(path, config, backend, 64, dtype, torch.device("cpu"))


def modules(num_layers=2):
    return [f"model.layers.{i}.{p}" for i in range(num_layers) for p in PROJECTIONS]


def write_quantized(path, plain_path, tensors, quantization):
    """The plain checkpoint's config with ``quantization``, and ``tensors`` as its weights."""
    config = json.loads((plain_path / "config.json").read_text())
    config["quantization_config"] = quantization
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, path / "model.safetensors")
    return path


def write_dequantized(path, plain_path, weights):
    """The plain checkpoint with ``weights`` (module → [out, in]) in place of its projections."""
    tensors = load_file(plain_path / "model.safetensors")
    tensors.update({f"{m}.weight": w.contiguous() for m, w in weights.items()})
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text((plain_path / "config.json").read_text())
    save_file(tensors, path / "model.safetensors")
    return path


def assert_same_models(quantized_path, dequantized_path):
    """Every parameter as loaded, before the CPU's packing makes the projections opaque."""
    with patch.object(loader, "can_pack", lambda device, dtype: False):
        ours, reference = load(quantized_path), load(dequantized_path)
    reference_params = dict(reference.named_parameters())
    assert any("qkv_proj" in name for name in reference_params)
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param, reference_params[name], rtol=0, atol=1e-6, msg=name)


# --- compressed-tensors, made by its own library ------------------------------------------------------

CT_SCHEMES = {
    "w4a16-group-asym": ("pack-quantized", dict(num_bits=4, type="int", strategy="group", group_size=32,
                                                symmetric=False)),
    "w4a16-channel": ("pack-quantized", dict(num_bits=4, type="int", strategy="channel", symmetric=True)),
    "w3-group": ("pack-quantized", dict(num_bits=3, type="int", strategy="group", group_size=32, symmetric=True)),
    "w8a16-group": ("pack-quantized", dict(num_bits=8, type="int", strategy="group", group_size=32, symmetric=True)),
    "w8a8-int-channel": ("int-quantized", dict(num_bits=8, type="int", strategy="channel", symmetric=True)),
    "w8a16-channel": ("pack-quantized", dict(num_bits=8, type="int", strategy="channel", symmetric=True)),
    "fp8-tensor": ("float-quantized", dict(num_bits=8, type="float", strategy="tensor", symmetric=True)),
    "fp8-channel": ("float-quantized", dict(num_bits=8, type="float", strategy="channel", symmetric=True)),
    "fp8-block": ("float-quantized", dict(num_bits=8, type="float", strategy="block", block_structure=[32, 32],
                                          symmetric=True)),
}


def _observe(weight, args):
    """Min and max per the scheme's strategy, as llm-compressor's min-max observer takes them."""
    if args.strategy == "group":
        groups = weight.unflatten(-1, (-1, args.group_size))
        return groups.amin(-1), groups.amax(-1)
    if args.strategy == "channel":
        return weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    if args.strategy == "block":
        rows, columns = args.block_structure
        blocks = weight.unflatten(0, (-1, rows)).unflatten(-1, (-1, columns))
        return blocks.amin((1, 3)), blocks.amax((1, 3))
    return weight.amin(), weight.amax()


def write_compressed_tensors(tmp_path, scheme):
    """A checkpoint compressed by the compressed-tensors library in ``scheme`` (CT_SCHEMES), from a plain
    one: (its path, the plain one's, each quantized module's fake-quantized weight)."""
    plain = write_checkpoint(tmp_path / "plain", "llama", intermediate_size=96)
    model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    fmt, weight_args = CT_SCHEMES[scheme]
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(**weight_args))}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    expected = {}
    for name, module in model.named_modules():
        if hasattr(module, "weight_scale"):
            args = module.quantization_scheme.weights
            scale, zero_point = calculate_qparams(*_observe(module.weight.data, args), args)
            module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data = zero_point.to(module.weight_zero_point.dtype).reshape(
                    module.weight_zero_point.shape)
            expected[name] = fake_quantize(module.weight.data, module.weight_scale,
                                           getattr(module, "weight_zero_point", None), args)
    assert sorted(expected) == sorted(modules())
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    quantized = tmp_path / "quantized"
    model.save_pretrained(quantized)
    compressor.update_config(quantized)
    assert json.loads((quantized / "config.json").read_text())["quantization_config"]["format"] == fmt
    return quantized, plain, expected


@pytest.mark.parametrize("scheme", CT_SCHEMES)
def test_compressed_tensors_checkpoints_load_as_their_fake_quantized_weights(tmp_path, scheme):
    pytest.importorskip("compressed_tensors")
    quantized, plain, expected = write_compressed_tensors(tmp_path, scheme)
    weights = QuantizedWeights(CheckpointTensors(quantized), load_model_config(quantized).quantization)
    for name, reference in expected.items():
        torch.testing.assert_close(weights.get(f"{name}.weight"), reference, rtol=1e-6, atol=1e-7, msg=name)
    assert_same_models(quantized, write_dequantized(tmp_path / "dequantized", plain, expected))


@pytest.mark.parametrize("scheme", ["w8a8-int-channel", "w8a16-channel", "w8a16-group"])
def test_int8_rows_are_kept_as_stored_in_bfloat16_on_the_cpu(tmp_path, scheme):
    """8-bit integers with one scale per output row (llm-compressor's W8A8 and W8A16 presets) go to the
    int8 kernels as stored, fused q/k/v and gate/up included: the same weights the dequantized load
    gives, at a byte each; other layouts (a scale per group) are dequantized as before, and so is every
    layout in float32."""
    if not native_linear.can_run(torch.bfloat16):
        pytest.skip("no C++ compiler for the native CPU kernels")
    quantized, plain, expected = write_compressed_tensors(tmp_path, scheme)
    model = load(quantized, torch.bfloat16)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Int8Linear)}
    if scheme == "w8a16-group":
        assert not layers
        return
    assert len(layers) == 4 * model.config.num_layers and not isinstance(model.lm_head, Int8Linear)
    qkv = layers["model.layers.1.self_attn.qkv_proj"]
    stored = torch.cat([expected[f"model.layers.1.self_attn.{p}_proj"] for p in "qkv"])
    rebuilt = native_linear.dequantize_int8(qkv.blocked, qkv.scales, qkv.out_features, qkv.in_features)
    torch.testing.assert_close(rebuilt, stored, rtol=1e-6, atol=1e-7)
    assert not any(isinstance(m, Int8Linear) for m in load(quantized, torch.float32).modules())
    llm = LLM(EngineConfig(model=str(quantized), dtype="bfloat16", num_kv_blocks=32))
    assert len(llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4))[0].token_ids) == 4


# --- GPTQ and AWQ, packed as AutoGPTQ and AutoAWQ pack them --------------------------------------------

def _quantize_groups(weight, bits, group_size, g_idx):
    """Asymmetric min-max ints per group of input columns: (ints [out, in], zeros and scales [groups, out])."""
    num_groups = int(g_idx.max()) + 1
    maxq = (1 << bits) - 1
    scales, zeros = torch.empty(num_groups, weight.shape[0]), torch.empty(num_groups, weight.shape[0], dtype=torch.long)
    for g in range(num_groups):
        columns = weight[:, g_idx == g]
        low, high = columns.amin(1).clamp(max=0), columns.amax(1).clamp(min=0)
        scales[g] = ((high - low) / maxq).clamp(min=1e-8).half().float()
        zeros[g] = torch.round(-low / scales[g]).clamp(1, maxq).long()  # AutoGPTQ v1 cannot store a zero of 0
    ints = torch.clamp(torch.round(weight / scales[g_idx].t()) + zeros[g_idx].t(), 0, maxq).long()
    dequantized = (ints - zeros[g_idx].t()) * scales[g_idx].t()
    return ints, zeros, scales, dequantized


def _pack_words(ints, bits, order=None):
    """AutoGPTQ's and AutoAWQ's loop: int32 word k of a row holds elements k·n .. k·n+n-1 (n = 32/bits),
    element order[i] at bits i·bits (AWQ's shuffled order; identity for GPTQ)."""
    per_word = 32 // bits
    order = order or list(range(per_word))
    rows, count = ints.shape
    words = torch.zeros(rows, count // per_word, dtype=torch.int64)
    for k in range(count // per_word):
        for i in range(per_word):
            words[:, k] |= ints[:, k * per_word + order[i]] << (bits * i)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # the same 32 bits, signed


@pytest.mark.parametrize("bits,group_size,act_order,checkpoint_format", [
    (4, 32, False, "gptq"), (4, 32, True, "gptq"), (8, 64, False, "gptq"), (2, -1, False, "gptq"),
    (4, 32, False, "gptq_v2")])
def test_gptq_checkpoints(tmp_path, bits, group_size, act_order, checkpoint_format):
    plain = write_checkpoint(tmp_path / "plain", "qwen2", intermediate_size=96)
    tensors = load_file(plain / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    expected = {}
    for module in modules():
        weight = tensors.pop(f"{module}.weight")
        in_features = weight.shape[1]
        size = in_features if group_size == -1 else group_size
        g_idx = torch.arange(in_features) // size
        if act_order:  # desc_act: columns quantized in another order, their groups named by g_idx
            g_idx = g_idx[torch.randperm(in_features, generator=generator)]
        ints, zeros, scales, expected[module] = _quantize_groups(weight, bits, size, g_idx)
        stored_zeros = zeros - 1 if checkpoint_format == "gptq" else zeros
        tensors[f"{module}.qweight"] = _pack_rows(ints.t(), bits)
        tensors[f"{module}.qzeros"] = _pack_words(stored_zeros, bits)
        tensors[f"{module}.scales"] = scales.half()
        tensors[f"{module}.g_idx"] = g_idx.int()
    quantization = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order,
                    "sym": False, "checkpoint_format": checkpoint_format}
    quantized = write_quantized(tmp_path / "quantized", plain, tensors, quantization)
    assert_same_models(quantized, write_dequantized(tmp_path / "dequantized", plain, expected))


def _pack_rows(ints_in_out, bits):
    """GPTQ's qweight: [in, out] ints packed down the input rows, [in·bits/32, out]."""
    return _pack_words(ints_in_out.t().contiguous(), bits).t().contiguous()


def test_awq_checkpoint(tmp_path):
    plain = write_checkpoint(tmp_path / "plain", "mistral", intermediate_size=96)
    tensors = load_file(plain / "model.safetensors")
    expected = {}
    for module in modules():
        weight = tensors.pop(f"{module}.weight")
        g_idx = torch.arange(weight.shape[1]) // 32
        ints, zeros, scales, expected[module] = _quantize_groups(weight, 4, 32, g_idx)
        shuffle = [0, 2, 4, 6, 1, 3, 5, 7]
        tensors[f"{module}.qweight"] = _pack_words(ints.t().contiguous(), 4, shuffle)  # [in, out/8]
        tensors[f"{module}.qzeros"] = _pack_words(zeros, 4, shuffle)  # [groups, out/8]
        tensors[f"{module}.scales"] = scales.half()
    quantization = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True}
    quantized = write_quantized(tmp_path / "quantized", plain, tensors, quantization)
    assert_same_models(quantized, write_dequantized(tmp_path / "dequantized", plain, expected))


# --- FP8 ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,scale_name,scale_shape", [
    ("fp8", "weight_scale_inv", "block"),  # transformers' fine-grained FP8 (Qwen3-FP8, DeepSeek-V3 style)
    ("fp8", "weight_scale", "tensor"),  # AutoFP8's per-tensor scales
    ("fbgemm_fp8", "weight_scale", "channel")])  # Meta's Llama 3.1 405B FP8
def test_float8_checkpoints(tmp_path, method, scale_name, scale_shape):
    plain = write_checkpoint(tmp_path / "plain", "llama", intermediate_size=96)
    tensors = load_file(plain / "model.safetensors")
    expected = {}
    for module in modules():
        weight = tensors.pop(f"{module}.weight")
        if scale_shape == "block":  # [ceil(out/64), ceil(in/64)]: 96 rows or columns end in a half block
            padded = torch.nn.functional.pad(weight, (0, -weight.shape[1] % 64, 0, -weight.shape[0] % 64))
            scale = padded.unflatten(0, (-1, 64)).unflatten(-1, (-1, 64)).abs().amax((1, 3)) / 448
            full = scale.repeat_interleave(64, 0).repeat_interleave(64, 1)[:weight.shape[0], :weight.shape[1]]
        elif scale_shape == "channel":
            scale = full = weight.abs().amax(1, keepdim=True) / 448
        else:
            scale = full = weight.abs().amax() / 448
        values = (weight / full).to(torch.float8_e4m3fn)
        tensors[f"{module}.weight"] = values
        tensors[f"{module}.{scale_name}"] = scale.float().reshape(scale.shape)
        tensors[f"{module}.input_scale"] = torch.tensor(1.0)  # static activation scales are not used
        expected[module] = values.float() * full
    quantization = {"quant_method": method, "activation_scheme": "dynamic"}
    if scale_shape == "block":
        quantization["weight_block_size"] = [64, 64]
    quantized = write_quantized(tmp_path / "quantized", plain, tensors, quantization)
    assert_same_models(quantized, write_dequantized(tmp_path / "dequantized", plain, expected))


@pytest.mark.parametrize("quantization,match", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ with 3 bits"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"type": "float", "num_bits": 4}}}},
     "float, 4 bits"),
])
def test_unsupported_quantization_is_refused_when_the_config_is_read(tmp_path, quantization, match):
    path = write_checkpoint(tmp_path, "llama")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        load_model_config(path)


def test_the_quantization_flag_is_checked_against_the_checkpoint():
    """vLLM's --quantization: the checkpoint's method (or a vLLM kernel of it) passes; another, or any on an
    unquantized checkpoint, is refused with what to do."""
    from services.engine.models.quantized_weights import check_requested

    gptq = {"quant_method": "gptq", "bits": 4}
    check_requested(None, gptq, "ckpt")
    check_requested("gptq", gptq, "ckpt")
    check_requested("gptq_marlin", gptq, "ckpt")
    with pytest.raises(ValueError, match="does not match ckpt's quantization method 'gptq'"):
        check_requested("awq", gptq, "ckpt")
    with pytest.raises(ValueError, match="ckpt is not quantized, and the only quantization at load is .int8."):
        check_requested("fp8", None, "ckpt")
