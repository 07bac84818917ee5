"""RMSNorm with the residual add folded in: ``residual += x; out = norm(residual) * weight``, one
program per token, normalising in float32 and rounding as HF does for 16-bit models (the normalised
value is cast to the model's dtype before the weight multiplies it)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_residual, stride_out, eps,
                     HIDDEN: tl.constexpr, HIDDEN_PAD: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, HIDDEN_PAD)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * stride_residual + offs, mask=mask, other=0.0)
        tl.store(residual_ptr + row * stride_residual + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / HIDDEN + eps)
    normed = (x32 * rstd).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x: [T, H]``; with ``residual`` (``[T, H]``, updated in place to ``x + residual``) the norm is
    of the sum. Returns the normalised ``[T, H]``."""
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    if num_tokens:
        _rms_norm_kernel[(num_tokens,)](
            x, residual if residual is not None else x, weight, out, x.stride(0),
            residual.stride(0) if residual is not None else 0, out.stride(0), eps,
            HIDDEN=hidden, HIDDEN_PAD=triton.next_power_of_2(hidden), HAS_RESIDUAL=residual is not None)
    return out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
    if residual is not None:
        residual.add_(x)
        x = residual
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype)
