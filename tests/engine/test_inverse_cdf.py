import numpy as np
import pytest
import torch

from services.engine.inverse_cdf import CHUNK, inverse_cdf_draw


def reference(probs: torch.Tensor, uniforms: torch.Tensor) -> list[int]:
    """The first token whose float64 running sum passes u × the row's mass, over the whole row."""
    out = []
    for row, u in zip(probs.double().numpy(), uniforms.double().numpy()):
        running = np.cumsum(row)
        out.append(int(np.searchsorted(running, u * running[-1], side="right")))
    return out


@pytest.mark.parametrize("vocab", [7, CHUNK, 3 * CHUNK + 5])
def test_draws_match_the_running_sum_over_the_whole_row(vocab):
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(64, vocab, generator=generator) ** 4  # uneven, not normalised
    probs[probs < 0.05] = 0.0
    uniforms = torch.rand(64, dtype=torch.float64, generator=generator)
    assert inverse_cdf_draw(probs, uniforms).tolist() == reference(probs, uniforms)


def test_never_draws_a_token_of_probability_zero_at_either_end():
    vocab = 2 * CHUNK + 100
    probs = torch.zeros(4, vocab)
    probs[0, 5] = probs[0, CHUNK + 3] = 1.0  # last positive token in the middle chunk, the rest zeros
    probs[1, vocab - 1] = 1.0  # only the very last token
    probs[2, 0] = 1e-30  # a tiny mass first, then zeros, then the bulk
    probs[2, CHUNK - 1] = 1.0
    probs[3, 10:20] = 0.1
    below_one = 1.0 - 2.0 ** -53
    for u in (0.0, 0.5, below_one):
        tokens = inverse_cdf_draw(probs, torch.full((4,), u, dtype=torch.float64))
        assert (probs.gather(1, tokens.unsqueeze(1)) > 0).all(), (u, tokens)
    ends = inverse_cdf_draw(probs, torch.full((4,), below_one, dtype=torch.float64)).tolist()
    assert ends == [CHUNK + 3, vocab - 1, CHUNK - 1, 19]
    starts = inverse_cdf_draw(probs, torch.zeros(4, dtype=torch.float64)).tolist()
    assert starts == [5, vocab - 1, 0, 10]


def test_frequencies_follow_the_distribution_across_chunks():
    vocab = 3 * CHUNK
    probs = torch.zeros(vocab)
    probs[[3, CHUNK + 7, 2 * CHUNK + 1, vocab - 1]] = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 20000
    uniforms = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    tokens = inverse_cdf_draw(probs.expand(n, vocab), uniforms)
    counts = torch.bincount(tokens, minlength=vocab).double() / n
    assert counts.sum() == 1 and counts[[3, CHUNK + 7, 2 * CHUNK + 1, vocab - 1]].sum() == 1
    torch.testing.assert_close(counts[[3, CHUNK + 7, 2 * CHUNK + 1, vocab - 1]],
                               torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64), atol=0.015, rtol=0)


def test_a_row_without_mass_gets_its_argmax_and_leaves_the_others_alone():
    probs = torch.tensor([[float("nan")] * 5, [0.0] * 5, [0.0, 0.0, 1.0, 0.0, 0.0]])
    tokens = inverse_cdf_draw(probs, torch.full((3,), 0.7, dtype=torch.float64))
    assert tokens.tolist() == [probs[0].argmax().item(), 0, 2]
