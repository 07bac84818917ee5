"""The native CPU paged-prefill kernel against its float64 torch reference: requests with and without a
cached prefix (an earlier chunk), one-token and long chunks, odd head dims and GQA groups, sliding
windows, scattered blocks, every pool dtype; and the inputs it refuses."""

import pytest
import torch

from services.engine.cpu_kernels.paged_prefill import is_available, paged_prefill, paged_prefill_ref
from tests.engine.test_cpu_paged_decode import make_batch as paged_decode_batch

pytestmark = pytest.mark.skipif(not is_available(), reason="no C++ compiler: the native kernels are off")

TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
# (positions already cached, new tokens) per request, in one call
REQUESTS = [(0, 37), (20, 5), (0, 1), (100, 130), (7, 64)]


def make_batch(requests, block_size, num_kv_heads, group, head_dim, dtype, seed=0):
    """q as a strided view of a fused qkv (as the model gives it); pools of scattered blocks holding
    every position of every request (the caller stores the new tokens' K/V before attending), built as
    the decode kernel's test builds them."""
    totals = [cached + new for cached, new in requests]
    _, k_cache, v_cache, block_tables, _ = paged_decode_batch(totals, block_size, num_kv_heads, group, head_dim,
                                                              dtype, seed)
    num_heads = num_kv_heads * group
    qkv = torch.randn(sum(new for _, new in requests), num_heads + 2 * num_kv_heads, head_dim).to(dtype)
    news = torch.tensor([new for _, new in requests])
    query_start = torch.cat([torch.zeros(1, dtype=torch.int64), news.cumsum(0)])
    return qkv[:, :num_heads], k_cache, v_cache, block_tables, query_start, torch.tensor([c for c, _ in requests])


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("group, head_dim", [(2, 64), (1, 128), (4, 80), (3, 72), (16, 64), (2, 33)])
@pytest.mark.parametrize("window", [None, 5, 100])
def test_matches_reference(dtype, group, head_dim, window):
    batch = make_batch(REQUESTS, 16, 2, group, head_dim, dtype)
    scale = head_dim ** -0.5
    out = paged_prefill(*batch, scale, window)
    expected = paged_prefill_ref(*batch, scale, window)
    assert out.dtype == dtype and out.shape == batch[0].shape
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_block_sizes_and_a_long_chunk(block_size):
    """Chunks longer than a work item's block of queries, and key tiles that cross blocks of the pool."""
    batch = make_batch([(300, 700), (0, 2)], block_size, 4, 2, 64, torch.float32, seed=3)
    torch.testing.assert_close(paged_prefill(*batch, 0.125), paged_prefill_ref(*batch, 0.125), rtol=2e-5, atol=2e-5)


def test_refuses_inputs_it_cannot_read():
    q, k_cache, v_cache, tables, starts, contexts = make_batch([(0, 4)], 16, 2, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="pools of q's dtype"):
        paged_prefill(q, k_cache.bfloat16(), v_cache, tables, starts, contexts, 0.125)
    with pytest.raises(ValueError, match="query_start"):
        paged_prefill(q, k_cache, v_cache, tables, torch.tensor([0, 3]), contexts, 0.125)
    with pytest.raises(ValueError, match="unit stride"):
        paged_prefill(torch.randn(4, 4, 128)[..., ::2], k_cache, v_cache, tables, starts, contexts, 0.125)
    with pytest.raises(ValueError, match="block_tables"):
        paged_prefill(q, k_cache, v_cache, tables.int(), starts, contexts, 0.125)
