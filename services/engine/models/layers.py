"""Building blocks of the Llama family: RMSNorm with the residual add folded in, and the gated MLP.

On the CPU both run as native passes over the rows where they can (``cpu_kernels/fused_ops``); on a
GPU with ``use_kernel``, as Triton kernels; else as torch ops."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from services.engine.cpu_kernels import fused_ops


def empty_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device) -> nn.Linear:
    """A Linear whose weights are left uninitialised: the loader fills them from the checkpoint."""
    return skip_init(nn.Linear, in_features, out_features, bias=bias, dtype=dtype, device=device)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device,
                 use_kernel: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device))
        self.eps = eps
        self.use_kernel = use_kernel  # the Triton kernel (services/engine/kernels/rms_norm.py)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: ``norm(x)``. With it: ``(norm(x + residual), x + residual)``, the sum
        accumulated in place into ``residual``."""
        if self.use_kernel:
            from services.engine.kernels.rms_norm import rms_norm

            out = rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if fused_ops.can_norm(x, residual, self.weight):
            out = fused_ops.add_rms_norm(x, residual, self.weight, self.eps)  # one native pass over the rows
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        residual.add_(x)
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # HF normalises in float32 and casts back before scaling by the weight.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one projection."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype,
                 device: torch.device, use_kernel: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.use_kernel = use_kernel  # the Triton silu_mul (services/engine/kernels/activation.py)
        self.gate_up_proj = empty_linear(hidden_size, 2 * intermediate_size, bias, dtype, device)
        self.down_proj = empty_linear(intermediate_size, hidden_size, bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * I]
        if self.use_kernel:
            from services.engine.kernels.activation import silu_mul

            return self.down_proj(silu_mul(gate_up))
        if fused_ops.serves(gate_up):
            return self.down_proj(fused_ops.silu_mul(gate_up))  # one native pass over the rows
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # [T, I] each, strided
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))  # [T, H]
