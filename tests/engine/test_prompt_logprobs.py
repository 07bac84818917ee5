"""Prompt logprobs (vLLM's ``prompt_logprobs``; the gateway's echo with logprobs): every prompt token
after the first gets its log-probability under the model, its rank and the top alternatives, equal to
HF transformers' log_softmax over the whole prompt, however the prompt is computed: in one step, in
chunks of any size, again after a preemption; never from the prefix cache, whose positions have no
logits, while requests beside it keep using the cache."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.common.errors import InvalidRequestError
from services.common.pb import engine_pb2
from services.engine.config import EngineConfig
from services.engine.llm import LLM
from services.engine.protocol import output_to_proto, sampling_params_from_proto
from services.engine.sampling_params import SamplingParams
from tests.engine.checkpoints import write_checkpoint

VOCAB = 512
TOP = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(checkpoint dir, prompts, HF's log_softmax over each prompt [len, vocab])."""
    directory = write_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 2, 17, 40, 100, 150)]
    prompts.append(prompts[4][:64] + [5, 6, 7])  # shares four blocks with prompt 4
    with torch.inference_mode():
        reference = [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts]
    return directory, prompts, reference


def check_against_hf(prompt: list[int], entries, reference: torch.Tensor) -> None:
    assert len(entries) == len(prompt) - 1
    for j, entry in enumerate(entries):
        want = reference[j]  # position j predicts prompt token j + 1
        assert entry.token_id == prompt[j + 1]
        assert entry.logprob == pytest.approx(want[prompt[j + 1]].item(), abs=1e-4)
        assert entry.rank == int((want > want[prompt[j + 1]]).sum()) + 1
        top_values, top_ids = want.topk(TOP)
        assert [token for token, _ in entry.top] == top_ids.tolist()
        assert [value for _, value in entry.top] == pytest.approx(top_values.tolist(), abs=1e-4)


SETTINGS = {
    "one_step": dict(),
    "chunks_of_7": dict(max_num_batched_tokens=7),  # chunks end anywhere
    # a decode and one prompt token per step: steps of single tokens, as the native decode step takes them
    "chunks_of_2": dict(max_num_batched_tokens=2),
    "preempting_pool": dict(num_kv_blocks=30, block_size=8),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_prompt_logprobs_equal_hf_log_softmax(checkpoint, setting):
    directory, prompts, reference = checkpoint
    llm = LLM(EngineConfig(model=str(directory), **SETTINGS[setting]))
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = llm.generate(prompts, greedy)  # fills the prefix cache with every prompt
    preemptions_before = llm.core.stats().num_preemptions
    gathering = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=TOP)
    completions = llm.generate(prompts, gathering)
    for prompt, completion, want, before in zip(prompts, completions, reference, plain, strict=True):
        check_against_hf(prompt, completion.prompt_logprobs, want)
        assert completion.num_cached_tokens == 0  # computed, not served from the cache
        assert completion.token_ids == before.token_ids
    stats = llm.core.stats()
    if setting == "preempting_pool":
        assert stats.num_preemptions > preemptions_before
    assert stats.num_running == stats.num_waiting == stats.num_kv_blocks_used == 0


def test_requests_beside_keep_the_prefix_cache_and_their_tokens(checkpoint):
    directory, prompts, reference = checkpoint
    llm = LLM(EngineConfig(model=str(directory)))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate(prompts, greedy)
    mixed = [greedy if i % 2 else SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
             for i in range(len(prompts))]
    completions = llm.generate(prompts, mixed)
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        assert completion.token_ids == first[i].token_ids
        if i % 2:
            assert completion.prompt_logprobs is None
            assert completion.num_cached_tokens == (len(prompt) - 1) // 16 * 16  # every full block but the last token's
        else:
            assert [e.token_id for e in completion.prompt_logprobs] == prompt[1:]
            assert all(e.top == [] for e in completion.prompt_logprobs)  # 0: the prompt token alone
            assert completion.num_cached_tokens == 0


def test_too_many_alternatives_is_refused_naming_the_field(checkpoint):
    directory, prompts, _ = checkpoint
    llm = LLM(EngineConfig(model=str(directory), max_logprobs=5))
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, prompt_logprobs=6))
    assert refused.value.param == "prompt_logprobs"
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(prompt_logprobs=-1)
    assert refused.value.param == "prompt_logprobs"


def test_prompt_logprobs_cross_the_wire_with_the_first_token():
    request = engine_pb2.GenerateRequest(prompt_token_ids=[1, 2], sampling=engine_pb2.SamplingParams(prompt_logprobs=2),
                                         stop=engine_pb2.StopCriteria(max_tokens=3))
    assert sampling_params_from_proto(request).prompt_logprobs == 2
    assert sampling_params_from_proto(engine_pb2.GenerateRequest(stop=engine_pb2.StopCriteria(max_tokens=3))
                                      ).prompt_logprobs is None


def test_the_first_output_carries_them_once(checkpoint):
    directory, prompts, reference = checkpoint
    llm = LLM(EngineConfig(model=str(directory)))
    llm.core.add_request("r", prompts[3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                          prompt_logprobs=1))
    outputs = []
    while llm.core.has_unfinished_requests():
        outputs += llm.core.step()
    assert [len(o.new_token_ids) for o in outputs] == [1, 1, 1]
    assert len(outputs[0].prompt_logprobs) == len(prompts[3]) - 1
    assert outputs[1].prompt_logprobs is None and outputs[2].prompt_logprobs is None
    wire = output_to_proto(outputs[0], "replica")
    assert [e.sampled.token_id for e in wire.prompt_logprobs] == prompts[3][1:]
    assert wire.prompt_logprobs[0].sampled.logprob == pytest.approx(reference[3][0, prompts[3][1]].item(), abs=1e-4)
    assert len(output_to_proto(outputs[1], "replica").prompt_logprobs) == 0
