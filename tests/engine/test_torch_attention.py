"""The torch attention backend against a naive reference: every path (native decode, sparse decode,
gathered decode, native prefill, SDPA prefill with and without a cached prefix), with and without a sliding window, on
scattered blocks."""

import random

import pytest
import torch

from services.engine.attention import AttentionMetadata
from services.engine.attention.torch_backend import TorchAttentionBackend
from services.engine.cpu_kernels import paged_decode, paged_prefill

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 8, 4
NUM_BLOCKS = 64


def reference(q, keys, values, positions, window):
    """q: [Q, heads, D] at ``positions``; keys/values: [S, kv_heads, D] of positions 0..S-1."""
    group = HEADS // KV_HEADS
    k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [S, heads, D]
    scores = torch.einsum("qhd,shd->hqs", q, k) * HEAD_DIM ** -0.5
    kv_pos = torch.arange(keys.shape[0])
    allowed = kv_pos <= positions.unsqueeze(1)
    if window:
        allowed &= kv_pos > positions.unsqueeze(1) - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v)


# decode path -> (the dtype the backend is built for, whether it may use the native kernel)
DECODE_PATHS = {"native": (torch.float32, True), "sparse": (torch.float32, False),
                "gathered": (torch.bfloat16, False)}  # bf16 without the native kernel picks the gather


@pytest.mark.parametrize("window", [None, 5, 16])
@pytest.mark.parametrize("decode_path", list(DECODE_PATHS))
def test_every_path_matches_reference(window, decode_path):
    if decode_path == "native" and not paged_decode.is_available():
        pytest.skip("no C++ compiler: the native kernels are off")
    rng = random.Random(7)
    torch.manual_seed(7)
    # (tokens already cached, new tokens): decodes first, as the model runner orders them
    requests = [(9, 1), (30, 1), (2, 1), (0, 12), (0, 3), (13, 11), (20, 1 + 6)]
    decodes = sum(1 for _, new in requests if new == 1)
    free_blocks = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    tables, full_k, full_v, rows = [], [], [], []
    slot_mapping, q_all, k_new, v_new = [], [], [], []
    for cached, new in requests:
        total = cached + new
        table = [free_blocks.pop() for _ in range(-(-total // BLOCK))]
        keys, values = torch.randn(total, KV_HEADS, HEAD_DIM), torch.randn(total, KV_HEADS, HEAD_DIM)
        for pos in range(total):
            slot = table[pos // BLOCK] * BLOCK + pos % BLOCK
            if pos < cached:  # already in the pool
                k_cache.view(-1, KV_HEADS, HEAD_DIM)[slot] = keys[pos]
                v_cache.view(-1, KV_HEADS, HEAD_DIM)[slot] = values[pos]
            else:
                slot_mapping.append(slot)
        q = torch.randn(new, HEADS, HEAD_DIM)
        q_all.append(q), k_new.append(keys[cached:]), v_new.append(values[cached:])
        tables.append(table), full_k.append(keys), full_v.append(values)
        rows.append((q, torch.arange(cached, total)))
    width = max(map(len, tables))
    new_counts = torch.tensor([new for _, new in requests])
    metadata = AttentionMetadata(
        num_decodes=decodes, num_prefills=len(requests) - decodes,
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), new_counts.cumsum(0)]),
        seq_lens=torch.tensor([c + n for c, n in requests]), context_lens=torch.tensor([c for c, _ in requests]),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        slot_mapping=torch.tensor(slot_mapping), max_query_len=int(new_counts.max()),
        max_seq_len=max(c + n for c, n in requests), block_size=BLOCK)
    dtype, use_native_decode = DECODE_PATHS[decode_path]
    backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, dtype, use_native_decode)
    prepared = backend.prepare(metadata)
    out = backend.forward(torch.cat(q_all), torch.cat(k_new), torch.cat(v_new), k_cache, v_cache, prepared, window)
    expected = torch.cat([reference(q, k, v, pos, window) for (q, pos), k, v in zip(rows, full_k, full_v)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # the second layer of the step reuses the index the first one built
    assert list(prepared.indices) == [window]
    index = prepared.indices[window]
    taken = [name for name, taken in [("native", index.native_decode), ("sparse", index.sparse_decode is not None),
                                      ("gathered", index.gathered_decode is not None)] if taken]
    assert taken == [decode_path]
    # float32 prefill rows take the native kernel where decode rows may (none left for SDPA); bfloat16 SDPA
    assert (index.native_prefill_starts is not None) == (decode_path == "native")
    assert not index.prefills if decode_path == "native" else len(index.prefills) == len(requests) - decodes


@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_prefill_takes_the_native_kernel_where_it_keeps_up_with_sdpa(dtype, head_dim):
    if not paged_decode.is_available():
        pytest.skip("no C++ compiler: the native kernels are off")
    backend = TorchAttentionBackend(HEADS, KV_HEADS, head_dim, head_dim ** -0.5, dtype)
    # bfloat16: SDPA where the CPU has AMX tiles for it that the kernel does not use (a head_dim of 8),
    # the native kernel elsewhere
    amx = torch.cpu._is_amx_tile_supported()
    assert paged_prefill.bf16_uses_amx(head_dim) == (amx and head_dim % 32 == 0)
    assert backend.use_native_prefill == (dtype != torch.bfloat16 or not amx or head_dim % 32 == 0)
    assert not TorchAttentionBackend(HEADS, KV_HEADS, head_dim, head_dim ** -0.5, dtype, False).use_native_prefill
