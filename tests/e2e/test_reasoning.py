"""--reasoning-parser deepseek_r1 through the real stack and the `openai` client, on the built-in model
with <think> and </think> added to its vocabulary (as DeepSeek-R1's distills have them): its output
is all thinking until it writes </think>; a JSON schema binds the answer after </think> only."""

import json
import shutil

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer

from services.launcher import StackConfig, find_free_port
from tests.e2e.conftest import serving

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def thinking_model(default_model_dir, tmp_path_factory):
    """The built-in model with two more tokens, <think> and </think> (not special: they decode as text)."""
    path = tmp_path_factory.mktemp("thinking-model")
    for file in default_model_dir.iterdir():
        shutil.copy(file, path / file.name)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken("<think>", normalized=False), AddedToken("</think>", normalized=False)])
    tokenizer.save(str(path / "tokenizer.json"))
    config = json.loads((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = torch.cat([tensors[name], torch.randn(2, tensors[name].shape[1]).to(tensors[name].dtype) * 0.02])
    config["vocab_size"] += 2
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return path, tokenizer.token_to_id("</think>")


@pytest.fixture(scope="module")
def thinking(thinking_model, tmp_path_factory):
    path, end_id = thinking_model
    config = StackConfig(model=str(path), port=find_free_port(), served_model_name="thinker",
                         engine_args=["--max-num-seqs", "4", "--num-kv-blocks", "128", "--enforce-eager"],
                         gateway_args=["--reasoning-parser", "deepseek_r1", "--log-level", "warning"],
                         log_dir=tmp_path_factory.mktemp("thinking-logs"), echo_logs=False, startup_timeout_s=120)
    for stack in serving(config):
        with openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            yield client, end_id


def test_without_an_end_tag_everything_is_thinking(thinking):
    client, end_id = thinking
    request = dict(model="thinker", messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=0,
                   logit_bias={str(end_id): -100})
    response = client.chat.completions.create(**request)
    message = response.choices[0].message
    assert message.content is None and message.reasoning_content and message.reasoning == message.reasoning_content
    assert response.usage.completion_tokens_details.reasoning_tokens == response.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(**request, stream=True))
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert streamed == message.reasoning_content
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    hidden = client.chat.completions.create(**request, extra_body={"include_reasoning": False}).choices[0].message
    assert hidden.content is None and getattr(hidden, "reasoning_content", None) is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_binds_the_answer_after_the_end_tag(thinking, stream):
    """logit_bias makes </think> the first token; from the next one the schema holds (it masks </think> out)."""
    client, end_id = thinking
    response = client.chat.completions.create(
        model="thinker", messages=[{"role": "user", "content": "Ok?"}], max_tokens=30, temperature=0,
        logit_bias={str(end_id): 100}, stream=stream,
        response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": SCHEMA}})
    if stream:
        deltas = [c.choices[0].delta for c in response if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
    else:
        message = response.choices[0].message
        reasoning, content = message.reasoning_content, message.content
        assert response.usage.completion_tokens_details.reasoning_tokens == 0  # </think> came first
    assert reasoning == "" or reasoning is None
    assert isinstance(json.loads(content)["ok"], bool)
