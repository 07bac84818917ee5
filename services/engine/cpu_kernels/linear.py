"""``y = x W^T + b`` for a few rows of ``x`` on the CPU, at the memory bandwidth (``linear.cpp``).

With a few rows a linear layer reads its whole weight to do two FLOPs per element, so it runs at the
speed the weight streams from memory. The weight is blocked once, at load time (``block_weight``), into
panels of 16 output rows interleaved along ``K``: one 64-byte load then feeds 16 outputs (float32), or
16 outputs over two ``K`` (bfloat16 pairs, multiplied by ``_mm512_dpbf16_ps`` where the CPU has it).
All rows are computed in one pass over the weight, so 4 rows cost about what 1 does. ``x``, ``b`` and
``y`` are in the weight's dtype; the sums are float32.

From a few rows up the arithmetic, not the weight read, bounds a projection; bfloat16 then runs on the
AMX tiles of CPUs that have them (Intel Sapphire Rapids and later, where Linux grants the process the
tile state), on the same blocked weight (``uses_amx``): 64 rows of the small shape's 32 projections
went from 16.2 ms to 2.7 ms, two threads, on a 2-core Xeon with AMX.

``small_m_linear`` is also the custom op ``strata::small_m_linear``, opaque to ``torch.compile``.

**int8 weights** (``--quantization int8``, weight-only): ``quantize_int8`` rounds a weight to int8
with a float32 scale per output row (symmetric: the row's largest magnitude maps to 127) and blocks the
integers in bfloat16's layout; ``int8_linear`` multiplies bfloat16 ``x`` by them, the float32 sums
scaled per output before the bias. Up to 8 rows, x goes to the integers as int16 in blocks of 32 with
a power-of-two scale each (exact within 2^7 of a block's largest element), so a few rows stream half
the bytes at the memory's speed; past that, on AMX, each panel is turned into bfloat16 once for all
the rows (``linear_panels.h``).
"""

import ctypes

import torch
import torch.nn.functional as F

from services.engine.cpu_kernels.build import load_library

PANEL = 16  # output rows per panel of the blocked weight (one AVX-512 register of float32, two AVX2 ones)
_DTYPES = (torch.float32, torch.bfloat16)
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]


def _library() -> ctypes.CDLL | None:
    library = load_library("linear.cpp")
    if library is not None and library.linear_f32.argtypes is None:
        for function in (library.linear_f32, library.linear_bf16):
            function.argtypes, function.restype = _ARGTYPES, None
        library.linear_bf16_i8.argtypes = _ARGTYPES[:4] + [ctypes.c_void_p] + _ARGTYPES[4:]
        library.linear_bf16_i8.restype = None
        for function in (library.linear_bf16_uses_amx, library.linear_bf16_i8_uses_amx):
            function.argtypes, function.restype = [ctypes.c_int64, ctypes.c_int64], ctypes.c_int32
    return library


def can_run(dtype: torch.dtype) -> bool:
    """Whether the native kernel serves CPU weights of ``dtype`` here (False without a compiler)."""
    return dtype in _DTYPES and _library() is not None


def uses_amx(rows: int, in_features: int, int8: bool = False) -> bool:
    """Whether a bfloat16 ``small_m_linear`` (with ``int8``: an ``int8_linear``) of ``rows`` rows and
    ``in_features`` inputs runs on AMX tiles here (the decode step's projections choose the same way)."""
    library = _library()
    if library is None:
        return False
    return bool((library.linear_bf16_i8_uses_amx if int8 else library.linear_bf16_uses_amx)(rows, in_features))


def block_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` laid out for the kernel: float32 ``[ceil(N/16), K, 16]``, bfloat16
    ``[ceil(N/16), ceil(K/2), 16, 2]``; padding is zeros. A new tensor (the original can be freed)."""
    if weight.dtype not in _DTYPES or weight.dim() != 2:
        raise ValueError(f"block_weight takes a 2-d float32 or bfloat16 weight, not {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    num_panels = -(-n // PANEL)
    if weight.dtype == torch.float32:
        padded = F.pad(weight, (0, 0, 0, num_panels * PANEL - n))
        return padded.view(num_panels, PANEL, k).transpose(1, 2).contiguous()
    k_pairs = -(-k // 2)
    padded = F.pad(weight, (0, 2 * k_pairs - k, 0, num_panels * PANEL - n))
    return padded.view(num_panels, PANEL, k_pairs, 2).transpose(1, 2).contiguous()


def unblock_weight(blocked: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The ``[out_features, in_features]`` weight that ``block_weight`` laid out (a new tensor)."""
    num_panels = blocked.shape[0]
    rows = blocked.transpose(1, 2).reshape(num_panels * PANEL, -1)  # bfloat16: the pairs flatten back to K
    return rows[:out_features, :in_features].contiguous()


def small_m_linear(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x [M, K] @ W^T + bias -> [M, out_features]``, ``W`` given as ``block_weight(W)``; any ``M``, but
    it beats oneDNN only for a few rows. ``x`` may be a row-strided view; a column-strided one is copied.
    Eager callers run the kernel directly (the custom op's dispatch costs more than a small layer);
    a ``torch.compile``d caller gets the opaque op ``strata::small_m_linear``."""
    if torch.compiler.is_compiling():
        return torch.ops.strata.small_m_linear(x, blocked, bias, out_features)
    return _launch(x, blocked, bias, out_features)


def _launch(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    library = _library()
    if library is None:
        raise RuntimeError("the native CPU linear kernel is not available here (no C++ compiler?); check can_run()")
    m, k = x.shape
    dtype = blocked.dtype
    expected_blocked = ((-(-out_features // PANEL), k, PANEL) if dtype == torch.float32
                        else (-(-out_features // PANEL), -(-k // 2), PANEL, 2))
    if x.dtype != dtype or blocked.shape != expected_blocked or not blocked.is_contiguous():
        raise ValueError(f"small_m_linear: x {x.dtype} {tuple(x.shape)} does not fit the blocked weight "
                         f"{dtype} {tuple(blocked.shape)} of {out_features} outputs (expected {expected_blocked})")
    if bias is not None and (bias.dtype != dtype or bias.shape != (out_features,) or not bias.is_contiguous()):
        raise ValueError(f"small_m_linear: bias {bias.dtype} {tuple(bias.shape)} should be {dtype} ({out_features},)")
    if x.device.type != "cpu":
        raise ValueError(f"small_m_linear runs on the CPU, x is on {x.device}")
    if x.stride(1) != 1 and k > 1:
        x = x.contiguous()
    y = torch.empty(m, out_features, dtype=dtype)
    kernel = library.linear_f32 if dtype == torch.float32 else library.linear_bf16
    kernel(x.data_ptr(), m, x.stride(0), blocked.data_ptr(), bias.data_ptr() if bias is not None else None,
           out_features, k, y.data_ptr(), y.stride(0))
    return y


_op = torch.library.custom_op("strata::small_m_linear", _launch, mutates_args=())


@_op.register_fake
def _(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` (any float dtype) as int8 for ``int8_linear``: the integers ``round(W / s)``
    blocked as bfloat16's (``[ceil(N/16), ceil(K/2), 16, 2]``, padding zeros) and the float32 scales
    ``s [N]`` (a row's largest magnitude over 127; 1 for a row of zeros). Dequantized, a weight is
    ``q * s`` (``dequantize_int8``)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_int8 takes a 2-d float weight, not {weight.dtype} {tuple(weight.shape)}")
    w = weight.float()
    largest = w.abs().amax(dim=1)
    scales = torch.where(largest > 0, largest / 127, torch.ones_like(largest))
    q = torch.clamp(torch.round(w / scales[:, None]), -127, 127).to(torch.int8)
    return block_int8(q), scales.contiguous()


def block_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 integers ``q [N, K]`` (any of -128..127) laid out for ``int8_linear``: bfloat16's blocking,
    ``[ceil(N/16), ceil(K/2), 16, 2]``, padding zeros."""
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"block_int8 takes 2-d int8 integers, not {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    num_panels, k_pairs = -(-n // PANEL), -(-k // 2)
    padded = F.pad(q, (0, 2 * k_pairs - k, 0, num_panels * PANEL - n))
    return padded.view(num_panels, PANEL, k_pairs, 2).transpose(1, 2).contiguous()


def dequantize_int8(blocked: torch.Tensor, scales: torch.Tensor, out_features: int, in_features: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[out_features, in_features]`` weight ``q * s`` that ``quantize_int8`` made, in ``dtype``."""
    return (unblock_weight(blocked, out_features, in_features).float() * scales[:, None]).to(dtype)


def int8_linear(x: torch.Tensor, blocked: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                out_features: int) -> torch.Tensor:
    """``x [M, K] @ (s * Q)^T + bias -> [M, out_features]`` in bfloat16, ``(Q, s)`` from ``quantize_int8``;
    the sums in float32, scaled before the bias is added. A compiled caller gets ``strata::int8_linear``."""
    if torch.compiler.is_compiling():
        return torch.ops.strata.int8_linear(x, blocked, scales, bias, out_features)
    return _launch_int8(x, blocked, scales, bias, out_features)


def _launch_int8(x: torch.Tensor, blocked: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 out_features: int) -> torch.Tensor:
    library = _library()
    if library is None:
        raise RuntimeError("the native CPU linear kernel is not available here (no C++ compiler?); check can_run()")
    m, k = x.shape
    expected_blocked = (-(-out_features // PANEL), -(-k // 2), PANEL, 2)
    if x.dtype != torch.bfloat16 or blocked.dtype != torch.int8 or blocked.shape != expected_blocked \
            or not blocked.is_contiguous():
        raise ValueError(f"int8_linear: x {x.dtype} {tuple(x.shape)} does not fit the int8 weight {blocked.dtype} "
                         f"{tuple(blocked.shape)} of {out_features} outputs (expected bfloat16 x, int8 {expected_blocked})")
    if scales.dtype != torch.float32 or scales.shape != (out_features,) or not scales.is_contiguous():
        raise ValueError(f"int8_linear: scales {scales.dtype} {tuple(scales.shape)} should be float32 ({out_features},)")
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (out_features,) or not bias.is_contiguous()):
        raise ValueError(f"int8_linear: bias {bias.dtype} {tuple(bias.shape)} should be bfloat16 ({out_features},)")
    if x.device.type != "cpu":
        raise ValueError(f"int8_linear runs on the CPU, x is on {x.device}")
    if x.stride(1) != 1 and k > 1:
        x = x.contiguous()
    y = torch.empty(m, out_features, dtype=torch.bfloat16)
    library.linear_bf16_i8(x.data_ptr(), m, x.stride(0), blocked.data_ptr(), scales.data_ptr(),
                           bias.data_ptr() if bias is not None else None, out_features, k, y.data_ptr(), y.stride(0))
    return y


_int8_op = torch.library.custom_op("strata::int8_linear", _launch_int8, mutates_args=())


@_int8_op.register_fake
def _(x: torch.Tensor, blocked: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
      out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What ``small_m_linear`` computes, in torch: float32 sums, the result in ``weight``'s dtype."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(weight.dtype)
