"""The sampler on crafted logits: greedy, masks, seeds, penalties, bias, min_tokens and logprobs."""

import math

import pytest
import torch

from services.engine.request import Request
from services.engine.sampler import Sampler, greedy_tokens
from services.engine.sampling_params import SamplingParams

VOCAB = 16


def request(request_id="r", prompt=(1, 2, 3), output=(), **params) -> Request:
    r = Request(request_id, list(prompt), SamplingParams(**params), eos_token_ids=(0,))
    for token in output:
        r.append_output(token)
    return r


def crafted_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log().unsqueeze(0)  # [1, len(probs)]


def test_greedy_and_top_k_1_are_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)
    sampler = Sampler(VOCAB, torch.device("cpu"))
    greedy = [request(f"g{i}", temperature=0.0) for i in range(3)]
    top1 = [request(f"k{i}", temperature=1.3, top_k=1) for i in range(3)]
    tokens, logprobs = sampler(logits, greedy + top1)
    assert tokens == logits.argmax(-1).tolist()
    assert logprobs == [None] * 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [8192, 8192 + 7])
def test_greedy_tokens_pick_what_argmax_picks_among_ties_nan_and_minus_inf(dtype, vocab):
    torch.manual_seed(0)
    logits = torch.randint(0, 3, (64, vocab)).to(dtype)  # every row has thousands of tied maxima
    logits[5, 100] = float("nan")
    logits[7] = float("-inf")
    logits[9, -1] = 5.0
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert greedy_tokens(logits)[[5, 7, 9]].tolist() == [100, 0, vocab - 1]
    logits[11, 3] = float("nan")  # NaN after the first maximum still wins
    logits[12, :] = -1.0
    logits[12, -1] = float("inf")
    assert greedy_tokens(logits)[[11, 12]].tolist() == [3, vocab - 1]
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))


def test_seeded_request_draws_the_same_alone_and_in_a_batch_of_32():
    torch.manual_seed(0)
    steps = [torch.randn(33, VOCAB) for _ in range(6)]
    alone_sampler = Sampler(VOCAB, torch.device("cpu"), seed=1)
    batch_sampler = Sampler(VOCAB, torch.device("cpu"), seed=2)  # a different engine seed
    seeded = request("seeded", seed=1234, temperature=0.9, top_p=0.95)
    others = [request(f"o{i}", temperature=1.0, seed=i if i % 2 else None) for i in range(32)]
    alone = [alone_sampler(logits[:1], [seeded])[0][0] for logits in steps]
    batched = [batch_sampler(logits, [seeded] + others)[0][0] for logits in steps]
    assert alone == batched
    fresh = Sampler(VOCAB, torch.device("cpu"))
    assert [fresh(logits[:1], [request("other-id", seed=1234, temperature=0.9, top_p=0.95)])[0][0]
            for logits in steps[:1]] == alone[:1]  # the generator follows the seed, not the request id
    alone_sampler.free("seeded")
    assert "seeded" not in alone_sampler.request_generators


@pytest.mark.parametrize(("params", "kept"), [
    (dict(top_k=2), [0, 1]),
    (dict(top_p=0.6), [0, 1]),  # mass before token 1 is 0.5 < 0.6, before token 2 is 0.8
    (dict(top_p=0.5), [0]),
    (dict(min_p=0.2), [0, 1, 2]),  # keeps p >= 0.2 * 0.5
    (dict(top_p=0.83), [0, 1, 2]),
    (dict(top_k=3, top_p=0.83), [0, 1]),  # top_p on the renormalised top 3: (0.5 + 0.3) / 0.95 >= 0.83
    (dict(), [0, 1, 2, 3]),
])
def test_masks_keep_exactly_the_right_tokens(params, kept):
    probs = [0.5, 0.3, 0.15, 0.05]
    sampler = Sampler(4, torch.device("cpu"))
    out = sampler.probabilities(crafted_logits(probs), [SamplingParams(**params)])[0]
    assert (out > 0).nonzero().squeeze(1).tolist() == kept
    expected = torch.tensor([probs[i] if i in kept else 0.0 for i in range(4)])
    torch.testing.assert_close(out, expected / expected.sum())


def test_temperature_scales_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    out = Sampler(4, torch.device("cpu")).probabilities(logits, [SamplingParams(temperature=0.5)])
    torch.testing.assert_close(out, (logits / 0.5).softmax(-1))


def test_draws_follow_the_masked_distribution():
    probs = [0.5, 0.3, 0.15, 0.05]
    n = 6000
    rows = [request(f"r{i}", top_p=0.9) for i in range(n)]  # keeps tokens 0..2
    tokens, _ = Sampler(4, torch.device("cpu"), seed=7)(crafted_logits(probs).expand(n, 4), rows)
    counts = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    assert counts[3] == 0
    torch.testing.assert_close(counts[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95, atol=0.025, rtol=0)


def test_penalties_and_logit_bias_change_logits_exactly():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])
    sampler = Sampler(6, torch.device("cpu"))
    rep = request(prompt=(0, 1), output=(3,), repetition_penalty=2.0)
    torch.testing.assert_close(sampler.process_logits(logits, [rep]),
                               torch.tensor([[1.0, -4.0, 1.0, -2.0, 0.5, 3.0]]))
    freq = request(prompt=(0, 1), output=(2, 2, 5), frequency_penalty=0.5, presence_penalty=0.25)
    torch.testing.assert_close(sampler.process_logits(logits, [freq]),  # prompt tokens 0, 1 untouched
                               torch.tensor([[2.0, -2.0, 1.0 - 1.0 - 0.25, -1.0, 0.5, 3.0 - 0.5 - 0.25]]))
    bias = request(logit_bias={4: 10.0, 1: -5.0})
    torch.testing.assert_close(sampler.process_logits(logits, [bias]),
                               torch.tensor([[2.0, -7.0, 1.0, -1.0, 10.5, 3.0]]))
    plain = request()
    batch = sampler.process_logits(logits.expand(4, 6), [rep, freq, bias, plain])
    torch.testing.assert_close(batch[3], logits[0])
    assert sampler(logits, [request(temperature=0.0, logit_bias={4: 10.0})])[0] == [4]


def test_the_draw_sees_the_edited_logits_and_the_caller_gets_its_own_back(monkeypatch):
    # the sampler edits the step's logits in place for its draw (no copy of the batch) and puts them back
    torch.manual_seed(3)
    logits = torch.randn(5, 40) * 2
    original = logits.clone()
    rows = [request("rep", prompt=(1, 2, 5), output=(5, 7), repetition_penalty=1.8, temperature=0.9),
            request("freq", output=(3, 3, 3, 9), frequency_penalty=1.5, presence_penalty=0.5, top_p=0.9),
            request("bias", logit_bias={4: 8.0, 6: -30.0}, top_k=5),
            request("min", output=(11,), min_tokens=4, stop_token_ids=[12], temperature=0.0),
            request("plain", temperature=1.2)]
    tokens, _ = Sampler(40, torch.device("cpu"), seed=5)(logits, rows)
    assert torch.equal(logits, original)
    reference = Sampler(40, torch.device("cpu"), seed=5)
    assert tokens == reference._draw(reference.process_logits(original, rows), rows).tolist()
    assert tokens[3] not in (0, 12)  # min_tokens: neither eos nor the stop token yet
    sampler = Sampler(40, torch.device("cpu"))
    monkeypatch.setattr(sampler, "_draw", lambda *_: (_ for _ in ()).throw(RuntimeError("draw failed")))
    with pytest.raises(RuntimeError):
        sampler._sample(logits, rows, None)
    assert torch.equal(logits, original)  # back where the draw raised too


def test_penalties_over_a_batch_match_their_definition_on_every_logit():
    """Each row's penalties as OpenAI and vLLM define them, computed densely over the vocabulary here:
    repetition once per token seen in the prompt or output (divide a positive logit, multiply a
    negative one), frequency times each output token's count, presence once per output token."""
    generator = torch.Generator().manual_seed(0)
    vocab, rows = 50, 6
    logits = torch.randn(rows, vocab, generator=generator) * 2
    logits[0, 7] = float("-inf")
    requests = []
    for i in range(rows):
        prompt = torch.randint(0, vocab, (30,), generator=generator).tolist()
        output = torch.randint(0, 12, (i * 7,), generator=generator).tolist()  # many repeats
        requests.append(request(f"r{i}", prompt=prompt, output=output, repetition_penalty=[1.0, 1.3, 0.8][i % 3],
                                frequency_penalty=[0.0, 0.4, -0.3][(i // 3) % 3] * (i % 2),
                                presence_penalty=[0.5, 0.0, 1.2][i % 3]))
    expected = logits.clone()
    for row, r in enumerate(requests):
        p = r.sampling_params
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[r.all_token_ids] = True
        penalized = torch.where(expected[row] > 0, expected[row] / p.repetition_penalty,
                                expected[row] * p.repetition_penalty)
        expected[row] = torch.where(seen, penalized, expected[row])
        counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.int64), minlength=vocab).float()
        expected[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    torch.testing.assert_close(Sampler(vocab, torch.device("cpu")).process_logits(logits, requests), expected)


def test_the_native_penalty_pass_writes_and_restores_the_torch_paths_exact_values():
    """The CPU's native pass (`sampling.penalize`) and torch's gathers give the same bits, with
    min_tokens and logit_bias on the same tokens, -inf, NaN and zero logits among the penalized ones, and
    rows whose contexts grew their seen-token arrays; the caller's logits come back bit for bit."""
    from services.engine.cpu_kernels import sampling
    from services.engine.logit_edits import LogitEdits

    if not sampling.is_available():
        pytest.skip("no C++ compiler: no native pass")
    generator = torch.Generator().manual_seed(1)
    vocab, rows = 3000, 7
    logits = torch.randn(rows, vocab, generator=generator) * 3
    logits[0, :40] = float("-inf")
    logits[1, :40] = float("nan")
    logits[2, :40] = 0.0
    requests = []
    for i in range(rows):
        prompt = torch.randint(0, vocab, (50 + 400 * i,), generator=generator).tolist()
        output = torch.randint(0, 60, (30 * i,), generator=generator).tolist()  # repeats, some in the prompt
        banning = dict(min_tokens=1000, max_tokens=2000, stop_token_ids=[5]) if i in (3, 4) else {}
        requests.append(request(f"r{i}", prompt=prompt, output=output, repetition_penalty=[1.0, 1.3, 0.7][i % 3],
                                frequency_penalty=[0.0, 0.4, -0.3][i % 3], presence_penalty=[0.5, 0.0, 1.1][(i + 1) % 3],
                                logit_bias={5: 2.0, 17: -1.5} if i in (2, 4) else {}, **banning))
    for request_ in requests:
        request_.seen()  # made now: the new outputs below grow its arrays into new ones
        for token in torch.randint(0, vocab, (300,), generator=generator).tolist():
            request_.append_output(token)
    edits = LogitEdits.of(requests, torch.float32, torch.device("cpu"))
    native, with_torch = logits.clone(), logits.clone()
    edits.apply(native)
    edits.apply(with_torch, native=False)
    assert torch.equal(native.isnan(), with_torch.isnan())
    assert torch.equal(native.nan_to_num(), with_torch.nan_to_num())
    assert not torch.equal(native.nan_to_num(), logits.nan_to_num())
    edited = logits.clone()
    with edits.applied(edited):
        assert torch.equal(edited.nan_to_num(), native.nan_to_num())
    assert torch.equal(edited.nan_to_num(), logits.nan_to_num()) and torch.equal(edited.isnan(), logits.isnan())


@pytest.mark.parametrize("params, copies", [(dict(temperature=0.0), False), (dict(temperature=0.8, top_k=3), False),
                                            (dict(temperature=0.0, min_tokens=3), True),
                                            (dict(temperature=0.0, logit_bias={4: 9.0}), True),
                                            (dict(temperature=0.0, repetition_penalty=1.5), True)],
                         ids=["greedy", "top-k", "min-tokens", "logit-bias", "repetition"])
def test_sampling_leaves_the_callers_logits_as_they_were(params, copies):
    """Only what changes logits copies them (a plain step samples the runner's own tensor), and the
    caller's logits stay as they came: a failed step samples them again, one request at a time."""
    torch.manual_seed(0)
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    sampler = Sampler(VOCAB, torch.device("cpu"))
    rows = [request(f"r{i}", output=(5,), **params) for i in range(2)]
    sampler(logits, rows)
    assert torch.equal(logits, before)
    processed = sampler.process_logits(logits, rows)
    assert (processed is not logits) == copies


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    sampler = Sampler(4, torch.device("cpu"))
    early = request(output=(3,), temperature=0.0, min_tokens=2, stop_token_ids=(1,))
    assert sampler(logits, [early])[0] == [2]
    done = request(output=(3, 3), temperature=0.0, min_tokens=2, stop_token_ids=(1,))
    assert sampler(logits, [done])[0] == [0]


def test_logprobs_are_of_the_raw_distribution_with_rank_and_top():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    sampler = Sampler(4, torch.device("cpu"))
    # row 0 is pushed to token 3 by a bias; row 1 is greedy with 0 alternatives; logprobs ignore both
    rows = [request("a", temperature=0.0, logit_bias={3: 100.0}, logprobs=2),
            request("b", temperature=0.0, logprobs=0, repetition_penalty=1.5)]
    tokens, logprobs = sampler(logits, rows)
    raw = logits.double().log_softmax(-1)  # float32 results within a float32 rounding or two of these
    assert tokens == [3, 2]
    first, second = logprobs
    assert first.token_id == 3 and first.rank == 4
    assert first.logprob == pytest.approx(raw[0, 3].item(), abs=1e-6)
    assert [t for t, _ in first.top] == [1, 2]
    assert [lp for _, lp in first.top] == pytest.approx(raw[0, [1, 2]].tolist(), abs=1e-6)
    assert second.rank == 1 and second.top == [] and second.logprob == pytest.approx(raw[1, 2].item(), abs=1e-6)
    assert math.isclose(sum(math.exp(v) for v in raw[0].tolist()), 1.0, rel_tol=1e-6)
