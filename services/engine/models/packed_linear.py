"""Linear layers with their weights laid out once, at load time, for the CPU's kernels.

Two layouts, each for the batch sizes where it is faster:

- **Few rows** (decode at small batch, at most ``NATIVE_MAX_ROWS``): the native kernel of
  ``cpu_kernels/linear`` on a weight blocked in panels of 16 outputs. With a few rows a projection
  reads its whole weight for two FLOPs per element, so it runs at the speed the weight streams from
  memory, and the native kernel streams it faster than oneDNN. Measured on the 2-core EPYC (Zen 4)
  over the small shape's 32 layer matrices with one thread (other jobs shared the machine, so these
  are per core), against a one-thread read of a 256 MB buffer in the same run, medians: float32 at
  1 / 4 / 8 rows 97% / 89% / 72% of the read bandwidth (oneDNN 57% / 40% / 37%), bfloat16 70-92% /
  58-85% / 64-78% over three runs (oneDNN 40-56% / 47-62% / 46-48%). From 16 to 64 rows both are
  bound by compute and the native kernel stays at or above oneDNN (float32 5.2 / 3.3 / 1.9 GB/s of
  weights at 16 / 32 / 64 rows against 3.4 / 2.5 / 1.5). The batch-1 decode step's projections went
  from 19.5 to 12.9 ms (float32) and from 9.7 to 8.2 ms (bfloat16), one thread, in the same run.
  On a CPU with AMX (a 2-core Xeon), bfloat16 from 5 rows runs on its tiles (``linear.py``): 64 rows
  through the small shape's 32 matrices at about 1.1 TFLOPS, against 0.18 on ``_mm512_dpbf16_ps``
  (``F.linear``, oneDNN on AMX, did ``[64, 512] x [512, 2752]`` at 1.06 in the same session).
  Later, on the same machine idle, two threads, one row: bfloat16 26.5 GB/s and float32 20.5 GB/s,
  against a read bandwidth of 24.2 GB/s measured in the same run (oneDNN: 12.4 and 17.1 GB/s).
- **More rows**: oneDNN's prepacked weights (``torch.ops.mkldnn._linear_pointwise``). A plain
  ``F.linear`` re-lays the weight out into the GEMM's blocked format at every call; oneDNN's prepacked
  weights skip it: measured on a 2-core Xeon, float32 ``[64, 512] x [512, 2752]`` went from 246 to 287
  GFLOPS and ``[16, 512] x [512, 1024]`` from 119 to 244; bfloat16 (AMX) ``[64, 1376] x [1376, 512]``
  from 951 to 1592.

Memory: two copies of each weight, the blocked one and the oneDNN one; the original is dropped. A tied
logits weight stays alive as the embedding, so its layer keeps that as its second copy and runs its
larger batches through ``F.linear`` on it instead of a third, oneDNN copy.

The blocked copies all live in one mapping on huge pages where Linux gives them
(``blocked_weights_onto_huge_pages``): one row reads them 8-17% faster than on 4 KiB pages (``memory_arena``).

Without the native kernel (no C++ compiler) everything runs on oneDNN, except float32 with fewer than
``PACKED_MIN_ROWS`` rows, which is faster on the plain kernel and keeps the original weight for it.

oneDNN packs bfloat16 only on a CPU with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; elsewhere (an AVX2-only
Zen 3, say) its reorder raises and its plain bfloat16 GEMM converts as it goes, so bfloat16 runs every
batch on the native kernel: on a 2-core Zen 3, two threads, the small shape's projections at 64 rows
108 GFLOPS there against 17 on ``F.linear``, at 32 rows 126 against 18.
"""

import torch
import torch.nn.functional as F
from torch import nn

from services.engine import memory_arena
from services.engine.cpu_kernels import linear as native_linear

NATIVE_MAX_ROWS = 64  # up to this many rows the native kernel runs (at least as fast as oneDNN), more run on oneDNN
PACKED_MIN_ROWS = 4  # without the native kernel, float32 with fewer rows than this runs the plain kernel
_PLAIN_FOR_FEW_ROWS = (torch.float32,)
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in _PACKABLE_DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's reorder takes CPU weights of ``dtype`` on this CPU."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """``y = x W^T + b``, ``x: [M, in]``, with ``W`` laid out for the native kernel (few rows) and for
    oneDNN (more rows). ``weight_is_shared``: the caller keeps ``W`` alive anyway (a tied embedding)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, weight_is_shared: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        # [ceil(out / 16), in, 16] (bfloat16: [ceil(out / 16), ceil(in / 2), 16, 2]), or None
        self.blocked = native_linear.block_weight(weight) if native_linear.can_run(weight.dtype) else None
        onednn = onednn_packs(weight.dtype)
        uses_original = weight_is_shared or (self.blocked is None and (not onednn or weight.dtype in _PLAIN_FOR_FEW_ROWS))
        self.original = weight if uses_original else None  # [out, in], the caller's tensor
        has_two_copies = self.blocked is not None and self.original is not None
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64) if onednn and not has_two_copies else None
        # More than NATIVE_MAX_ROWS rows: oneDNN's copy, else F.linear on the original where oneDNN runs
        # the dtype, else the native kernel (bfloat16 without oneDNN's support for it).
        self.native_for_all_rows = self.blocked is not None and self.packed is None and not (onednn and self.original is not None)

    @property
    def weight(self) -> torch.Tensor | None:
        """``W [out, in]``, for inspection: the caller's tensor where it is kept, else rebuilt from the
        blocked copy (a new tensor); None where only oneDNN's opaque copy is kept."""
        if self.original is not None or self.blocked is None:
            return self.original
        return native_linear.unblock_weight(self.blocked, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.blocked is not None and (rows <= NATIVE_MAX_ROWS or self.native_for_all_rows):
            return native_linear.small_m_linear(x, self.blocked, self.bias, self.out_features)
        if self.packed is None or (self.original is not None and rows < PACKED_MIN_ROWS):
            return F.linear(x, self.original, self.bias)
        if torch.compiler.is_compiling():
            return torch.ops.strata.onednn_linear(x, self.packed, self.bias)
        return _onednn_linear(x, self.packed, self.bias)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# What a compiled caller gets: an op inductor runs as it is. Its own lowering of oneDNN's linear (and of
# the linear and a following add, which its pattern passes fuse) wants the weights frozen into the graph
# as constants; freezing re-packs the float32 ones per graph, failed on the bfloat16 prepacked ones, and
# bypasses the AOTAutograd cache.
_op = torch.library.custom_op("strata::onednn_linear", _onednn_linear, mutates_args=())


@_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


def replace_linears(model: nn.Module, make) -> int:
    """Replaces every ``nn.Linear`` in ``model`` by ``make(weight, bias)``; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child.weight, child.bias))
                count += 1
    return count


def pack_linears(model: nn.Module) -> int:
    """Replaces every ``nn.Linear`` in ``model`` by a ``PackedLinear`` of the same weights; returns how many."""
    return replace_linears(model, PackedLinear)


def blocked_weights_onto_huge_pages(model: nn.Module) -> int:
    """Moves every blocked weight in ``model`` (a ``PackedLinear``'s or an ``Int8Linear``'s) into one arena
    on huge pages (see ``memory_arena``); returns the bytes moved (0 where huge pages are not available)."""
    layers = [m for m in model.modules() if getattr(m, "blocked", None) is not None]
    if not layers or not memory_arena.huge_pages_available():
        return 0
    for layer, copy in zip(layers, memory_arena.copies_in_arena([m.blocked for m in layers]), strict=True):
        layer.blocked = copy
    return sum(m.blocked.nbytes for m in layers)
