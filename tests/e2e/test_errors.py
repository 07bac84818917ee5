"""Every error case against the real stack: its HTTP status, the `openai` exception class, the
OpenAI error body, no retryable status for a request that can never succeed, and the server still
serving afterwards."""

import openai
import pytest

from tests.e2e.conftest import MAX_BODY_BYTES, MAX_N, MODEL

CHAT = [{"role": "user", "content": "hi"}]
LONG_PROMPT = [5] * 2100  # over the default model's 2048-token context


def chat(client, **kwargs):
    return client.chat.completions.create(model=kwargs.pop("model", MODEL),
                                          messages=kwargs.pop("messages", CHAT), max_tokens=2, **kwargs)


def completion(client, **kwargs):
    kwargs.setdefault("max_tokens", 2)
    return client.completions.create(model=kwargs.pop("model", MODEL), prompt=kwargs.pop("prompt", "hi"),
                                     **kwargs)


CASES = {
    "prompt over the context": (completion, {"prompt": LONG_PROMPT}, "input_tokens",
                                "This model's maximum context length is 2048 tokens. "
                                "However, your request has 2100 input tokens."),
    "max_tokens over the context": (completion, {"prompt": [5] * 100, "max_tokens": 2000}, "max_tokens",
                                    "'max_tokens' is too large: 2000."),
    "negative temperature": (chat, {"temperature": -1}, "temperature", None),
    "top_p over 1": (chat, {"top_p": 1.5}, "top_p", None),
    "bad top_k": (chat, {"extra_body": {"top_k": -7}}, "top_k", None),
    # The engine's rules (SamplingParams, EngineCore.validate), named back as the client named the field:
    "min_p over 1": (chat, {"extra_body": {"min_p": 2}}, "min_p", "min_p must be in [0, 1], got 2.0."),
    "repetition_penalty zero": (chat, {"extra_body": {"repetition_penalty": 0}}, "repetition_penalty", None),
    "logit_bias over 100": (chat, {"logit_bias": {"3": 101}}, "logit_bias",
                            "logit_bias values must be in [-100, 100]"),
    "logit_bias past the vocabulary": (chat, {"logit_bias": {"999999": 1}}, "logit_bias",
                                       "logit_bias token id 999999 is out of vocabulary"),
    "stop_token_ids past the vocabulary": (chat, {"extra_body": {"stop_token_ids": [999999]}}, "stop_token_ids",
                                           None),
    "max_completion_tokens zero": (chat, {"extra_body": {"max_completion_tokens": 0}}, "max_completion_tokens",
                                   None),
    "min_tokens over max_tokens": (chat, {"extra_body": {"min_tokens": 5}}, "min_tokens", None),
    "bad JSON schema": (chat, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}}, "response_format",
                        "invalid JSON schema"),
    "tool call without its function": (chat, {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function"}]}, {"role": "user", "content": "hi"}]},
                                       "messages.0.tool_calls.0.function", None),
    "bad guided regex": (completion, {"extra_body": {"guided_regex": "a(b"}}, "guided_regex", "invalid regex"),
    "n zero": (chat, {"n": 0}, "n", None),
    "n over the cap": (chat, {"n": MAX_N + 1}, "n", None),
    "greedy with n > 1": (chat, {"n": 2, "temperature": 0}, "n", "n must be 1 when using greedy sampling"),
    "logprobs over 20": (completion, {"logprobs": 21}, "logprobs", None),
    "top_logprobs over 20": (chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    "top_logprobs without logprobs": (chat, {"top_logprobs": 2}, "top_logprobs", None),
    "empty messages": (chat, {"messages": []}, "messages", None),
    "stream_options without stream": (chat, {"stream_options": {"include_usage": True}}, "stream_options", None),
    "too many stop strings": (chat, {"stop": ["a", "b", "c", "d", "e"]}, "stop", None),
    "token id out of vocabulary": (completion, {"prompt": [1, 2, 999999]}, "prompt", None),
    "wrong type": (chat, {"extra_body": {"max_tokens": "many"}}, "max_tokens", None),
    "two structured output constraints": (chat, {"response_format": {"type": "json_object"},
                                                  "extra_body": {"guided_regex": "a+"}},
                                          "response_format, guided_regex", None),
    "tool_choice without tools": (chat, {"tool_choice": "auto"}, "tool_choice",
                                  "When using `tool_choice`, `tools` must be set."),
    "forced call of a tool not given": (chat, {"tools": [{"type": "function", "function": {"name": "f"}}],
                                               "tool_choice": {"type": "function", "function": {"name": "g"}}},
                                        "tool_choice", "Tool 'g' has not been passed in `tools`"),
}


def assert_still_serving(client):
    assert completion(client).choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("name", list(CASES))
def test_client_mistakes_are_400(client, name):
    call, kwargs, param, message = CASES[name]
    with pytest.raises(openai.BadRequestError) as info:
        call(client, **kwargs)
    error = info.value.body
    assert info.value.status_code == 400
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["param"] == param, error
    if message:
        assert error["message"].startswith(message), error["message"]


def test_streaming_requests_are_refused_before_the_stream(client):
    with pytest.raises(openai.BadRequestError):
        completion(client, prompt=LONG_PROMPT, stream=True)
    assert_still_serving(client)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        chat(client, model="gpt-4o")
    assert info.value.body["message"] == "The model `gpt-4o` does not exist."
    assert info.value.body["param"] == "model"
    assert_still_serving(client)


def test_wrong_api_key_is_401(stack, client):
    with openai.OpenAI(base_url=stack.base_url + "/v1", api_key="wrong-key", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            chat(bad)
    assert_still_serving(client)


def test_missing_api_key_is_401(stack, http):
    import httpx
    response = httpx.post(stack.base_url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert http.get("/v1/models").status_code == 200


def test_malformed_json_is_400(http, client):
    response = http.post("/v1/chat/completions", content=b'{"model": "x", "messages": [',
                         headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "error" in response.json()
    assert_still_serving(client)


def test_body_over_the_limit_is_413(http, client):
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * (MAX_BODY_BYTES + 1)})
    assert response.status_code == 413
    assert response.json()["error"]["message"].startswith("Request body is larger")
    assert_still_serving(client)


def test_no_error_is_retryable(http):
    """The statuses the openai client retries (408, 409, 429, 5xx) never answer a bad request."""
    bad_bodies = [{"model": MODEL, "prompt": [5] * 2100}, {"model": MODEL, "prompt": "x", "n": 99},
                  {"model": MODEL, "prompt": "x", "temperature": "hot"}, {"prompt": None}]
    for body in bad_bodies:
        status = http.post("/v1/completions", json=body).status_code
        assert status == 400, (body, status)
