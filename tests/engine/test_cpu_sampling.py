"""The native sampler (services/engine/cpu_kernels/sampling.py) against the sampler's torch path: the same
token from the same uniform (but where a uniform lands within rounding of a boundary), with or without
min_p, top_k and top_p; the same frequencies; never a token of weight 0 or one the filters drop (checked
against a float64 reference that sorts the vocabulary, also where the run a filter keeps ends among
thousands of nearly equal or exactly equal weights); the argmax for a row without mass; the same draw for
a row alone or in any batch; the engine's sampler taking it for every sampled row on the CPU; the
native logprobs (log-probability, rank, top alternatives) against a float64 log_softmax; and the
structured-output bitmask applied to its rows."""

import pytest
import torch

from services.engine.cpu_kernels import sampling
from services.engine.inverse_cdf import inverse_cdf_draw
from services.engine.sampler import Sampler
from services.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not sampling.can_run(torch.zeros(1, 1)), reason="native CPU kernels not built here")


def torch_path(logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor) -> torch.Tensor:
    return inverse_cdf_draw(Sampler(logits.shape[1], torch.device("cpu")).probabilities(logits, params), uniforms)


def native(logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor) -> torch.Tensor:
    return sampling.sample(logits, uniforms, [p.temperature for p in params], [p.top_k for p in params],
                           [p.top_p for p in params], [p.min_p for p in params])


def sample_temperature(logits: torch.Tensor, temperatures: list[float], uniforms: torch.Tensor) -> torch.Tensor:
    return sampling.sample(logits, uniforms, temperatures)


@pytest.mark.parametrize("vocab", [7, 256, 4096 + 3, 32000])
def test_draws_the_torch_paths_token_from_the_same_uniform(vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(200, vocab, generator=generator) * 3
    logits[:, ::5] = float("-inf")  # masked tokens, as structured output leaves them
    temperatures = (torch.rand(200, generator=generator) * 1.5 + 0.2).tolist()
    uniforms = torch.rand(200, dtype=torch.float64, generator=generator)
    params = [SamplingParams(temperature=t) for t in temperatures]
    drawn = native(logits, params, uniforms)
    assert (drawn % 5 != 0).all()  # never a masked token
    same = (drawn == torch_path(logits, params, uniforms)).float().mean().item()
    assert same >= 0.99, same  # float32 weights summed in another order: only draws at a boundary differ


FILTERS = {"top_k": dict(top_k=20), "top_p": dict(top_p=0.8), "min_p": dict(min_p=0.1),
           "all three": dict(min_p=0.02, top_k=50, top_p=0.9), "top_k of one": dict(top_k=1),
           "top_p low": dict(top_p=0.05)}


def kept_by_reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The tokens ``p``'s filters keep in each row, by a float64 sort of the whole vocabulary; a token within
    1e-6 of a top_p or min_p boundary counts as kept (the native weights are float32)."""
    scaled = logits.double() / p.temperature
    probs = scaled.softmax(dim=-1)
    kept = probs >= p.min_p * probs.max(dim=-1, keepdim=True).values - 1e-6
    order = scaled.masked_fill(~kept, float("-inf")).argsort(dim=-1, descending=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(logits.shape[1]).expand_as(order))
    if p.top_k:
        kept &= rank < p.top_k
    if p.top_p < 1.0:
        weights = probs * kept
        sorted_weights = weights.gather(1, order)
        mass_before = (sorted_weights.cumsum(dim=-1) - sorted_weights) / sorted_weights.sum(dim=-1, keepdim=True)
        kept &= mass_before.gather(1, rank) < p.top_p + 1e-6
    return kept


@pytest.mark.parametrize("vocab", [7, 4096 + 3, 32000])
@pytest.mark.parametrize("name", FILTERS)
def test_filters_draw_the_torch_paths_token_and_only_tokens_they_keep(vocab, name):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(200, vocab, generator=generator) * 3
    logits[:, ::5] = float("-inf")
    params = SamplingParams(temperature=0.9, **FILTERS[name])
    uniforms = torch.rand(200, dtype=torch.float64, generator=generator)
    drawn = native(logits, [params] * 200, uniforms)
    assert kept_by_reference(logits, params).gather(1, drawn.unsqueeze(1)).all()
    same = (drawn == torch_path(logits, [params] * 200, uniforms)).float().mean().item()
    assert same >= 0.99, same


@pytest.mark.parametrize("name", ["top_k", "top_p", "all three", "top_p low"])
def test_filters_on_a_peaked_distribution_of_a_large_vocabulary(name):
    # a language model's shape: a few tokens hold most of the mass, the rest of 152k far below the mean
    # weight, which the native filters drop before their search (see keep_leading_run's floor)
    generator = torch.Generator().manual_seed(7)
    rows, vocab = 24, 151936
    ranks = torch.stack([torch.randperm(vocab, generator=generator) for _ in range(rows)]).float()
    logits = -2.5 * torch.log1p(ranks) + 0.3 * torch.randn(rows, vocab, generator=generator)
    params = SamplingParams(temperature=0.8, **FILTERS[name])
    uniforms = torch.rand(rows, dtype=torch.float64, generator=generator)
    drawn = native(logits, [params] * rows, uniforms)
    assert kept_by_reference(logits, params).gather(1, drawn.unsqueeze(1)).all()
    assert (drawn == torch_path(logits, [params] * rows, uniforms)).all()


@pytest.mark.parametrize("filters", [dict(top_k=3), dict(top_p=0.7), dict(min_p=0.3), dict(top_k=3, top_p=0.8)])
def test_frequencies_follow_the_filtered_distribution(filters):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 1.5]).repeat(40000, 1)
    params = SamplingParams(temperature=0.7, **filters)
    uniforms = torch.rand(40000, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    counts = torch.bincount(native(logits, [params] * 40000, uniforms), minlength=5).double() / 40000
    expected = Sampler(5, torch.device("cpu")).probabilities(logits[:1], [params])[0].double()
    torch.testing.assert_close(counts, expected, atol=0.01, rtol=0)
    assert (counts[expected == 0] == 0).all()


def bounds(logits: torch.Tensor, params: SamplingParams) -> list[int]:
    """The lowest and highest token ids drawn from uniforms 0 and just below 1."""
    uniforms = torch.tensor([0.0, 1.0 - 2.0 ** -53], dtype=torch.float64)
    return native(logits.expand(2, -1), [params] * 2, uniforms).tolist()


def test_the_run_can_end_among_thousands_of_nearly_equal_weights():
    # weights rising from e^-0.05 to 1 along the vocabulary: every token falls in a bucket or two of the
    # first histogram, so the run's end is found in the second, then among a few tokens
    vocab = 50000
    logits = torch.linspace(0.0, 0.05, vocab).unsqueeze(0)
    assert bounds(logits, SamplingParams(temperature=1.0, top_k=1000)) == [vocab - 1000, vocab - 1]
    kept = kept_by_reference(logits, SamplingParams(temperature=1.0, top_p=0.3))[0].nonzero().flatten()
    low, high = bounds(logits, SamplingParams(temperature=1.0, top_p=0.3))
    assert high == vocab - 1 and abs(low - int(kept.min())) <= 1  # the boundary: float32 weights, float64 sums


def test_among_equal_weights_the_lower_ids_come_first():
    logits = torch.zeros(1, 40000)
    assert bounds(logits, SamplingParams(temperature=1.0, top_k=100)) == [0, 99]
    assert bounds(logits, SamplingParams(temperature=1.0, top_p=0.5)) == [0, 19999]
    logits[0, 30000] = 1.0  # one token above the rest: kept first, then the lowest ids
    assert bounds(logits, SamplingParams(temperature=1.0, top_k=3)) == [0, 30000]


def test_frequencies_follow_softmax_over_temperature():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf")]).repeat(40000, 1)
    uniforms = torch.rand(40000, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    tokens = sample_temperature(logits, [0.5] * 40000, uniforms)
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
    assert sample_temperature(logits, [1.0] * 3, torch.full((3,), below_one, dtype=torch.float64)).tolist() \
        == [700, vocab - 1, 500]
    assert sample_temperature(logits, [1.0] * 3, torch.zeros(3, dtype=torch.float64)).tolist() == [3, vocab - 1, 0]


def test_a_row_without_mass_gets_its_argmax():
    logits = torch.tensor([[0.0, float("nan"), 1.0], [float("-inf")] * 3, [0.0, 0.0, 9.0]])
    tokens = sample_temperature(logits, [1.0] * 3, torch.full((3,), 0.5, dtype=torch.float64))
    assert tokens.tolist() == [1, 0, 2]


def test_a_row_draws_the_same_token_alone_or_in_a_batch():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 8192, generator=generator)
    uniforms = torch.rand(64, dtype=torch.float64, generator=generator)
    params = [SamplingParams(temperature=0.8, **list(FILTERS.values())[i % len(FILTERS)]) if i % 3 else
              SamplingParams(temperature=0.8) for i in range(64)]
    batch = native(logits, params, uniforms)
    alone = [native(logits[i:i + 1], params[i:i + 1], uniforms[i:i + 1]).item() for i in range(64)]
    assert batch.tolist() == alone


def test_rows_and_values_must_match():
    with pytest.raises(ValueError, match="2 rows, but 1 top_ks"):
        sampling.sample(torch.zeros(2, 8), torch.zeros(2, dtype=torch.float64), [1.0, 1.0], top_ks=[3])


@pytest.mark.parametrize("vocab", [5, 4096 + 3, 32000])
def test_logprobs_ranks_and_top_match_log_softmax(vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(40, vocab, generator=generator) * 4
    logits[:, ::7] = float("-inf")
    logits[3] = 0.5  # every logit equal: rank 1, the top k the lowest ids
    tokens = torch.randint(0, vocab, (40,), generator=generator)
    k = min(vocab, 6)
    token_logprobs, ranks, top_ids, top_values = sampling.logprobs(logits, tokens, k)
    reference = logits.double().log_softmax(dim=-1)
    expected = reference.gather(1, tokens.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(token_logprobs.double(), expected, rtol=1e-6, atol=1e-6)  # -inf where masked
    assert ranks.tolist() == ((logits > logits.gather(1, tokens.unsqueeze(1))).sum(dim=-1) + 1).tolist()
    torch.testing.assert_close(top_values.double(), reference.topk(k, dim=-1).values, rtol=1e-6, atol=1e-6)
    assert (reference.gather(1, top_ids) == reference.topk(k, dim=-1).values).all()
    assert ranks[3] == 1 and top_ids[3].tolist() == list(range(k))


def test_logprobs_of_a_row_without_mass_are_nan_as_log_softmax():
    logits = torch.tensor([[float("-inf")] * 4, [0.0, float("nan"), 1.0, 2.0]])
    token_logprobs, _, _, top_values = sampling.logprobs(logits, torch.tensor([1, 2]), 2)
    assert token_logprobs.isnan().all() and top_values.isnan().all()


def test_the_samplers_logprobs_are_the_same_on_the_torch_path(monkeypatch):
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 300, generator=generator)
    requests = [_Request(f"r{i}", SamplingParams(temperature=0.0, logprobs=[None, 0, 3, 5][i])) for i in range(4)]
    native_tokens, native_logprobs = Sampler(300, torch.device("cpu"))(logits, requests)
    monkeypatch.setattr(sampling, "can_run", lambda _: False)
    tokens, logprobs = Sampler(300, torch.device("cpu"))(logits, requests)
    assert tokens == native_tokens and logprobs[0] is None is native_logprobs[0]
    for ours, theirs in zip(native_logprobs[1:], logprobs[1:]):
        assert (ours.token_id, ours.rank) == (theirs.token_id, theirs.rank)
        assert [i for i, _ in ours.top] == [i for i, _ in theirs.top]
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-5)
        assert [v for _, v in ours.top] == pytest.approx([v for _, v in theirs.top], abs=1e-5)
    assert [len(lp.top) for lp in logprobs[1:]] == [0, 3, 5]


class _Request:
    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id, self.sampling_params = request_id, params
        self.num_output_tokens, self.eos_token_ids = 5, frozenset()


def test_the_sampler_takes_it_for_every_sampled_row(monkeypatch):
    calls = []
    sample = sampling.sample
    monkeypatch.setattr(sampling, "sample", lambda *args: calls.append(args) or sample(*args))
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
    filtered = [_Request("f", SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=1))]
    tokens = sampler(logits[:1], filtered)[0]
    assert len(calls) == 4 and calls[-1][3:] == ([5], [0.9], [0.1])
    assert tokens[0] in logits[0].topk(5).indices.tolist()


def bitmask_of(allowed: torch.Tensor) -> torch.Tensor:
    """``allowed`` bool ``[n, 32 w]`` as llguidance's int32 words: bit j of word w, token 32 w + j."""
    words = (allowed.reshape(allowed.shape[0], -1, 32).to(torch.int64) << torch.arange(32)).sum(dim=-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)  # the same 32 bits


def test_the_bitmask_masks_its_rows_and_an_emptied_row_takes_the_unprocessed_one():
    generator = torch.Generator().manual_seed(11)
    vocab, words = 1000, 32  # 1,024 bits: the last 24 past the vocabulary
    unprocessed = torch.randn(6, vocab, generator=generator)
    logits = unprocessed.clone()
    logits[2, ::2] = float("-inf")  # a penalty took these away...
    allowed = torch.rand(4, 32 * words, generator=generator) < 0.3
    allowed[0] = False
    allowed[0, 0:vocab:2] = True  # ...and mask row 0 allows only those: row 2 takes its unprocessed logits
    logits[5, 7] = float("nan")
    allowed[2, 7] = True  # an allowed NaN is not an emptied row
    logit_rows, mask_rows = [0, 2, 3, 5], [3, 0, 1, 2]
    expected = logits.clone()
    for row, mask_row in zip(logit_rows, mask_rows):
        keep = allowed[mask_row, :vocab]
        masked = expected[row].masked_fill(~keep, float("-inf"))
        if torch.isneginf(masked).all():
            masked = unprocessed[row].masked_fill(~keep, float("-inf"))
        expected[row] = masked
    sampling.apply_bitmask(logits, logit_rows, bitmask_of(allowed), mask_rows, unprocessed)
    torch.testing.assert_close(logits, expected, equal_nan=True, rtol=0, atol=0)
    assert torch.isfinite(logits[2, 0:vocab:2]).all() and torch.isneginf(logits[2, 1::2]).all()
    short = torch.zeros(1, 31, dtype=torch.int32) - 1  # every bit set, but 992 tokens only
    row = torch.randn(1, vocab, generator=generator)
    sampling.apply_bitmask(row, [0], short, [0], row.clone())
    assert torch.isfinite(row[0, :992]).all() and torch.isneginf(row[0, 992:]).all()
