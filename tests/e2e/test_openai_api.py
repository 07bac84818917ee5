"""The OpenAI API through the real `openai` client against the real stack: streamed and
non-streamed answers agree, n choices, usage, logprobs, echo, headers, health and metrics."""

import json
from collections import defaultdict

import httpx
import openai
import pytest

from tests.e2e.conftest import MODEL, engine_load

CHAT = [{"role": "user", "content": "Tell me about the sea."}]


def stream_chat(client, **kwargs):
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **kwargs))
    texts, finishes, roles = defaultdict(str), defaultdict(list), defaultdict(list)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles[choice.index].append(choice.delta.role)
            if choice.finish_reason is not None:
                finishes[choice.index].append(choice.finish_reason)
    return chunks, texts, finishes, roles


def streamed_logprobs(chunks, *fields: str) -> dict[str, list]:
    """A streamed completion's logprobs, each field's entries joined in the order they came."""
    joined = {field: [] for field in fields}
    for chunk in chunks:
        for part in chunk.choices:
            for field in fields:
                joined[field] += getattr(part.logprobs, field) if part.logprobs else []
    return joined


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("other/model")
    assert missing.value.body["message"] == "The model `other/model` does not exist."


def test_greedy_chat_streamed_equals_non_streamed(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=12)
    chunks, texts, finishes, roles = stream_chat(client, temperature=0, max_tokens=12)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert texts[0] == choice.message.content
    assert finishes[0] == [choice.finish_reason] == ["length"]
    assert roles[0] == ["assistant"] and chunks[0].choices[0].delta.role == "assistant"
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    assert full.usage.prompt_tokens_details.cached_tokens >= 0


def test_greedy_completion_streamed_equals_non_streamed(client):
    full = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=10)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=10, stream=True))
    assert streamed == full.choices[0].text and streamed


def test_n_choices_streamed_and_not(client):
    kwargs = dict(n=3, temperature=1.0, seed=7, max_tokens=6, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(model=MODEL, messages=CHAT, **kwargs)
    assert sorted(c.index for c in full.choices) == [0, 1, 2]
    assert full.usage.completion_tokens == 3 * 6
    _, texts, finishes, roles = stream_chat(client, **kwargs)
    assert sorted(finishes) == [0, 1, 2]
    assert all(len(f) == 1 for f in finishes.values()), "exactly one finish_reason per choice"
    assert all(r == ["assistant"] for r in roles.values())
    # Seeded: choice i samples with seed + i, so the streamed and full answers agree choice by choice.
    assert {c.index: c.message.content for c in full.choices} == dict(texts)


def test_completions_number_choices_prompt_major(client):
    full = client.completions.create(model=MODEL, prompt=["a b", "c d"], n=2, seed=1, max_tokens=3)
    assert sorted(c.index for c in full.choices) == [0, 1, 2, 3]
    streamed = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], n=2, seed=1,
                                         max_tokens=3, stream=True)
    finishes = defaultdict(int)
    for chunk in streamed:
        for choice in chunk.choices:
            finishes[choice.index] += choice.finish_reason is not None
    assert dict(finishes) == {0: 1, 1: 1, 2: 1, 3: 1}


def test_include_usage_adds_a_final_chunk_without_choices(client):
    chunks, texts, _, _ = stream_chat(client, max_tokens=5, stream_options={"include_usage": True})
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert last.usage.total_tokens == last.usage.prompt_tokens + 5
    assert all(c.usage is None for c in body)


def test_continuous_usage_stats_puts_usage_in_every_chunk(client):
    chunks, _, _, _ = stream_chat(client, max_tokens=4,
                                  stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 4
    # with n choices, a choice's chunk counts that choice's tokens (vLLM's previous_num_tokens[i]); the
    # final chunk, all of them
    chunks, _, _, _ = stream_chat(client, max_tokens=4, n=2, temperature=1.0, seed=3,
                                  stream_options={"include_usage": True, "continuous_usage_stats": True})
    for index in (0, 1):
        counts = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].index == index]
        assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 4
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}


def test_chat_logprobs_shape(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, logprobs=True,
                                          top_logprobs=3, temperature=0)
    content = full.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert isinstance(entry.token, str) and entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        # Greedy: the sampled token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
    assert "".join(e.token for e in content) == full.choices[0].message.content
    streamed = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, logprobs=True,
                                              top_logprobs=3, temperature=0, stream=True)
    streamed_tokens = [e.token for c in streamed for ch in c.choices if ch.logprobs
                       for e in ch.logprobs.content]
    assert streamed_tokens == [e.token for e in content]


def test_completion_logprobs_shape(client):
    full = client.completions.create(model=MODEL, prompt="The sea", max_tokens=5, logprobs=2, temperature=0)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token in top and 2 <= len(top) <= 3 and logprob <= 0


def test_return_tokens_as_token_ids_names_each_logprob_token_by_its_id(client, http):
    """vLLM's extra: "token_id:<id>" in place of each token's text (in the alternatives too), so a token whose
    text is half a UTF-8 character is still named; the ids are the ones the text is made of."""
    kwargs = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"return_tokens_as_token_ids": True,
                                                                         "ignore_eos": True})
    lp = client.completions.create(prompt="The sea", logprobs=2, **kwargs).choices[0].logprobs
    ids = [int(token.removeprefix("token_id:")) for token in lp.tokens]
    assert all(token == f"token_id:{i}" for token, i in zip(lp.tokens, ids))
    assert all(key.startswith("token_id:") and token in top for token, top in zip(lp.tokens, lp.top_logprobs)
               for key in top)
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    text = client.completions.create(prompt="The sea", **kwargs).choices[0].text
    assert http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"] == text
    chat = client.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=2, **kwargs)
    for entry in chat.choices[0].logprobs.content:
        assert entry.token.startswith("token_id:") and entry.bytes == list(entry.token.encode())
        assert all(top.token.startswith("token_id:") for top in entry.top_logprobs)


def test_echo_puts_the_prompt_first(client):
    prompt = "Echo 😀 漢字"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, temperature=0)
    assert full.choices[0].text.startswith(prompt) and len(full.choices[0].text) > len(prompt)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, echo=True, temperature=0, stream=True))
    assert streamed == full.choices[0].text


def test_echo_logprobs_text_offsets_run_on_past_the_prompt(client):
    """Each text_offset is the one before plus its token's length, the output's after the echoed prompt's as in
    vLLM, also where the prompt's token strings are longer than its text: a character split across tokens
    shows as replacement characters in each. The output's offsets started at the prompt text's length and
    went back over the prompt's last tokens."""
    prompt = "Echo 😀 漢字"
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=0, temperature=0,
                  extra_body={"ignore_eos": True})
    lp = client.completions.create(**kwargs).choices[0].logprobs
    assert len("".join(lp.tokens[:-3])) > len(prompt)  # the case: a token string holds a split character
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = streamed_logprobs(client.completions.create(stream=True, **kwargs), "tokens", "text_offset")
    assert streamed == {"tokens": lp.tokens, "text_offset": lp.text_offset}


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client):
    """OpenAI's legacy scoring request (echo, max_tokens 0, logprobs), which vLLM serves: the prompt alone as the
    text, its tokens' logprobs alone, streamed or not. It was refused (max_tokens must be at least 1)."""
    prompt = "The sea is deep and wide"
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    full = client.completions.create(**kwargs)
    choice, num_prompt = full.choices[0], full.usage.prompt_tokens
    assert choice.text == prompt
    lp = choice.logprobs
    assert "".join(lp.tokens) == prompt and len(lp.tokens) == len(lp.text_offset) == num_prompt
    assert lp.token_logprobs[0] is None and all(x < 0 for x in lp.token_logprobs[1:])
    text, tokens = "", []
    for chunk in client.completions.create(stream=True, **kwargs):
        for part in chunk.choices:
            text += part.text
            tokens += part.logprobs.tokens if part.logprobs else []
    assert text == prompt and tokens == lp.tokens
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True)
    assert plain.choices[0].text == prompt and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError):  # without echo there is nothing to answer, as in vLLM
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)


def test_echo_with_logprobs_scores_the_prompt(client, http):
    """lm-evaluation-harness's log-likelihood request (echo, logprobs=1, max_tokens=1): the prompt's tokens
    with their logprobs, the first one's null, then the output's; the same numbers as vLLM's
    ``prompt_logprobs`` field (chat's at the top of its response); streamed, the same again."""
    prompt = "The sea is deep and wide"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0)
    choice, num_prompt = full.choices[0], full.usage.prompt_tokens
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == num_prompt + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens[:num_prompt]) == prompt and choice.text == prompt + lp.tokens[-1]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(num_prompt + 1)]
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert logprob < 0 and top[token] == logprob and 1 <= len(top) <= 2
    assert max(lp.top_logprobs[-1].values()) == lp.token_logprobs[-1]  # greedy: the output token is the top one

    body = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                                              "prompt_logprobs": 2}).json()
    prompt_logprobs = body["choices"][0]["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == num_prompt
    for token, logprob, alternatives in zip(lp.tokens[1:], lp.token_logprobs[1:], prompt_logprobs[1:]):
        chosen = [a for a in alternatives.values() if a["decoded_token"] == token]
        assert chosen and chosen[0]["logprob"] == pytest.approx(logprob, abs=1e-5)
        assert {a["rank"] for a in alternatives.values()} >= {1, 2}

    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1,
                                                  "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(alternatives) == 1 for alternatives in chat["prompt_logprobs"][1:])  # the prompt token alone

    streamed = streamed_logprobs(client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True,
                                                           logprobs=1, temperature=0, stream=True),
                                 "tokens", "token_logprobs")
    assert streamed == {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs}


def test_responses_api_through_the_openai_client(client):
    """``client.responses.create``: the answer's text, status and usage; streamed, OpenAI's events whose
    deltas add up to the same greedy text; a conversation with instructions; a refusal naming its field."""
    full = client.responses.create(model=MODEL, input="Tell me about the sea.", max_output_tokens=8, temperature=0)
    assert full.status == "incomplete" and full.incomplete_details.reason == "max_output_tokens"
    assert full.output_text and full.usage.output_tokens == 8 and full.usage.input_tokens > 5
    events = list(client.responses.create(model=MODEL, input="Tell me about the sea.", max_output_tokens=8,
                                          temperature=0, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == full.output_text
    assert events[-1].response.output_text == full.output_text
    turn = client.responses.create(model=MODEL, instructions="Answer briefly.", max_output_tokens=4, input=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": [{"type": "input_text", "text": "And the sea?"}]}])
    assert turn.usage.input_tokens > full.usage.input_tokens and turn.output[0].role == "assistant"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_0")
    assert refused.value.body["param"] == "previous_response_id"


def test_responses_api_calls_a_function_and_reads_its_output(client):
    """A forced function call comes back as a function_call item (arguments valid against its schema),
    streamed as its item and argument deltas; the call and its output sent back as input items give the
    next turn."""
    tools = [{"type": "function", "name": "weather", "description": "The weather in a city.", "strict": True,
              "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                             "required": ["city"], "additionalProperties": False}}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(model=MODEL, input=ask, tools=tools, max_output_tokens=32,
                                    tool_choice={"type": "function", "name": "weather"})
    [call] = first.output
    assert call.type == "function_call" and call.name == "weather" and call.call_id
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    events = list(client.responses.create(model=MODEL, input=ask, tools=tools, max_output_tokens=32, stream=True,
                                          tool_choice={"type": "function", "name": "weather"}))
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(streamed)["city"] in ("Paris", "Rome") and events[-1].response.output[0].arguments == streamed
    second = client.responses.create(model=MODEL, tools=tools, max_output_tokens=4, tool_choice="none", input=ask + [
        {"type": "function_call", "call_id": call.call_id, "name": "weather", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}])
    assert second.output[0].type == "message" and second.usage.input_tokens > first.usage.input_tokens


def test_sampling_parameters_are_accepted(client):
    full = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=4, temperature=0.7, top_p=0.9, seed=3,
        presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"100": 5},
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2,
                    "ignore_eos": True, "stop_token_ids": [3]})
    assert full.choices[0].finish_reason in ("length", "stop")
    assert 2 <= full.usage.completion_tokens <= 4


def test_seed_makes_sampling_repeatable(client):
    def sample():
        return client.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=1.0,
                                         seed=1234).choices[0].text
    assert sample() == sample()


def test_request_id_is_echoed(http):
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                         headers={"x-request-id": "trace-me-42"})
    assert response.status_code == 200 and response.headers["x-request-id"] == "trace-me-42"
    assert len(http.get("/v1/models").headers["x-request-id"]) == 32


def test_health_and_metrics(http):
    assert http.get("/health").json() == {"status": "ok", "tokenizer": True, "engine": True}
    http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    text = http.get("/metrics").text
    for name in ("strata:request_success_total{", "strata:prompt_tokens_total{",
                 "strata:generation_tokens_total{", "strata:time_to_first_token_seconds_bucket{",
                 "strata:e2e_request_latency_seconds_bucket{"):
        assert name in text
    assert 'finished_reason="length",model_name="strata-tiny-v1"' in text


def _metric(text: str, prefix: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(line.rsplit(" ", 1)[1])


def test_the_gateway_exports_its_own_measures_and_the_engine_its_own(stack, http, engine):
    """The gateway: its in-flight gauge under its own name and HTTP durations by route and status, and
    no engine series (an engine's are on the engine's /metrics, which Prometheus scrapes)."""
    prompt = list(range(10, 10 + 64))  # four full blocks of 16
    engine_metrics = httpx.get(stack.metrics_urls["engine"], timeout=10)
    replica = f'{{model_name="{MODEL}",replica="engine-0"}}'  # every engine series names its replica
    hits = f'strata:prefix_cache_hits_total{replica}'
    before = _metric(engine_metrics.text, hits)
    for _ in range(2):  # the second request finds the first one's blocks
        http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    text = http.get("/metrics").text
    route = 'strata:http_request_duration_seconds_count{method="POST",route="/v1/completions",status="200"}'
    assert _metric(text, route) >= 2
    assert _metric(text, f'strata:gateway_num_requests_running{{model_name="{MODEL}"}}') == 0
    for name in ("num_requests_running", "num_requests_waiting", "engine_num_requests_running",
                 "kv_cache_usage_perc", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions"):
        series = [line for line in text.splitlines() if line.startswith((f"strata:{name}{{", f"strata:{name}_"))]
        assert not series, name
    engine_text = httpx.get(stack.metrics_urls["engine"], timeout=10).text
    assert _metric(engine_text, hits) - before >= 48
    load = engine_load(engine)
    assert _metric(engine_text, hits) == load.prefix_cache_hits
    assert _metric(engine_text, f'strata:num_preemptions_total{replica}') == load.num_preemptions
    assert _metric(engine_text, f'strata:kv_cache_usage_perc{replica}') == 0.0
