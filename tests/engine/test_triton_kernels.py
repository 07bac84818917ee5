"""The Triton kernels against their torch references: compiled on a GPU when there is one, else on
the CPU under TRITON_INTERPRET=1 (set in tests/conftest.py): paged decode over scattered blocks with GQA groups of 1-4,
a head size that is not a power of two, partial last blocks and sliding windows; and the KV store
from the strided K/V views the model hands it."""

import pytest
import torch

triton = pytest.importorskip("triton")

from services.engine.cpu_kernels.paged_decode import paged_decode_ref  # noqa: E402
from services.engine.kernels.kv_store import kv_store, kv_store_reference  # noqa: E402
from services.engine.kernels.paged_decode import paged_decode  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter computes in numpy, which has no bfloat16
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def scattered_pools(num_heads, num_kv_heads, head_dim, block_size, seq_lens, dtype, seed=0):
    torch.manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_blocks)
    width = max(-(-n // block_size) for n in seq_lens)
    tables, used = torch.zeros(len(seq_lens), width, dtype=torch.int64), 0
    for i, n in enumerate(seq_lens):
        count = -(-n // block_size)
        tables[i, :count] = order[used:used + count]
        used += count
    q = torch.randn(len(seq_lens), num_heads, head_dim).to(dtype)
    return (t.to(DEVICE) for t in (q, k_cache, v_cache, tables, torch.tensor(seq_lens)))


@pytest.mark.slow  # a shape sweep, in the interpreter without a GPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 16), (4, 2, 32), (8, 2, 24)])
@pytest.mark.parametrize("window", [None, 5, 20, 100])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_paged_decode_matches_reference(dtype, heads, kv_heads, head_dim, window, num_splits):
    """Contexts of one position to several tiles, whole or split into runs combined afterwards (some
    of them empty)."""
    seq_lens = [1, 7, 8, 9, 30, 150]
    q, k_cache, v_cache, tables, seq_lens = scattered_pools(heads, kv_heads, head_dim, 8, seq_lens, dtype)
    scale = head_dim ** -0.5
    out = paged_decode(q, k_cache, v_cache, tables, seq_lens, scale, window, num_splits=num_splits)
    expected = paged_decode_ref(q, k_cache, v_cache, tables, seq_lens, scale, window)
    torch.testing.assert_close(out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_splits_fill_the_gpu_and_are_powers_of_two():
    from services.engine.kernels.paged_decode import MAX_SPLITS, num_splits_for

    assert num_splits_for(1, 8, torch.device("cpu")) == 1
    if DEVICE == "cuda":
        assert num_splits_for(1, 8, torch.device("cuda")) == MAX_SPLITS  # 8 programs on 100+ multiprocessors
        assert num_splits_for(512, 8, torch.device("cuda")) == 1
    q, k_cache, v_cache, tables, seq_lens = scattered_pools(4, 2, 16, 8, [9], torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode(q, k_cache, v_cache, tables, seq_lens, 0.25, num_splits=3)


def test_paged_decode_reference_is_attention():
    """The reference itself, against SDPA on the gathered context."""
    q, k_cache, v_cache, tables, seq_lens = scattered_pools(4, 2, 16, 4, [11], torch.float32)
    pos = torch.arange(11, device=DEVICE)
    k = k_cache[tables[0, pos // 4], pos % 4].transpose(0, 1)  # [kv_heads, S, D]
    v = v_cache[tables[0, pos // 4], pos % 4].transpose(0, 1)
    expected = torch.nn.functional.scaled_dot_product_attention(q[0].unsqueeze(1), k, v, enable_gqa=True)
    torch.testing.assert_close(paged_decode_ref(q, k_cache, v_cache, tables, seq_lens, 0.25),
                               expected.squeeze(1).unsqueeze(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_store_writes_strided_rows_at_their_slots(dtype):
    torch.manual_seed(1)
    heads, kv_heads, head_dim, tokens = 4, 2, 12, 9
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim).to(dtype).to(DEVICE)  # the model's fused projection
    k, v = qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    slots = torch.randperm(6 * 8)[:tokens].to(DEVICE)
    caches = [torch.zeros(6, 8, kv_heads, head_dim, dtype=dtype, device=DEVICE) for _ in range(4)]
    kv_store(k, v, caches[0], caches[1], slots)
    kv_store_reference(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, with_residual):
    from services.engine.kernels.rms_norm import rms_norm, rms_norm_reference

    torch.manual_seed(2)
    x, weight = torch.randn(5, 48).to(dtype).to(DEVICE), torch.randn(48).to(dtype).to(DEVICE)
    residual = torch.randn(5, 48).to(dtype).to(DEVICE) if with_residual else None
    residual_copy = residual.clone() if with_residual else None
    out = rms_norm(x, weight, 1e-6, residual)
    expected = rms_norm_reference(x, weight, 1e-6, residual_copy)
    torch.testing.assert_close(out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    if with_residual:
        torch.testing.assert_close(residual, residual_copy, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(dtype):
    from services.engine.kernels.activation import silu_mul, silu_mul_reference

    torch.manual_seed(3)
    gate_up = torch.randn(4, 2 * 1100).to(dtype).to(DEVICE)  # an intermediate size over one 1024-wide program
    torch.testing.assert_close(silu_mul(gate_up), silu_mul_reference(gate_up), rtol=TOLERANCE[dtype],
                               atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_the_models_rotation(dtype):
    from services.engine.kernels.rotary import rotary_
    from services.engine.models.config import RopeConfig
    from services.engine.models.rope import RotaryEmbedding, apply_rotary_

    torch.manual_seed(4)
    heads, kv_heads, head_dim = 4, 2, 24
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, 64, torch.float32, torch.device(DEVICE))
    cos, sin = rope.tables(torch.tensor([0, 3, 17, 63, 5], device=DEVICE))
    cos, sin = cos.to(dtype), sin.to(dtype)
    qkv = torch.randn(5, heads + 2 * kv_heads, head_dim).to(dtype).to(DEVICE)
    qk = qkv[:, :heads + kv_heads]  # the strided view the model rotates
    expected = qk.clone()
    apply_rotary_(expected, cos, sin)
    rotary_(qk, cos, sin)
    torch.testing.assert_close(qk, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.slow  # a shape sweep, in the interpreter without a GPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (6, 3, 24)])
@pytest.mark.parametrize("window", [None, 7, 40])
def test_paged_prefill_matches_reference(dtype, heads, kv_heads, head_dim, window):
    """Chunks with and without a cached prefix, shorter and longer than a query tile, one row long."""
    from services.engine.kernels.paged_prefill import paged_prefill

    chunks = [(0, 5), (20, 19), (16, 1), (3, 40)]  # (cached tokens, new rows)
    seq_lens = [c + n for c, n in chunks]
    _, k_cache, v_cache, tables, _ = scattered_pools(heads, kv_heads, head_dim, 16, seq_lens, dtype, seed=5)
    starts = torch.tensor([0] + list(torch.tensor([n for _, n in chunks]).cumsum(0))).to(DEVICE)
    q = torch.randn(int(starts[-1]), heads, head_dim).to(dtype).to(DEVICE)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    paged_prefill(q, k_cache, v_cache, tables, starts, torch.tensor([c for c, _ in chunks], device=DEVICE), 0, len(chunks),
                  max(n for _, n in chunks), scale, out, window)
    for i, (cached, new) in enumerate(chunks):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        for j in range(new):  # each row is a decode of its own position
            pos = cached + j
            expected = paged_decode_ref(q[rows][j:j + 1], k_cache, v_cache, tables[i:i + 1],
                                              torch.tensor([pos + 1], device=DEVICE), scale, window)
            torch.testing.assert_close(out[rows][j:j + 1], expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
