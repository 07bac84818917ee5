"""Request validation: each rule of the API gives a 400 (or 404) naming its parameter, valid requests
map onto the engine's protobuf fields, and the rules on sampling values stay the engine's alone: the
gateway passes them on and names an engine refusal as the client named the field."""

import dataclasses

import pytest

from services.gateway.errors import OpenAIError
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.validation import (
    Limits,
    ModelFacts,
    completion_prompts,
    resolve_max_tokens,
    validate_chat,
    validate_completion,
)

FACTS = ModelFacts(name="tiny", max_model_len=100, eos_token_ids=frozenset({2}))
LIMITS = Limits(max_n=4, max_stop_strings=3, max_prompts=5)


def chat(**fields):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    return validate_chat(ChatCompletionRequest(**body), FACTS, LIMITS)


def completion(**fields):
    body = {"model": "tiny", "prompt": "hi", **fields}
    return validate_completion(CompletionRequest(**body), FACTS, LIMITS)


def refused(call, **fields) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        call(**fields)
    return info.value


@pytest.mark.parametrize("fields, param", [
    ({"temperature": float("nan")}, "temperature"),  # a protobuf float cannot carry what JSON allows past these
    ({"top_p": 1e39}, "top_p"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"n": 0}, "n"),
    ({"n": 5}, "n"),
    ({"n": 2, "temperature": 0}, "n"),
    ({"stop": ["a", "b", "c", "d"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.[0].content"),
])
def test_chat_rule_gives_400_naming_the_param(fields, param):
    error = refused(chat, **fields)
    assert (error.status, error.param) == (400, param)


def test_unknown_model_is_404_with_vllms_message():
    error = refused(chat, model="gpt-4")
    assert (error.status, error.param, error.message) == (404, "model", "The model `gpt-4` does not exist.")


def test_model_may_be_omitted():
    assert chat(model=None).n == 1


@pytest.mark.parametrize("fields, param", [
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # vLLM refuses it too
    ({"suffix": "x"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a"] * 6}, "prompt"),
    ({"prompt": [[1], [-1]]}, "prompt"),
])
def test_completion_rule_gives_400_naming_the_param(fields, param):
    error = refused(completion, **fields)
    assert (error.status, error.param) == (400, param)


def test_echo_with_logprobs_asks_for_the_prompt_logprobs_too():
    assert completion(logprobs=2, echo=True).sampling_proto(0).prompt_logprobs == 2
    assert not completion(logprobs=2).sampling_proto(0).HasField("prompt_logprobs")
    assert not completion(echo=True).sampling_proto(0).HasField("prompt_logprobs")
    assert completion(prompt_logprobs=5, logprobs=1, echo=True).sampling_proto(0).prompt_logprobs == 5  # the larger


def test_sampling_fields_reach_the_engine_proto():
    params = chat(temperature=0.5, top_p=0.9, top_k=-1, min_p=0.1, presence_penalty=1,
                  frequency_penalty=-1, repetition_penalty=1.2, logit_bias={"7": -100}, seed=11,
                  n=3, logprobs=True, top_logprobs=4, stop_token_ids=[9], min_tokens=2,
                  ignore_eos=True, max_tokens=10)
    proto = params.sampling_proto(choice_index=2)
    assert proto.temperature == pytest.approx(0.5) and proto.top_p == pytest.approx(0.9)
    assert proto.top_k == -1 and proto.min_p == pytest.approx(0.1)  # -1: off, as the engine reads it
    assert proto.presence_penalty == 1 and proto.frequency_penalty == -1
    assert proto.repetition_penalty == pytest.approx(1.2)
    assert dict(proto.logit_bias) == {7: -100}
    assert proto.seed == 13  # seed + choice index
    assert proto.logprobs == 4
    stop = params.stop_proto(10)
    assert (stop.max_tokens, stop.min_tokens, list(stop.stop_token_ids), stop.ignore_eos) == (10, 2, [9], True)


def test_unset_sampling_fields_stay_unset():
    proto = chat().sampling_proto(0)
    for name in ("temperature", "top_p", "top_k", "seed", "logprobs"):
        assert not proto.HasField(name)


def test_negative_seed_wraps_to_uint64():
    assert chat(seed=-1).sampling_proto(0).seed == (1 << 64) - 1
    assert chat(seed=-(1 << 63)).sampling_proto(0).seed == 1 << 63


@pytest.mark.parametrize("seed", [1 << 63, 1 << 64, -(1 << 63) - 1])
def test_a_seed_past_64_bits_is_a_400_as_in_vllm(seed):
    """It was wrapped modulo 2**64: seed 2**64 sampled as seed 0 did."""
    for call in (chat, completion):
        error = refused(call, seed=seed)
        assert error.status == 400 and error.param == "seed"


def test_logprobs_true_without_top_logprobs_asks_for_the_sampled_token_only():
    assert chat(logprobs=True).num_logprobs == 0
    assert chat().num_logprobs is None


def test_max_completion_tokens_wins_and_names_itself():
    params = chat(max_tokens=5, max_completion_tokens=7)
    assert (params.max_tokens, params.max_tokens_param) == (7, "max_completion_tokens")


@pytest.mark.parametrize("prompt, expected", [
    ("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_completion_prompt_forms(prompt, expected):
    assert completion_prompts(CompletionRequest(prompt=prompt)) == expected


def test_strings_are_never_read_as_token_ids():
    with pytest.raises(ValueError):
        CompletionRequest(prompt=["a", 1])


def test_max_tokens_defaults_to_the_rest_of_the_context():
    assert resolve_max_tokens(chat(), 30, FACTS) == 70


def test_the_models_default_max_tokens_caps_only_a_request_that_sets_none():
    facts = dataclasses.replace(FACTS, default_max_tokens=20)  # generation_config.json's max_new_tokens
    assert resolve_max_tokens(chat(), 30, facts) == 20 and resolve_max_tokens(chat(), 95, facts) == 5
    assert resolve_max_tokens(chat(max_tokens=50), 30, facts) == 50


def test_n_above_one_is_refused_when_the_models_default_temperature_is_greedy():
    facts = dataclasses.replace(FACTS, default_temperature=0.0)  # generation_config.json's temperature
    body = {"model": "tiny", "prompt": "hi", "n": 2}
    with pytest.raises(OpenAIError) as refused:
        validate_completion(CompletionRequest(**body), facts, LIMITS)
    assert refused.value.param == "n" and "greedy" in refused.value.message
    assert validate_completion(CompletionRequest(**body, temperature=0.7), facts, LIMITS).n == 2
    assert completion(n=2).n == 2  # the neutral default, 1.0, samples


def test_a_prompt_that_fills_the_context_is_sent_for_the_engine_to_refuse():
    assert resolve_max_tokens(chat(), 100, FACTS) == 1 and resolve_max_tokens(chat(max_tokens=80), 30, FACTS) == 80


ENGINE_RULES = [{"temperature": -0.1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2}, {"min_p": 2},
                {"presence_penalty": 3}, {"frequency_penalty": -2.5}, {"repetition_penalty": 0},
                {"max_tokens": 0}, {"max_completion_tokens": 0}, {"min_tokens": 5, "max_tokens": 2},
                {"stop_token_ids": [50]}, {"logit_bias": {"60": 1}}, {"logit_bias": {"3": 101}}]


@pytest.mark.parametrize("fields", ENGINE_RULES, ids=str)
def test_the_sampling_rules_are_the_engines_alone(fields):
    """A second copy of these rules in the gateway would refuse them here; the engine's SamplingParams
    and EngineCore.validate do (tests/engine/test_request_validation.py, tests/e2e/test_errors.py)."""
    chat(**fields)


@pytest.mark.parametrize("call, fields, engine_param, param", [
    (chat, {"max_completion_tokens": 7}, "max_tokens", "max_completion_tokens"),
    (chat, {"max_tokens": 7}, "max_tokens", "max_tokens"),
    (chat, {"logprobs": True, "top_logprobs": 3}, "logprobs", "top_logprobs"),
    (completion, {"logprobs": 3}, "logprobs", "logprobs"),
    (chat, {"response_format": {"type": "json_object"}}, "structured_output", "response_format"),
    (completion, {"guided_regex": "a+"}, "structured_output", "guided_regex"),
    (chat, {}, "temperature", "temperature"),
])
def test_an_engine_refusal_is_named_as_the_client_named_the_field(call, fields, engine_param, param):
    assert call(**fields).request_param(engine_param) == param
