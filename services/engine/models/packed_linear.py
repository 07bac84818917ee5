"""Linear layers with their weights prepacked once for oneDNN, for the CPU.

A plain ``F.linear`` on the CPU re-lays the weight out into the GEMM's blocked format at every call;
at decode batch sizes (tens of rows) that repacking is a large part of the step. oneDNN's prepacked
weights skip it: measured on a 2-core Xeon, float32 ``[64, 512] x [512, 2752]`` went from 246 to 287
GFLOPS and ``[16, 512] x [512, 1024]`` from 119 to 244; bfloat16 (AMX) ``[64, 1376] x [1376, 512]``
from 951 to 1592.

With a handful of rows, float32 is faster on the plain kernel (batch-1 decode of the small shape:
109 tok/s plain, 93 packed), so float32 keeps the original weight for those, at the cost of the
weights' memory once more. bfloat16 is faster packed at any batch (133 vs 103 tok/s at batch 1), so
its original weight is dropped and memory stays what it was.
"""

import torch
import torch.nn.functional as F
from torch import nn

PACKED_MIN_ROWS = 4  # float32 with fewer rows than this runs the plain kernel
_PLAIN_FOR_FEW_ROWS = (torch.float32,)
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in _PACKABLE_DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` prepacked; ``x: [M, in]``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        # [out, in], shared with the module it replaces; only float32 keeps it, for few rows
        self.weight = weight if weight.dtype in _PLAIN_FOR_FEW_ROWS else None
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and x.shape[0] < PACKED_MIN_ROWS:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Replaces every ``nn.Linear`` in ``model`` by a ``PackedLinear`` of the same weights; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                count += 1
    return count
