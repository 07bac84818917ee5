"""The engine with the Triton attention backend (kernels in Triton's interpreter on the CPU) gives
HF transformers' greedy tokens, as the torch backend does: decodes through the paged-decode kernel,
prefill chunks through the paged-prefill kernel, KV writes through the store kernel, RMSNorm,
SiLU-and-mul and rotary through theirs; with GQA, a sliding window, chunked prefill and prefixes
served from the cache."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.engine.attention import get_attention_backend
from services.engine.config import EngineConfig
from services.engine.llm import LLM
from services.engine.sampling_params import SamplingParams
from tests.engine.checkpoints import write_checkpoint

pytestmark = pytest.mark.slow  # HF parity through the Triton kernels

pytest.importorskip("triton")
NEW_TOKENS = 12
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on the CPU the kernels run interpreted


def hf_greedy(path, prompts, new_tokens: int | list[int] = NEW_TOKENS):
    """HF's greedy tokens of each prompt, on the CPU in float32; ``new_tokens``: one count or one per prompt."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    counts = new_tokens if isinstance(new_tokens, list) else [new_tokens] * len(prompts)
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               do_sample=False, max_new_tokens=n, min_new_tokens=n,
                               pad_token_id=0)[0, len(p):].tolist() for p, n in zip(prompts, counts, strict=True)]


@pytest.mark.parametrize("arch, overrides, block_size, chunk", [
    ("llama", {}, 16, 2048),
    ("mistral", {"num_key_value_heads": 1, "sliding_window": 20}, 16, 24),  # chunked prefill over the cache
    ("llama", {}, 8, 2048),  # blocks too small for the prefill kernel: SDPA prefill, kernel decode
])
def test_greedy_matches_hf_with_the_triton_backend(tmp_path, arch, overrides, block_size, chunk):
    path = write_checkpoint(tmp_path, arch, **overrides)
    shared = list(range(40, 72))  # two full blocks: the second pass serves them from the prefix cache
    prompts = [shared + [5, 6, 7], list(range(100, 109)), [3, 4], shared + [9]]
    llm = LLM(EngineConfig(model=str(path), attention_backend="triton", block_size=block_size,
                           num_kv_blocks=128, max_num_batched_tokens=chunk, device=DEVICE))
    assert type(llm.core.model_runner.attention).__name__ == "TritonAttentionBackend"
    layer = llm.core.model_runner.model.model.layers[0]
    assert layer.mlp.use_kernel and layer.input_layernorm.use_kernel
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    expected = hf_greedy(path, prompts)
    assert [c.token_ids for c in llm.generate(prompts, params)] == expected
    assert [c.token_ids for c in llm.generate(prompts, params)] == expected  # prefixes from the cache


def test_backend_choice():
    args = (4, 2, 16, torch.float32)
    assert type(get_attention_backend("auto", *args)).__name__ == "TorchAttentionBackend"  # the CPU
    assert type(get_attention_backend("auto", *args, device=torch.device("cuda"))).__name__ == "TritonAttentionBackend"
    if os.environ.get("TRITON_INTERPRET") == "1":  # no GPU here (tests/conftest.py): the CPU interprets the kernels
        assert type(get_attention_backend("triton", *args)).__name__ == "TritonAttentionBackend"
    else:  # compiled kernels: a GPU's alone
        with pytest.raises(ValueError, match="runs on CUDA"):
            get_attention_backend("triton", *args)
    with pytest.raises(ValueError, match="power-of-two"):
        get_attention_backend("triton", *args, block_size=12)
    with pytest.raises(ValueError, match="not one of"):
        get_attention_backend("flash", *args)
