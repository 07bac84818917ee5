"""Weight-only int8 projections on the CPU (``--quantization int8``), as TGI's ``eetq`` or llama.cpp's
8-bit weights: each projection's weight, the logits head's included, is rounded to int8 as the
checkpoint loads, with a float32 scale per output row (symmetric: the row's largest magnitude maps to
127), and multiplies bfloat16 activations with float32 sums (``cpu_kernels/linear``'s ``int8_linear``).

Why: at a few rows a decode step reads every weight once for two FLOPs each, so it runs at the speed
the weights stream from memory; int8 streams half of bfloat16's bytes and holds half the memory. The
price is the rounding (per output row, at most half a step of ``max|w| / 127``); activations, norms,
the embeddings and the K/V cache stay bfloat16.

Every batch runs the native kernel (past 8 rows on AMX tiles where the CPU has them, each panel turned
into bfloat16 once for all the rows), so that a step computes the same numbers whether the native step
or the torch forward runs it. Over a Qwen2.5-0.5B-shaped layer's four projections on the 2-vCPU
Xeon: 1,394 / 1,672 / 1,086 GFLOP/s at 128 / 512 / 2,048 rows, where bfloat16 weights on oneDNN ran
1,135 / 2,039 / 1,437 (dequantizing the int8 weight for oneDNN at every call ran 94 / 418 / 789): long
prompts prefill up to ~1.3x slower than in bfloat16.
"""

import torch
from torch import nn

from services.engine.cpu_kernels import linear as native_linear
from services.engine.models.packed_linear import replace_linears


def unsupported_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why int8 weights cannot serve a model of ``dtype`` on ``device`` here, or None when they can."""
    if device.type != "cpu":
        return f"int8 weights run on the CPU's kernels, not on {device.type}"
    if dtype != torch.bfloat16:
        return f"int8 weights multiply bfloat16 activations: serve the model in bfloat16 (--dtype bfloat16), not {dtype}"
    if not native_linear.can_run(torch.bfloat16):
        return "the native CPU kernels are not built here (no C++ compiler)"
    return None


class Int8Linear(nn.Module):
    """``y = x (s * Q)^T + b`` for bfloat16 ``x [M, in]``: ``Q`` int8 blocked for the native kernel, ``s``
    float32 per output (``blocked`` and ``scales``, as ``DecodeStep`` reads them). ``rounded(weight,
    bias)`` rounds a float weight to int8; ``of_integers(q, scales, bias)`` takes a checkpoint's own."""

    def __init__(self, blocked: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 out_features: int, in_features: int) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.bias = bias
        self.blocked, self.scales = blocked, scales  # [ceil(out/16), ceil(in/2), 16, 2] int8, [out] float32

    @classmethod
    def rounded(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> "Int8Linear":
        return cls(*native_linear.quantize_int8(weight), bias, *weight.shape)

    @classmethod
    def of_integers(cls, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> "Int8Linear":
        """``q [out, in]`` int8 and ``scales [out]`` as stored."""
        return cls(native_linear.block_int8(q), scales.float().contiguous(), bias, *q.shape)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized ``W [out, in]`` in bfloat16 (a new tensor): what the layer multiplies by, up to
        the rounding of ``s * Q`` to bfloat16."""
        return native_linear.dequantize_int8(self.blocked, self.scales, self.out_features, self.in_features,
                                             torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return native_linear.int8_linear(x, self.blocked, self.scales, self.bias, self.out_features)


def quantize_linears(model: nn.Module) -> int:
    """Replaces every ``nn.Linear`` in ``model`` by an ``Int8Linear`` of its weights; returns how many."""
    return replace_linears(model, Int8Linear.rounded)
