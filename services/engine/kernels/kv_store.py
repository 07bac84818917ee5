"""Writes the step's new K and V rows into the block pools at their slots (vLLM's reshape_and_cache):
one program per token copies its ``kv_heads * head_dim`` values, contiguous on both sides."""

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_store_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, stride_k_token, stride_v_token,
                     ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)
    mask = offs < ROW
    k = tl.load(k_ptr + token * stride_k_token + offs, mask=mask)
    v = tl.load(v_ptr + token * stride_v_token + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def kv_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """``k, v: [T, kv_heads, D]`` (rows may be strided, heads and dims contiguous) into contiguous pools
    ``[num_blocks, block_size, kv_heads, D]`` at ``slot_mapping: [T]``."""
    num_tokens, num_kv_heads, head_dim = k.shape
    row = num_kv_heads * head_dim
    for t in (k, v):
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError("kv_store needs each token's heads and dims contiguous")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("kv_store needs contiguous pools")
    if num_tokens:
        _kv_store_kernel[(num_tokens,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                                        ROW=row, ROW_PAD=triton.next_power_of_2(row))


def kv_store_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)
