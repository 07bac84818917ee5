"""The torch forward's row operations on the CPU as native passes (``fused_ops.cpp``): the residual add
with RMSNorm, rotary on q and k, and silu(gate) * up.

In a step that runs the eager torch forward (a prefill, or any step that neither the native decode
step nor a compiled graph serves) each of them is several torch ops, every one a pass over the step's
rows with a float32 temporary in between: RMSNorm in bfloat16 is a cast, a square, a mean, a reciprocal square
root, two products and a cast back. Here each is one pass on OpenMP's threads, with the row functions
of the native decode step (``row_ops.h``), so prefill and decode round alike; against the torch ops
they differ only in the order of the norm's float32 sum and in ``exp``'s last bit.

``serves(*tensors)`` says whether they run here for these tensors (CPU, all float32 or all bfloat16,
the library built, not being traced by ``torch.compile``, which fuses the torch ops itself), and
``can_norm`` / ``can_rotate`` add the layouts those two need; the model keeps its torch ops otherwise.
"""

import ctypes

import torch

from services.engine.cpu_kernels.build import load_library

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


def _library() -> ctypes.CDLL | None:
    library = load_library("fused_ops.cpp")
    if library is not None and library.strata_add_rms_norm.argtypes is None:
        library.strata_add_rms_norm.argtypes = [ctypes.c_int32, _ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float, _ptr]
        library.strata_silu_mul.argtypes = [ctypes.c_int32, _ptr, _i64, _i64, _ptr]
        library.strata_rotary.argtypes = [ctypes.c_int32, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr]
        for function in (library.strata_add_rms_norm, library.strata_silu_mul, library.strata_rotary):
            function.restype = None
    return library


def serves(*tensors: torch.Tensor) -> bool:
    """Whether the native passes take these tensors: on the CPU, all of one float32 or bfloat16 dtype,
    outside ``torch.compile``'s tracing, with the library built."""
    dtype = tensors[0].dtype
    return (dtype in _DTYPE_CODES and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)
            and not torch.compiler.is_compiling() and _library() is not None)


def can_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``rotary_`` takes these: as ``serves``, each row's heads contiguous in ``x``, and an even
    head size (two halves)."""
    return (x.dim() == 3 and x.shape[2] % 2 == 0 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
            and serves(x, cos, sin))


def can_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether ``add_rms_norm`` takes these: as ``serves``, ``x`` two-dimensional, and ``residual``
    (added to in place) a contiguous tensor of ``x``'s shape."""
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()):
        return False
    return x.dim() == 2 and serves(x, weight, *([] if residual is None else [residual]))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``norm(x) * weight`` for ``x [T, H]``; with ``residual``, ``residual += x`` first (in place) and
    the norm is of the sum, as ``RMSNorm.forward``."""
    rows, n = x.shape
    x = x.contiguous()
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()):
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} must be a contiguous {tuple(x.shape)}")
    if weight.shape != (n,) or not weight.is_contiguous():
        raise ValueError(f"add_rms_norm: weight {tuple(weight.shape)} must be a contiguous ({n},)")
    out = torch.empty_like(x)
    _library().strata_add_rms_norm(_DTYPE_CODES[x.dtype], x.data_ptr(),
                                   None if residual is None else residual.data_ptr(), weight.data_ptr(),
                                   rows, n, eps, out.data_ptr())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2 I]`` (gate first) -> ``[T, I]``."""
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"silu_mul: gate_up has an odd width {width}")
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(rows, width // 2)
    _library().strata_silu_mul(_DTYPE_CODES[gate_up.dtype], gate_up.data_ptr(), rows, width // 2, out.data_ptr())
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates ``x [T, heads, D]`` in place (each head's values contiguous, rows at any stride) with
    ``cos, sin [T, 1, D]`` as ``RotaryEmbedding.tables`` gives them, as ``rope.apply_rotary_``."""
    rows, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim:
        raise ValueError(f"rotary_: the heads of x {tuple(x.shape)} must lie contiguous within a row, "
                         f"strides {x.stride()}")
    cos, sin = cos.reshape(rows, dim).contiguous(), sin.reshape(rows, dim).contiguous()
    _library().strata_rotary(_DTYPE_CODES[x.dtype], x.data_ptr(), rows, heads, dim, x.stride(0),
                             cos.data_ptr(), sin.data_ptr())
