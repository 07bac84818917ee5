"""Paged decode attention on the CPU (``paged_decode.cpp``): one new query token per request, read
straight from the K/V block pools, with no gather, no padding to the longest context and no mask.

Each (request, kv_head) reads its K/V rows once for the whole GQA group, accumulates in float32 with
an online softmax, and long contexts are split into chunks merged afterwards, so both cores work even
at batch 1. Pools of float32, bfloat16 or float16 (AVX-512 where the CPU has it, else AVX2 with FMA, else
scalar code; ``isa.h``).
"""

import ctypes
import functools

import torch

from services.engine.cpu_kernels.build import load_function

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# The shortest context span one work item attends when a long context is split across threads.
MIN_CHUNK_TOKENS = 256


@functools.cache
def _paged_decode_kernel() -> ctypes._CFuncPtr | None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return load_function("paged_decode.cpp", "strata_paged_decode",
                         [ctypes.c_int32, ptr, ptr, ptr, ptr, ptr, ptr, *[i64] * 9, ctypes.c_float, i64])


@functools.cache
def _limits() -> tuple[int, int]:
    max_group = load_function("paged_decode.cpp", "strata_paged_decode_max_group", [], ctypes.c_int64)
    max_head_dim = load_function("paged_decode.cpp", "strata_paged_decode_max_head_dim", [], ctypes.c_int64)
    return max_group(), max_head_dim()


def is_available() -> bool:
    """Whether the native kernel is built and loaded here (else callers keep their torch path)."""
    return _paged_decode_kernel() is not None


def can_run(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether ``paged_decode`` takes this shape and dtype on this machine."""
    if not is_available() or dtype not in DTYPE_CODES:
        return False
    max_group, max_head_dim = _limits()
    return num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= max_group and head_dim <= max_head_dim


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                 min_chunk_tokens: int = MIN_CHUNK_TOKENS) -> torch.Tensor:
    """``q: [R, heads, D]`` (one token per request, unit stride along D), pools ``[num_blocks, block_size,
    kv_heads, D]`` of q's dtype (contiguous), ``block_tables: [R, max_blocks]`` int64, ``seq_lens: [R]``
    int64 (each >= 1: the context including the new token, whose K/V is already stored) → ``[R, heads, D]``
    in q's dtype. With ``sliding_window`` W the query sees only the last W positions."""
    kernel = _paged_decode_kernel()
    if kernel is None:
        raise RuntimeError("the native paged_decode kernel is not built here; check is_available() first")
    num_reqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    _check(q, k_cache, v_cache, block_tables, seq_lens)
    if not can_run(num_heads, num_kv_heads, head_dim, q.dtype):
        raise ValueError(f"paged_decode takes at most {_limits()[0]} query heads per kv head and head_dim "
                         f"{_limits()[1]}; got {num_heads} heads over {num_kv_heads}, head_dim {head_dim}")
    out = torch.empty(num_reqs, num_heads, head_dim, dtype=torch.float32)
    if num_reqs:
        kernel(DTYPE_CODES[q.dtype], q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
               seq_lens.data_ptr(), out.data_ptr(), num_reqs, num_heads, num_kv_heads, head_dim, block_size,
               q.stride(0), q.stride(1), block_tables.stride(0), sliding_window or 0, scale, min_chunk_tokens)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def check_q_and_pools(kernel: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      **index_tensors: torch.Tensor) -> None:
    """What the native attention kernels (``kernel``: its name, for the errors) need of every input: all on
    the CPU; q ``[rows, heads, D]`` of a dtype they take, unit stride along D; contiguous pools of q's
    dtype ``[blocks, block_size, kv_heads, D]``."""
    for name, tensor in {"q": q, "k_cache": k_cache, "v_cache": v_cache, **index_tensors}.items():
        if tensor.device.type != "cpu":
            raise ValueError(f"{kernel} runs on the CPU; {name} is on {tensor.device}")
    if q.dtype not in DTYPE_CODES:
        raise ValueError(f"{kernel} takes float32, bfloat16 or float16, not {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"{kernel} needs pools of q's dtype {q.dtype}, got {k_cache.dtype} and {v_cache.dtype}")
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"{kernel} needs q [rows, heads, D] and equal pools [blocks, block_size, kv_heads, D]; "
                         f"got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if q.stride(2) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError(f"{kernel} needs contiguous pools and q with unit stride along head_dim")


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor) -> None:
    check_q_and_pools("paged_decode", q, k_cache, v_cache, block_tables=block_tables, seq_lens=seq_lens)
    if block_tables.dtype != torch.int64 or seq_lens.dtype != torch.int64:
        raise ValueError(f"paged_decode needs int64 block_tables and seq_lens, got {block_tables.dtype}, "
                         f"{seq_lens.dtype}")
    if (block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0] or block_tables.stride(1) != 1
            or seq_lens.shape != (q.shape[0],) or seq_lens.stride(0) != 1):
        raise ValueError(f"paged_decode needs block_tables [R, max_blocks] with unit column stride and seq_lens "
                         f"[R] for R = {q.shape[0]}; got {tuple(block_tables.shape)}, {tuple(seq_lens.shape)}")


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """The same in plain torch, one request at a time, in float64, on q's device: the reference of this
    kernel and of the Triton one (``kernels/paged_decode.py``)."""
    num_heads, block_size = q.shape[1], k_cache.shape[1]
    group = num_heads // k_cache.shape[2]
    outputs = []
    for req, seq_len in enumerate(seq_lens.tolist()):
        first = max(0, seq_len - sliding_window) if sliding_window else 0
        pos = torch.arange(first, seq_len, device=q.device)
        blocks = block_tables[req, pos // block_size]
        k = k_cache[blocks, pos % block_size].double().repeat_interleave(group, 1)  # [S, heads, D]
        v = v_cache[blocks, pos % block_size].double().repeat_interleave(group, 1)
        probs = (torch.einsum("hd,shd->hs", q[req].double(), k) * scale).softmax(-1)
        outputs.append(torch.einsum("hs,shd->hd", probs, v))
    return torch.stack(outputs).to(q.dtype)
