"""The whole engine (scheduler + KV cache + model runner + sampler) against HF transformers.

Greedy outputs must equal HF `generate` token for token, for 16 prompts submitted together, on
Llama (GQA, llama3 rope scaling), Qwen2 (q/k/v bias, tied embeddings, one sliding-window layer) and
Mistral (sliding window shorter than most prompts) checkpoints;
and stay the same with prefix caching off, with chunked prefill at a 32-token budget, with a
pool so small that requests are preempted and recomputed, and with steps of up to 4 tokens run by
the compiled decode graphs (padded to buckets 1, 2 and 4).
"""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.engine.config import EngineConfig
from services.engine.llm import LLM
from services.engine.sampling_params import SamplingParams
from tests.engine.checkpoints import write_checkpoint

pytestmark = pytest.mark.slow  # HF parity over checkpoints and engine settings

NUM_NEW_TOKENS = 64
VOCAB = 512
ARCHS = {
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # layer 0 attends to everything, layer 1 through a 40-token window
    "qwen2": dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=40, max_window_layers=1),
    "mistral": dict(num_key_value_heads=1, sliding_window=48),
}


def make_prompts(seed: int = 0) -> list[list[int]]:
    """16 prompts of different lengths; half share a 40-token prefix so the prefix cache has work."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(40)]
    prompts = []
    for i, length in enumerate([3, 9, 17, 31, 33, 48, 64, 70, 85, 96, 110, 127, 140, 150, 160, 180]):
        prefix = shared if i % 2 and length > len(shared) else []
        prompts.append(prefix + [rng.randrange(3, VOCAB) for _ in range(length - len(prefix))])
    return prompts


@pytest.fixture(scope="module", params=sorted(ARCHS))
def checkpoint(request, tmp_path_factory):
    """(checkpoint dir, prompts, HF greedy continuations) for one architecture."""
    arch = request.param
    directory = write_checkpoint(tmp_path_factory.mktemp(arch), arch, **ARCHS[arch])
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run the full length, as ignore_eos does
    prompts = make_prompts()
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NUM_NEW_TOKENS, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
            assert len(expected[-1]) == NUM_NEW_TOKENS
    return directory, prompts, expected


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
ENGINE_SETTINGS = {
    "default": dict(),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "chunked_prefill_32": dict(max_num_batched_tokens=32),
    "preempting_pool": dict(num_kv_blocks=40, block_size=8),
}


@pytest.mark.parametrize("setting", sorted(ENGINE_SETTINGS))
def test_greedy_matches_hf_generate(checkpoint, setting):
    directory, prompts, expected = checkpoint
    llm = LLM(EngineConfig(model=str(directory), **ENGINE_SETTINGS[setting]))
    completions = llm.generate(prompts, GREEDY)
    for i, (completion, want) in enumerate(zip(completions, expected)):
        assert completion.token_ids == want, f"prompt {i} ({len(prompts[i])} tokens) diverged"
        assert completion.finish_reason == "length"
    stats = llm.core.stats()
    if setting == "preempting_pool":
        assert stats.num_preemptions > 0
    if setting == "chunked_prefill_32":
        assert stats.prefix_cache_hits > 0  # later chunks of shared-prefix prompts hit earlier ones
    assert stats.num_running == stats.num_waiting == stats.num_kv_blocks_used == 0

    again = llm.generate(prompts, GREEDY)  # the second pass is served from the prefix cache
    assert [c.token_ids for c in again] == expected
    if setting == "no_prefix_caching":
        assert all(c.num_cached_tokens == 0 for c in again)
    elif setting != "preempting_pool":  # a tiny pool evicts most of the first pass
        assert sum(c.num_cached_tokens for c in again) > sum(len(p) for p in prompts) // 2


def test_compiled_decode_graphs_match_hf_generate(checkpoint, inductor_cache_dir, monkeypatch):
    from services.engine.cpu_kernels import decode_forward

    directory, prompts, expected = checkpoint
    # without the native step, which would serve every step a graph could here (so none would be compiled)
    monkeypatch.setattr(decode_forward, "unsupported_reason", lambda *args: "off: this test runs the graphs")
    llm = LLM(EngineConfig(model=str(directory), max_num_seqs=4))
    llm.core.warmup()
    assert llm.core.model_runner.is_captured and llm.core.model_runner.graphs.buckets == (1, 2, 4)
    completions = llm.generate(prompts, GREEDY)
    for i, (completion, want) in enumerate(zip(completions, expected)):
        assert completion.token_ids == want, f"prompt {i} ({len(prompts[i])} tokens) diverged"


def test_seeded_sample_same_alone_and_in_batch_of_32(tmp_path):
    directory = write_checkpoint(tmp_path / "llama", "llama")
    llm = LLM(EngineConfig(model=str(directory)))
    prompt = make_prompts()[5]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=32, ignore_eos=True)
    alone = llm.generate([prompt], seeded)[0].token_ids

    rng = random.Random(7)
    others = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 90))] for _ in range(31)]
    other_params = [SamplingParams(temperature=1.0, seed=None if i % 2 else i, max_tokens=rng.randrange(4, 40),
                                   ignore_eos=True) for i in range(31)]
    batch = llm.generate(others[:13] + [prompt] + others[13:], other_params[:13] + [seeded] + other_params[13:])
    assert batch[13].token_ids == alone
    assert len(alone) == 32
