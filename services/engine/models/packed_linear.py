"""Linear layers with their weights prepacked once for oneDNN, for the CPU.

A plain ``F.linear`` on the CPU re-lays the weight out into the GEMM's blocked format at every call;
at decode batch sizes (tens of rows) that repacking is a large part of the step. oneDNN's prepacked
weights skip it: measured on a 2-core Xeon, float32 ``[64, 512] x [512, 2752]`` went from 246 to 287
GFLOPS and ``[16, 512] x [512, 1024]`` from 119 to 244; bfloat16 (AMX) ``[64, 1376] x [1376, 512]``
from 951 to 1592. For a handful of rows the plain kernel is faster, so the original weight is kept
for those (the packed copy costs the weights' memory once more).
"""

import torch
import torch.nn.functional as F
from torch import nn

PACKED_MIN_ROWS = 4  # fewer rows than this: the plain kernel wins (measured: M=1 plain 56, packed 34 GFLOPS)
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in _PACKABLE_DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` also held prepacked; ``x: [M, in]``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight  # [out, in], shared with the module it replaces
        self.bias = bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < PACKED_MIN_ROWS:
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
