"""The native CPU paged-decode kernel against its torch reference: odd context lengths, block sizes,
GQA groups, head dims (a tail that is not a multiple of 16 included), sliding windows, several requests
of different lengths on scattered blocks, contexts split across threads and merged, every pool dtype."""

import random

import pytest
import torch

from services.engine.cpu_kernels.paged_decode import is_available, paged_decode, paged_decode_ref

pytestmark = pytest.mark.skipif(not is_available(), reason="no C++ compiler: the native kernels are off")

TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
CONTEXTS = [1, 5, 123, 1023]  # one request each, in one batch


def make_batch(contexts, block_size, num_kv_heads, group, head_dim, dtype, seed=0):
    """q as a strided view (as the model's fused projection gives it), pools of scattered blocks."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in contexts) + 3
    free = rng.sample(range(num_blocks), num_blocks)
    width = max(-(-n // block_size) for n in contexts)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in contexts]
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    num_heads = num_kv_heads * group
    qkv = torch.randn(len(contexts), num_heads + 2 * num_kv_heads, head_dim).to(dtype)
    return qkv[:, :num_heads], k_cache, v_cache, block_tables, torch.tensor(contexts)


@pytest.mark.slow  # a 162-case shape sweep
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("group, head_dim", [(1, 128), (2, 64), (2, 72), (4, 80), (4, 64), (2, 36)])
@pytest.mark.parametrize("window", [None, 4, 600])
def test_matches_reference(dtype, block_size, group, head_dim, window):
    q, k_cache, v_cache, tables, seq_lens = make_batch(CONTEXTS, block_size, 2, group, head_dim, dtype)
    scale = head_dim ** -0.5
    out = paged_decode(q, k_cache, v_cache, tables, seq_lens, scale, window)
    expected = paged_decode_ref(q, k_cache, v_cache, tables, seq_lens, scale, window)
    assert out.dtype == dtype and out.shape == q.shape
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


@pytest.mark.slow  # long contexts in every dtype
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("contexts", [[1023], [5, 700, 1, 300], [2000, 17]])
def test_split_contexts_merge_to_the_reference(dtype, window, contexts):
    """Small chunks split every long context across work items, whose partials are merged."""
    q, k_cache, v_cache, tables, seq_lens = make_batch(contexts, 16, 4, 2, 64, dtype, seed=1)
    out = paged_decode(q, k_cache, v_cache, tables, seq_lens, 0.125, window, min_chunk_tokens=16)
    expected = paged_decode_ref(q, k_cache, v_cache, tables, seq_lens, 0.125, window)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


def test_large_scores_stay_finite():
    """Scores far from zero (a sharp softmax) must not overflow the exponentials."""
    q, k_cache, v_cache, tables, seq_lens = make_batch([300, 40], 16, 1, 4, 64, torch.float32, seed=2)
    out = paged_decode(q * 30, k_cache, v_cache, tables, seq_lens, 1.0, min_chunk_tokens=16)
    torch.testing.assert_close(out, paged_decode_ref(q * 30, k_cache, v_cache, tables, seq_lens, 1.0),
                               rtol=2e-5, atol=2e-5)


def test_refuses_what_it_cannot_read():
    q, k_cache, v_cache, tables, seq_lens = make_batch([5], 8, 2, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="pools of q's dtype"):
        paged_decode(q, k_cache.bfloat16(), v_cache.bfloat16(), tables, seq_lens, 0.125)
    with pytest.raises(ValueError, match="contiguous pools"):
        paged_decode(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), tables, seq_lens, 0.125)
    with pytest.raises(ValueError, match="int64"):
        paged_decode(q, k_cache, v_cache, tables.int(), seq_lens, 0.125)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode(q, k_cache, v_cache, tables, seq_lens[:0], 0.125)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        paged_decode(q.double(), k_cache.double(), v_cache.double(), tables, seq_lens, 0.125)


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("num_kv_heads, group", [(1, 8), (8, 1), (32, 1)])
def test_one_and_many_kv_heads(dtype, num_kv_heads, group):
    """Each tile of tokens is attended for every kv head in turn (their rows side by side in the pool):
    multi-query attention's one kv head, and many kv heads of one query head each (multi-head)."""
    q, k_cache, v_cache, tables, seq_lens = make_batch([5, 300, 1023], 16, num_kv_heads, group, 64, dtype, seed=2)
    out = paged_decode(q, k_cache, v_cache, tables, seq_lens, 0.125, None)
    expected = paged_decode_ref(q, k_cache, v_cache, tables, seq_lens, 0.125, None)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
