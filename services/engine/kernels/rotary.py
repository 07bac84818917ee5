"""Rotary embedding in place on the step's ``[T, heads, D]`` query and key rows (the model's fused
q/k view, rows strided), with the ``(cos, sin)`` tables of ``models/rope.py``: for the halves
``x1, x2`` of each head, ``x1 <- x1 * cos1 + x2 * sin2`` and ``x2 <- x2 * cos2 + x1 * sin1`` (the
tables carry the signs), as ``apply_rotary_`` computes it."""

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, stride_token, stride_head, stride_table,
                   HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < HEADS) & (i < HALF)
    row = x_ptr + token * stride_token + h * stride_head
    x1 = tl.load(row + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + i, mask=mask, other=0.0).to(tl.float32)
    table = token * stride_table + i
    cos1 = tl.load(cos_ptr + table, mask=i < HALF, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + table + HALF, mask=i < HALF, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + table, mask=i < HALF, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + table + HALF, mask=i < HALF, other=0.0).to(tl.float32)
    tl.store(row + i, (x1 * cos1 + x2 * sin2).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(row + HALF + i, (x2 * cos2 + x1 * sin1).to(x_ptr.dtype.element_ty), mask=mask)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """``x: [T, heads, D]`` (heads and dims contiguous within a token) rotated in place; ``cos, sin:
    [T, 1, D]``."""
    num_tokens, heads, head_dim = x.shape
    if x.stride(2) != 1 or cos.stride(2) != 1 or sin.stride() != cos.stride():
        raise ValueError("rotary_ needs unit-stride head dims and same-shaped tables")
    if num_tokens:
        _rotary_kernel[(num_tokens,)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0),
                                      HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads),
                                      HALF=head_dim // 2, HALF_PAD=triton.next_power_of_2(head_dim // 2))
