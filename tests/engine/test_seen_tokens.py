"""A request's distinct tokens kept as it grows (services/engine/seen_tokens.py) stay what a pass over its
token lists gives, through growth of their arrays; a request without penalties never makes them."""

import random

import torch

from services.engine.request import Request
from services.engine.sampler import Sampler
from services.engine.sampling_params import SamplingParams
from services.engine.seen_tokens import SeenTokens


def as_sets(seen: SeenTokens) -> tuple[list[int], dict[int, float]]:
    return (seen.anywhere[:seen.num_anywhere].tolist(),
            dict(zip(seen.output_ids[:seen.num_output].tolist(), seen.output_counts[:seen.num_output].tolist())))


def test_kept_up_to_date_as_the_request_grows():
    rng = random.Random(3)
    prompt = [rng.randrange(50) for _ in range(70)]  # repeats, and more than the arrays' first size
    request = Request("r", prompt, SamplingParams(repetition_penalty=1.2), eos_token_ids=(0,))
    for _ in range(5):
        request.append_output(rng.randrange(80))
    seen = request.seen()  # made here, then updated by append_output
    for _ in range(200):
        request.append_output(rng.randrange(120))
    assert request.seen() is seen
    anywhere, counts = as_sets(seen)
    assert anywhere == list(dict.fromkeys(request.all_token_ids))  # distinct, in first-seen order
    assert counts == {t: float(request.output_token_ids.count(t)) for t in set(request.output_token_ids)}
    assert as_sets(SeenTokens(request.prompt_token_ids, request.output_token_ids)) == (anywhere, counts)
    # the native penalty pass reads the arrays where these say they are
    assert seen.addresses == (seen.anywhere.ctypes.data, seen.output_ids.ctypes.data, seen.output_counts.ctypes.data)


def test_the_sampler_makes_them_only_for_a_request_with_a_penalty():
    plain = Request("plain", [1, 2, 3], SamplingParams(logit_bias={5: 1.0}), eos_token_ids=(0,))
    penalized = Request("penalized", [1, 2, 3], SamplingParams(presence_penalty=0.5), eos_token_ids=(0,))
    Sampler(16, torch.device("cpu"))(torch.randn(2, 16), [plain, penalized])
    assert plain.seen_tokens is None and as_sets(penalized.seen_tokens) == ([1, 2, 3], {})
