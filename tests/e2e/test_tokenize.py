"""vLLM's /tokenize and /detokenize through the stack: a prompt counts as many tokens as a completion
of it reports, a chat as many as the chat completion reports, and bad input gets a 400."""

import httpx
import pytest

from services.common.pb import tokenizer_pb2
from tests.e2e.conftest import MODEL, decode

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def test_a_prompts_tokens_are_those_a_completion_counts(http, client):
    prompt = "The lighthouse keeper said"
    tokenized = http.post("/tokenize", json={"model": MODEL, "prompt": prompt})
    assert tokenized.status_code == 200
    body = tokenized.json()
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert body["count"] == len(body["tokens"]) == completion.usage.prompt_tokens
    assert body["max_model_len"] == 2048 and body["token_strs"] is None
    plain = http.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False}).json()
    assert plain["tokens"] == body["tokens"][-plain["count"]:]  # without the BOS, if the tokenizer adds one
    assert http.post("/detokenize", json={"model": MODEL, "tokens": plain["tokens"]}).json() == {"prompt": prompt}


def test_a_chats_tokens_are_those_a_chat_completion_counts(http, client):
    body = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert body["count"] == chat.usage.prompt_tokens
    without_turn = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert without_turn["count"] < body["count"]
    assert body["tokens"][:without_turn["count"]] == without_turn["tokens"]


def test_a_continued_final_message_is_left_open(http, client, tokenizer):
    """vLLM's continue_final_message: the assistant turn the client began is continued, not closed."""
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</turn>{% endfor %}"
    begun = [*MESSAGES, {"role": "assistant", "content": "The colour is"}]
    fields = {"messages": begun, "chat_template": template, "add_generation_prompt": False}
    body = http.post("/tokenize", json={**fields, "continue_final_message": True}).json()
    expected = "<system>Be brief.</turn><user>Name a colour.</turn><assistant>The colour is"
    assert decode(tokenizer, body["tokens"]) == expected
    chat = client.chat.completions.create(model=MODEL, messages=begun, max_tokens=1, extra_body={
        "chat_template": template, "add_generation_prompt": False, "continue_final_message": True})
    assert chat.usage.prompt_tokens == body["count"]
    for stream in (False, True):  # vLLM's chat echo: the answer starts with the message it continues
        echoed = client.chat.completions.create(
            model=MODEL, messages=begun, max_tokens=3, stream=stream, temperature=0, extra_body={
                "chat_template": template, "add_generation_prompt": False, "continue_final_message": True,
                "echo": True, "ignore_eos": True})
        content = "".join(c.choices[0].delta.content or "" for c in echoed if c.choices) if stream \
            else echoed.choices[0].message.content
        assert content.startswith("The colour is") and content != "The colour is"
    closed = http.post("/tokenize", json=fields).json()
    assert decode(tokenizer, closed["tokens"]) == expected + "</turn>"


def test_token_strs_are_the_vocabularys_strings(http, tokenizer):
    body = http.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False,
                                        "return_token_strs": True}).json()
    assert len(body["token_strs"]) == body["count"] and all(isinstance(s, str) and s for s in body["token_strs"])
    strings = tokenizer.TokenStrings(tokenizer_pb2.TokenStringsRequest(token_ids=body["tokens"]), timeout=5).tokens
    assert list(strings) == body["token_strs"]
    assert "".join(body["token_strs"]) != "hello world"  # byte-level BPE: "Ġworld", not decoded text


@pytest.mark.parametrize("path, payload, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools.[0]"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, "model"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "continue_final_message": True},
     "continue_final_message"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [1 << 40]}, "tokens"),
    ("/detokenize", {"tokens": [999_999]}, None),  # past the vocabulary: the tokenizer's refusal
])
def test_bad_input_is_a_clear_client_error(http, path, payload, param):
    response = http.post(path, json=payload)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["message"]
    if param is not None:
        assert error["param"] == param


def test_they_need_the_api_key_and_version_does_not(stack):
    assert httpx.post(stack.base_url + "/tokenize", json={"prompt": "a"}).status_code == 401
    version = httpx.get(stack.base_url + "/version")
    assert version.status_code == 200 and version.json()["version"]
