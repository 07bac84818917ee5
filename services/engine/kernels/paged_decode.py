"""Paged attention for decode: one new query token per request against its context in the block
pool, in one pass with an online softmax (no copy of the cache).

One program per (request, KV head) handles the query heads that share that KV head (GQA), so each
K/V row is read once for the whole group. Scores and weighted sums are elementwise products and
reductions rather than ``tl.dot``: a group has 1-8 rows, below the 16 ``tl.dot`` needs, and decode
is bound by reading the cache, not by arithmetic. A sliding window skips whole blocks before it.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
    scale, window,
    stride_q_req, stride_q_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_table_req,
    stride_out_req, stride_out_head,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req)
    first = tl.maximum(seq_len - tl.where(window > 0, window, seq_len), 0)  # window 0: from the start

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + req * stride_q_req + heads[:, None] * stride_q_head + d[None, :], mask=q_mask, other=0.0)
    q = q.to(tl.float32) * scale  # [GROUP_PAD, DIM_PAD]

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max
    l = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    slots = tl.arange(0, BLOCK_SIZE)
    for b in range(first // BLOCK_SIZE, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + req * stride_table_req + b).to(tl.int64)
        pos = b * BLOCK_SIZE + slots
        valid = (pos < seq_len) & (pos >= first)
        kv_offsets = (block * stride_cache_block + slots[:, None] * stride_cache_slot
                      + kv_head * stride_cache_head + d[None, :])
        kv_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_SIZE, DIM_PAD]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, BLOCK_SIZE]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new

    out = acc / l[:, None]
    tl.store(out_ptr + req * stride_out_req + heads[:, None] * stride_out_head + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """``q: [R, heads, D]`` (one token per request), pools ``[num_blocks, block_size, kv_heads, D]``,
    ``block_tables: [R, max_blocks]``, ``seq_lens: [R]`` (context including the new token, whose K/V
    is already stored) → ``[R, heads, D]``."""
    num_reqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if block_size & (block_size - 1) or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged_decode needs a power-of-two block size and unit-stride head dims")
    out = torch.empty_like(q)
    group = num_heads // num_kv_heads
    _paged_decode_kernel[(num_reqs, num_kv_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, out,
        scale, sliding_window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group),
        HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
    )
    return out

