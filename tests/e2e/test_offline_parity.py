"""Greedy text served through the whole stack equals the engine's offline output (the in-process
``services.engine.llm.LLM`` on the same checkpoint), decoded by the tokenizer."""

import pytest

from tests.e2e.conftest import MODEL, decode, encode

PROMPTS = ["The quick brown fox", "東京の天気は 😀", "1, 2, 3,"]
MAX_TOKENS = 12


def test_served_greedy_text_equals_offline_generation(client, tokenizer, default_model_dir):
    pytest.importorskip("torch")
    from services.engine.config import EngineConfig
    from services.engine.llm import LLM
    from services.engine.sampling_params import SamplingParams

    prompt_ids = [encode(tokenizer, prompt) for prompt in PROMPTS]
    llm = LLM(EngineConfig(model=str(default_model_dir), num_kv_blocks=64, max_num_seqs=4))
    offline = llm.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for ids, completion in zip(prompt_ids, offline):
        served = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=MAX_TOKENS,
                                           extra_body={"ignore_eos": True})
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model=MODEL, prompt=ids, temperature=0, max_tokens=MAX_TOKENS, stream=True,
            extra_body={"ignore_eos": True}))
        expected = decode(tokenizer, completion.token_ids)
        assert served.choices[0].text == streamed == expected
        assert served.usage.completion_tokens == len(completion.token_ids) == MAX_TOKENS
