"""``--quantization int8``: an unquantized checkpoint's projections, the logits head's included, rounded to
int8 as they load, served in bfloat16 by the native kernels; the engine's greedy tokens are HF's on the
same rounded weights (float32), up to bfloat16's noise; the flag's misuses are refused with reasons."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.engine.config import EngineConfig
from services.engine.cpu_kernels import linear as native_linear
from services.engine.llm import LLM
from services.engine.model_runner import ModelRunner
from services.engine.models import int8_linear
from services.engine.models.int8_linear import Int8Linear
from services.engine.models.quantized_weights import check_requested
from services.engine.sampling_params import SamplingParams

from .checkpoints import write_checkpoint

pytestmark = pytest.mark.skipif(not native_linear.can_run(torch.bfloat16),
                                reason="no C++ compiler for the native CPU kernels")

ARCHS = {
    "llama": dict(attention_bias=True, mlp_bias=True),
    "qwen2": dict(tie_word_embeddings=True),
    "mistral": dict(num_key_value_heads=1, sliding_window=24, head_dim=32),
}
NEW_TOKENS = 16
# How far below HF's best logit the engine's choice may be: its activations are bfloat16, HF's float32
# (the tiny checkpoints' logits are of magnitude ~4, a bfloat16 step there is 1/32; ties differ by ~0.015).
MARGIN = 0.05


@pytest.fixture(scope="module", params=sorted(ARCHS))
def checkpoint(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, **ARCHS[request.param])


def config(path, **overrides) -> EngineConfig:
    return EngineConfig(model=str(path), num_kv_blocks=128, enforce_eager=True, **overrides)


def hf_on_rounded_weights(path) -> torch.nn.Module:
    """HF's float32 model with every projection and the head replaced by what the engine multiplies by:
    the checkpoint's weights as bfloat16 (as they load), rounded to int8 per output row."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for module in list(model.modules()):
            if isinstance(module, torch.nn.Linear):
                n, k = module.weight.shape
                blocked, scales = native_linear.quantize_int8(module.weight.bfloat16())
                module.weight = torch.nn.Parameter(native_linear.dequantize_int8(blocked, scales, n, k),
                                                   requires_grad=False)  # (unties a tied head)
    return model


def test_every_projection_and_the_head_are_int8_and_the_native_step_serves(checkpoint):
    runner = ModelRunner(config(checkpoint, quantization="int8"))  # --dtype auto: bfloat16, as int8 needs
    assert runner.dtype == torch.bfloat16
    model = runner.model
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 4 * model.config.num_layers + 1 and model.lm_head in layers
    assert all(layer.blocked.dtype == torch.int8 for layer in layers)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16  # the embeddings stay as they were
    assert runner.decode_step is not None


@pytest.mark.slow  # HF parity over three architectures
def test_greedy_tokens_are_hfs_on_the_rounded_weights(checkpoint):
    llm = LLM(config(checkpoint, quantization="int8", dtype="bfloat16"))
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(length)] for i, length in enumerate((3, 20, 45, 90))]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    reference = hf_on_rounded_weights(checkpoint)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert len(output.token_ids) == NEW_TOKENS
        with torch.inference_mode():  # HF's logits at every position the engine chose a token for
            logits = reference(torch.tensor([prompt + output.token_ids])).logits[0, len(prompt) - 1:-1]
        chosen = logits.gather(1, torch.tensor(output.token_ids)[:, None])[:, 0]
        assert (chosen >= logits.max(1).values - MARGIN).all(), (chosen - logits.max(1).values).min()
        agree = (logits.argmax(1) == torch.tensor(output.token_ids)).float().mean()
        assert agree >= 0.75  # ties aside, the same tokens


def test_the_flag_is_refused_where_it_cannot_serve(checkpoint):
    with pytest.raises(ValueError, match="serve the model in bfloat16"):
        ModelRunner(config(checkpoint, quantization="int8", dtype="float32"))
    with pytest.raises(ValueError, match="quantized already .gptq."):
        check_requested("int8", {"quant_method": "gptq", "bits": 4}, "ckpt")
    check_requested("int8", None, "ckpt")
    assert "not on cuda" in int8_linear.unsupported_reason(torch.device("cuda"), torch.bfloat16)
    assert int8_linear.unsupported_reason(torch.device("cpu"), torch.bfloat16) is None


def test_half_the_bytes_of_bfloat16(checkpoint):
    quantized = ModelRunner(config(checkpoint, quantization="int8")).model
    plain = ModelRunner(config(checkpoint, dtype="bfloat16")).model
    int8_bytes = sum(m.blocked.nbytes + m.scales.nbytes for m in quantized.modules() if isinstance(m, Int8Linear))
    bf16_bytes = sum(m.blocked.nbytes for m in plain.modules() if getattr(m, "blocked", None) is not None)
    assert int8_bytes < 0.6 * bf16_bytes
