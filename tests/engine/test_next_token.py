"""Which engine outputs go on a GenerateMany stream as a `next_token` entry (services/engine/protocol.py):
one token with nothing else but a usage one completion token past the previous output's; anything
else an output would carry makes it a full output."""

import dataclasses

import pytest

from services.engine.protocol import follows_as_next_token
from services.engine.request import RequestTimes
from services.engine.scheduler_output import RequestOutput, SampledLogprobs

PREVIOUS = RequestOutput("r", [11], [], None, num_prompt_tokens=7, num_output_tokens=2, num_cached_tokens=4,
                         times=RequestTimes(0.0))
NEXT = dataclasses.replace(PREVIOUS, new_token_ids=[12], num_output_tokens=3)


def test_a_plain_next_token_follows_as_one():
    assert follows_as_next_token(NEXT, PREVIOUS)


@pytest.mark.parametrize("change", [
    {"finish_reason": "length"},
    {"stop_token_id": 2, "finish_reason": "stop"},
    {"logprobs": [SampledLogprobs(12, -0.5, 1, [])]},
    {"prompt_logprobs": [SampledLogprobs(3, -1.0, 1, [])]},
    {"new_token_ids": [12, 13], "num_output_tokens": 4},  # (a --stream-interval output)
    {"new_token_ids": [], "num_output_tokens": 2},
    {"num_output_tokens": 4},  # usage not one past the previous output's
    {"num_cached_tokens": 8},  # (after a preemption, recomputed with more of the prompt cached)
    {"num_prompt_tokens": 8},
])
def test_anything_else_an_output_carries_makes_it_a_full_output(change):
    assert not follows_as_next_token(dataclasses.replace(NEXT, **change), PREVIOUS)


def test_the_first_output_is_a_full_one():
    assert not follows_as_next_token(dataclasses.replace(NEXT, num_output_tokens=1), None)
