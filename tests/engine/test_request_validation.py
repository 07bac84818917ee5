"""Every field of a Generate request is checked where the request enters (`sampling_params_from_proto`,
then `EngineCore.validate`), so a bad one is an InvalidRequestError (INVALID_ARGUMENT) and never
reaches the scheduler; and every value those checks let through runs a real step beside another
request without failing either. (The common refusals are in test_fault_isolation.py.)"""

import math
import re

import pytest

from services.common.errors import InvalidRequestError
from services.common.pb import engine_pb2
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.protocol import sampling_params_from_proto
from services.engine.sampling_params import SamplingParams

VOCAB = 4096  # the default model's
NUM_TOKENS = 6
FLOAT32_MAX = 3.4028234663852886e38


@pytest.fixture(scope="module")
def core(default_model_dir):
    return EngineCore(EngineConfig(model=str(default_model_dir), max_num_seqs=4, num_kv_blocks=64,
                                   enforce_eager=True, max_logprobs=5000))


def proto_request(sampling: dict | None = None, **stop) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        prompt_token_ids=[7, 8, 9], sampling=engine_pb2.SamplingParams(**(sampling or {})),
        stop=engine_pb2.StopCriteria(**{"max_tokens": NUM_TOKENS, "ignore_eos": True, **stop}))


@pytest.mark.parametrize("request_, param, message", [
    (proto_request(dict(logprobs=VOCAB + 1)), "logprobs", "between 0 and 4096"),  # --max-logprobs above the vocabulary
    (proto_request(dict(logit_bias={VOCAB: 1.0})), "logit_bias", "logit_bias token id 4096"),
    (proto_request(dict(logit_bias={3: 100.5})), "logit_bias", "in [-100, 100]"),
    (proto_request(stop_token_ids=[3, VOCAB]), "stop_token_ids", "stop_token_ids must be in [0, 4096)"),
    (proto_request(dict(repetition_penalty=-math.inf)), "repetition_penalty", "repetition_penalty"),
    (proto_request(dict(min_p=math.nan)), "min_p", "min_p"),
    (proto_request(dict(presence_penalty=-2.5)), "presence_penalty", "presence_penalty"),
    (proto_request(dict(top_k=-(1 << 31))), "top_k", "top_k"),
    (proto_request(dict(temperature=-1)), "temperature", "non-negative"),
    (proto_request(max_tokens=(1 << 32) - 1), "max_tokens", "'max_tokens' is too large"),
    (proto_request(max_tokens=0), "max_tokens", "at least 1"),
    (proto_request(max_tokens=3, min_tokens=4), "min_tokens", "less than or equal to max_tokens=3"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_more_bad_fields_are_invalid_argument_naming_the_param(core, request_, param, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as error:
        core.validate(list(request_.prompt_token_ids), sampling_params_from_proto(request_))
    assert error.value.param == param


def test_a_prompt_over_the_context_is_refused_with_vllms_code(core):
    with pytest.raises(InvalidRequestError, match="maximum context length is 2048 tokens") as error:
        core.validate([5] * 2048, SamplingParams())
    assert (error.value.param, error.value.code) == ("input_tokens", "context_length_exceeded")


def test_a_seed_outside_64_bits_is_refused():
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(seed=1 << 64)
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(seed=-1)


ACCEPTED = {
    "tiny temperature": proto_request(dict(temperature=1e-40)),
    "huge temperature": proto_request(dict(temperature=FLOAT32_MAX)),
    "top_k int32 max": proto_request(dict(top_k=(1 << 31) - 1, temperature=1.0)),
    "top_k -1": proto_request(dict(top_k=-1, temperature=1.0)),
    "smallest top_p": proto_request(dict(top_p=1e-45, temperature=1.0)),
    "min_p 1": proto_request(dict(min_p=1.0, temperature=1.0)),
    "huge repetition penalty": proto_request(dict(repetition_penalty=FLOAT32_MAX)),
    "tiny repetition penalty": proto_request(dict(repetition_penalty=1e-38)),
    "penalties at the bounds": proto_request(dict(presence_penalty=-2.0, frequency_penalty=2.0)),
    "logit bias at the bounds": proto_request(dict(logit_bias={0: -100.0, VOCAB - 1: 100.0})),
    "largest seed": proto_request(dict(seed=(1 << 64) - 1, temperature=1.0)),
    "logprobs of the whole vocabulary": proto_request(dict(logprobs=VOCAB)),
    "every id a stop id until min_tokens": proto_request(min_tokens=NUM_TOKENS, stop_token_ids=range(VOCAB)),
    "one stop id repeated": proto_request(min_tokens=2, stop_token_ids=[5] * 100_000),
}


@pytest.fixture(scope="module")
def neighbour_alone(core):
    return run(core, {"neighbour": SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)})


def run(core: EngineCore, requests: dict[str, SamplingParams]) -> dict[str, list[int]]:
    for request_id, sampling in requests.items():
        core.add_request(request_id, [7, 8, 9], sampling)
    tokens = {request_id: [] for request_id in requests}
    while core.has_unfinished_requests():
        for output in core.step():
            tokens[output.request_id] += output.new_token_ids
        assert not core.take_failures()
    return tokens


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_every_accepted_extreme_runs_beside_another_request(core, neighbour_alone, name):
    request = ACCEPTED[name]
    params = sampling_params_from_proto(request)
    core.validate(list(request.prompt_token_ids), params)
    tokens = run(core, {"extreme": params, "neighbour": SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS,
                                                                       ignore_eos=True)})
    assert len(tokens["extreme"]) == NUM_TOKENS and all(0 <= t < VOCAB for t in tokens["extreme"])
    assert tokens["neighbour"] == neighbour_alone["neighbour"]
    assert core.stats().num_kv_blocks_used == 0


def test_a_tiny_temperature_draws_what_greedy_draws(core):
    tiny = sampling_params_from_proto(ACCEPTED["tiny temperature"])
    assert tiny.is_greedy
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    assert run(core, {"tiny": tiny})["tiny"] == run(core, {"greedy": greedy})["greedy"]


def test_repeated_stop_ids_are_kept_once():
    assert SamplingParams(stop_token_ids=(5, 9, 5, 5)).stop_token_ids == (5, 9)
