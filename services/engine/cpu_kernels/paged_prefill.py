"""Paged prefill attention on the CPU (``paged_prefill.cpp``): each request's new tokens attend causally
to every position up to their own, read straight from the K/V block pools, so a cached prefix, an earlier
chunk of the same prompt and the chunk's own K/V (stored by the caller first) are one path, with no
gather and no mask tensor.

Per kv head and block of query tokens, the GQA group's query rows run an online softmax in float32 over
tiles of keys, as FMAs that keep every lane busy (no dot product reduced across lanes); tiles past a
block's last position are skipped. bfloat16 pools on a CPU with AVX512-BF16 multiply bfloat16 pairs
instead (scores, and P V with the weights rounded to bfloat16, as FlashAttention does on a GPU), twice
as fast and at times an output bit off (see the kernel), and on a CPU with AMX the same products run on
its tiles (``bf16_uses_amx``). Measured against
``scaled_dot_product_attention`` per request, the path it replaces for float32 on the CPU: see
``attention/torch_backend.py``.
"""

import ctypes
import functools

import torch

from services.engine.cpu_kernels import paged_decode
from services.engine.cpu_kernels.build import load_function


@functools.cache
def _kernel() -> ctypes._CFuncPtr | None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return load_function("paged_prefill.cpp", "strata_paged_prefill",
                         [ctypes.c_int32, ptr, ptr, ptr, ptr, ptr, ptr, ptr, *[i64] * 9, ctypes.c_float])


def is_available() -> bool:
    """Whether the native kernel is built and loaded here (else callers keep their torch path)."""
    return _kernel() is not None


def bf16_uses_amx(head_dim: int) -> bool:
    """Whether bfloat16 rows of ``head_dim`` run on AMX tiles here (a CPU with AMX that Linux grants the
    process, and a head_dim in whole tiles of 32)."""
    uses_amx = load_function("paged_prefill.cpp", "strata_paged_prefill_bf16_uses_amx", [ctypes.c_int64],
                             ctypes.c_int32)
    return uses_amx is not None and bool(uses_amx(head_dim))


def can_run(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether ``paged_prefill`` takes this shape and dtype here (the decode kernel's limits)."""
    return is_available() and paged_decode.can_run(num_heads, num_kv_heads, head_dim, dtype)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_start: torch.Tensor, context_lens: torch.Tensor, scale: float,
                  sliding_window: int | None = None) -> torch.Tensor:
    """``q: [T, heads, D]`` (unit stride along D), request ``r`` owning rows ``query_start[r] :
    query_start[r + 1]`` at positions ``context_lens[r]`` onwards; pools ``[num_blocks, block_size,
    kv_heads, D]`` of q's dtype (contiguous) holding the K/V of every position up to each request's last;
    ``block_tables: [R, max_blocks]``, ``query_start: [R + 1]``, ``context_lens: [R]``, all int64 → ``[T,
    heads, D]`` in q's dtype. Each row sees the positions up to its own; with ``sliding_window`` W, only
    the last W of them."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the native paged_prefill kernel is not built here; check is_available() first")
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    _check(q, k_cache, v_cache, block_tables, query_start, context_lens)
    if not can_run(num_heads, num_kv_heads, head_dim, q.dtype):
        raise ValueError(f"paged_prefill does not take {num_heads} heads over {num_kv_heads}, head_dim {head_dim}, "
                         f"{q.dtype}")
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
    num_reqs = context_lens.shape[0]
    if num_tokens:
        kernel(paged_decode.DTYPE_CODES[q.dtype], q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
               block_tables.data_ptr(), query_start.data_ptr(), context_lens.data_ptr(), out.data_ptr(), num_reqs,
               num_heads, num_kv_heads, head_dim, block_size, q.stride(0), q.stride(1), block_tables.stride(0),
               sliding_window or 0, scale)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           query_start: torch.Tensor, context_lens: torch.Tensor) -> None:
    paged_decode.check_q_and_pools("paged_prefill", q, k_cache, v_cache, block_tables=block_tables,
                                   query_start=query_start, context_lens=context_lens)
    num_reqs = context_lens.shape[0]
    for name, tensor, shape in (("query_start", query_start, (num_reqs + 1,)), ("context_lens", context_lens, (num_reqs,))):
        if tensor.dtype != torch.int64 or tensor.shape != shape or tensor.stride(0) != 1:
            raise ValueError(f"paged_prefill needs {name} int64 {list(shape)}, got {tensor.dtype} {tuple(tensor.shape)}")
    if (block_tables.dtype != torch.int64 or block_tables.dim() != 2 or block_tables.shape[0] != num_reqs
            or block_tables.stride(1) != 1):
        raise ValueError(f"paged_prefill needs int64 block_tables [{num_reqs}, max_blocks] with unit column stride, "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    if num_reqs and (int(query_start[0]) != 0 or int(query_start[-1]) != q.shape[0]):
        raise ValueError(f"paged_prefill needs query_start to run from 0 to the {q.shape[0]} rows of q")


def paged_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start: torch.Tensor, context_lens: torch.Tensor, scale: float,
                      sliding_window: int | None = None) -> torch.Tensor:
    """The same in plain torch, one request at a time, in float64: the reference of this kernel."""
    num_heads, block_size = q.shape[1], k_cache.shape[1]
    group = num_heads // k_cache.shape[2]
    outputs = []
    for req, context in enumerate(context_lens.tolist()):
        start, end = int(query_start[req]), int(query_start[req + 1])
        pos = torch.arange(context + end - start)
        blocks = block_tables[req, pos // block_size]
        k = k_cache[blocks, pos % block_size].double().repeat_interleave(group, 1)  # [S, heads, D]
        v = v_cache[blocks, pos % block_size].double().repeat_interleave(group, 1)
        q_pos = context + torch.arange(end - start).unsqueeze(1)  # [Q, 1]
        visible = pos <= q_pos
        if sliding_window:
            visible &= pos > q_pos - sliding_window
        scores = torch.einsum("qhd,shd->hqs", q[start:end].double(), k) * scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outputs.append(torch.einsum("hqs,shd->qhd", probs, v))
    return torch.cat(outputs).to(q.dtype) if outputs else q.new_empty(q.shape)
