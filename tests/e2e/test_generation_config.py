"""A checkpoint's generation_config.json recommends how to sample it; through the whole stack, a request
that leaves temperature or max_tokens unset gets the recommendation, and whatever a client sends wins.

The stack serves a copy of the default model whose generation_config.json recommends greedy decoding
(temperature 0) and at most 5 new tokens. The default model has random weights: sampled at
temperature 1, two runs of 12 tokens practically never agree, so agreement shows greedy decoding.
"""

import json
import shutil

import openai
import pytest

from services.launcher import StackConfig, find_free_port
from tests.e2e.conftest import serving

MODEL = "strata-recommended"
PROMPT = "The lighthouse keeper said"


@pytest.fixture(scope="module")
def client(default_model_dir, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("recommended")
    for path in default_model_dir.iterdir():
        if path.is_file():
            shutil.copy(path, model_dir / path.name)
    config = json.loads((model_dir / "generation_config.json").read_text())
    config |= {"do_sample": False, "temperature": 0.0, "max_new_tokens": 5}
    (model_dir / "generation_config.json").write_text(json.dumps(config))
    stack_config = StackConfig(
        model=str(model_dir), port=find_free_port(), served_model_name=MODEL,
        engine_args=["--max-num-seqs", "4", "--num-kv-blocks", "128", "--enforce-eager"],
        gateway_args=["--log-level", "warning"],
        log_dir=tmp_path_factory.mktemp("recommended-logs"), echo_logs=False, startup_timeout_s=120, grace_s=5)
    for stack in serving(stack_config):
        engine_log = (stack_config.log_dir / "engine.log").read_text()
        assert "temperature=0.0, max_tokens=5" in engine_log  # said once at start, as vLLM warns
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{stack_config.port}/v1", api_key="unused")


def complete(client, **kwargs):
    return client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"ignore_eos": True}, **kwargs)


def test_a_request_that_sets_nothing_decodes_greedily_for_the_recommended_length(client):
    first, second = complete(client), complete(client)
    assert first.usage.completion_tokens == 5 and first.choices[0].finish_reason == "length"
    assert first.choices[0].text == second.choices[0].text
    assert first.choices[0].text == complete(client, temperature=0, max_tokens=5).choices[0].text


def test_what_the_client_sends_wins(client):
    assert complete(client, max_tokens=12, temperature=0).usage.completion_tokens == 12
    sampled = {complete(client, max_tokens=12, temperature=1.0, seed=seed).choices[0].text for seed in (1, 2, 3)}
    assert len(sampled) > 1


def test_n_above_one_is_refused_as_greedy_unless_the_request_samples(client):
    with pytest.raises(openai.BadRequestError, match="n must be 1 when using greedy sampling"):
        complete(client, n=2)
    assert len(complete(client, n=2, temperature=1.0).choices) == 2


def test_a_chat_request_gets_the_recommendation_too(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
