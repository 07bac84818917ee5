"""The native temperature sampler (services/engine/cpu_kernels/sampling.py) against the sampler's torch
path: the same token from the same uniform (but where a uniform lands within rounding of a boundary),
the same frequencies, no token of weight 0 ever, the argmax for a row without mass, the same draw for a
row alone or in any batch, and the engine's sampler taking it only for rows that set a temperature alone."""

import pytest
import torch

from services.engine.cpu_kernels import sampling
from services.engine.inverse_cdf import inverse_cdf_draw
from services.engine.sampler import Sampler
from services.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not sampling.can_run(torch.zeros(1, 1)), reason="native CPU kernels not built here")


def torch_path(logits: torch.Tensor, temperatures: list[float], uniforms: torch.Tensor) -> torch.Tensor:
    probs = (logits / torch.tensor(temperatures).unsqueeze(1)).softmax(dim=-1)
    return inverse_cdf_draw(probs, uniforms)


@pytest.mark.parametrize("vocab", [7, 256, 4096 + 3, 32000])
def test_draws_the_torch_paths_token_from_the_same_uniform(vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(200, vocab, generator=generator) * 3
    logits[:, ::5] = float("-inf")  # masked tokens, as structured output leaves them
    temperatures = (torch.rand(200, generator=generator) * 1.5 + 0.2).tolist()
    uniforms = torch.rand(200, dtype=torch.float64, generator=generator)
    native = sampling.sample_temperature(logits, temperatures, uniforms)
    assert (native % 5 != 0).all()  # never a masked token
    same = (native == torch_path(logits, temperatures, uniforms)).float().mean().item()
    assert same >= 0.99, same  # float32 weights summed in another order: only draws at a boundary differ


def test_frequencies_follow_softmax_over_temperature():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf")]).repeat(40000, 1)
    uniforms = torch.rand(40000, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    tokens = sampling.sample_temperature(logits, [0.5] * 40000, uniforms)
    counts = torch.bincount(tokens, minlength=5).double() / 40000
    expected = (logits[0] / 0.5).softmax(dim=-1).double()
    torch.testing.assert_close(counts, expected, atol=0.01, rtol=0)
    assert counts[4] == 0


def test_ends_of_the_unit_interval_land_on_tokens_of_positive_weight():
    vocab = 1000
    logits = torch.full((3, vocab), float("-inf"))
    logits[0, [3, 700]] = 0.0
    logits[1, vocab - 1] = 5.0
    logits[2, 0] = -30.0  # a tiny weight first, then the bulk in the middle
    logits[2, 500] = 30.0
    below_one = 1.0 - 2.0 ** -53
    assert sampling.sample_temperature(logits, [1.0] * 3, torch.full((3,), below_one, dtype=torch.float64)).tolist() \
        == [700, vocab - 1, 500]
    assert sampling.sample_temperature(logits, [1.0] * 3, torch.zeros(3, dtype=torch.float64)).tolist() == [3, vocab - 1, 0]


def test_a_row_without_mass_gets_its_argmax():
    logits = torch.tensor([[0.0, float("nan"), 1.0], [float("-inf")] * 3, [0.0, 0.0, 9.0]])
    tokens = sampling.sample_temperature(logits, [1.0] * 3, torch.full((3,), 0.5, dtype=torch.float64))
    assert tokens.tolist() == [1, 0, 2]


def test_a_row_draws_the_same_token_alone_or_in_a_batch():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 8192, generator=generator)
    uniforms = torch.rand(64, dtype=torch.float64, generator=generator)
    batch = sampling.sample_temperature(logits, [0.8] * 64, uniforms)
    alone = [sampling.sample_temperature(logits[i:i + 1], [0.8], uniforms[i:i + 1]).item() for i in range(64)]
    assert batch.tolist() == alone


class _Request:
    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id, self.sampling_params = request_id, params
        self.num_output_tokens, self.eos_token_ids = 5, frozenset()


def test_the_sampler_takes_it_only_for_rows_that_set_a_temperature_alone(monkeypatch):
    calls = []
    native = sampling.sample_temperature
    monkeypatch.setattr(sampling, "sample_temperature", lambda *args: calls.append(args) or native(*args))
    logits = torch.randn(3, 512)
    sampler = Sampler(512, torch.device("cpu"))
    plain = [_Request(f"r{i}", SamplingParams(temperature=0.7, seed=i)) for i in range(3)]
    first = sampler(logits, plain)[0]
    assert len(calls) == 1
    sampler.free("r0"), sampler.free("r1"), sampler.free("r2")
    assert sampler(logits, plain)[0] == first  # seeded: the same tokens again
    greedy_and_plain = [_Request("g", SamplingParams(temperature=0.0)), plain[1]]
    sampler(logits[:2], greedy_and_plain)
    assert len(calls) == 3 and calls[-1][0].shape[0] == 1  # the one sampled row
    for filtered in (SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=0.7, top_k=5),
                     SamplingParams(temperature=0.7, min_p=0.1)):
        sampler(logits[:1], [_Request("f", filtered)])
        assert len(calls) == 3  # top_p, top_k and min_p stay on the torch path
