"""Quantized checkpoints, dequantized as they load (or, int8 with a scale per row, kept for the int8 kernels).

Llama, Mistral and Qwen2 checkpoints are also published quantized (config.json's
``quantization_config.quant_method``): Qwen's own GPTQ and AWQ releases, llm-compressor's
compressed-tensors checkpoints (W4A16, W8A16, W8A8, FP8; Red Hat's and Neural Magic's), block-wise FP8
(transformers' ``fp8``) and Meta's ``fbgemm_fp8``. The engine has kernels for one of these layouts only,
int8 with a scale per output row (``int8_rows``: compressed-tensors' W8A16 and W8A8 presets), which a
bfloat16 model on the CPU keeps as stored (``models/int8_linear``); every other quantized projection is
rebuilt in floating point (integer or FP8 values, less their zero points, times their scales) and loaded
like any weight. The served model is the quantized one (its rounded weights); memory and speed of a
rebuilt one are those of the serving dtype, and quantized activations (W8A8's input scales) run
unquantized.

``QuantizedWeights(tensors, quantization_config).get(name)`` returns a projection's ``weight`` as
float32 whatever its format, and any other tensor as stored. Formats it cannot rebuild are refused by
``check_supported`` when the config is read, naming the method."""

import math
import re
from collections.abc import Callable

import torch

from services.engine.models.checkpoint_tensors import CheckpointTensors

SUPPORTED_METHODS = ("compressed-tensors", "gptq", "awq", "fp8", "fbgemm_fp8")
_AWQ_COLUMN_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # the column each of a word's 8 nibbles (lowest first) holds, unshuffled


def check_supported(quantization: dict | None, source: str) -> None:
    """Raise ValueError, naming the method and what is supported, for a quantization the loader cannot rebuild."""
    if not quantization:
        return
    method = quantization.get("quant_method")
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"{source}: quantization method {method!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_METHODS)} (dequantized at load)")
    if method == "gptq":
        if quantization.get("bits") not in (2, 4, 8):
            raise ValueError(f"{source}: GPTQ with {quantization.get('bits')} bits is not supported (2, 4 or 8)")
        if quantization.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
            raise ValueError(f"{source}: GPTQ checkpoint_format {quantization['checkpoint_format']!r} is not "
                             f"supported (gptq or gptq_v2)")
    if method == "awq":
        if quantization.get("bits", quantization.get("w_bit", 4)) != 4:
            raise ValueError(f"{source}: AWQ with {quantization.get('bits')} bits is not supported (4)")
        if str(quantization.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"{source}: AWQ version {quantization['version']!r} is not supported (GEMM's layout)")
        if not quantization.get("zero_point", True):
            raise ValueError(f"{source}: AWQ without zero points is not supported")
    if method == "compressed-tensors":
        for name, group in (quantization.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            if weights.get("type", "int") not in ("int", "float") or weights.get("num_bits", 8) > 8 or (
                    weights.get("type") == "float" and weights.get("num_bits") != 8):
                raise ValueError(f"{source}: compressed-tensors group {name!r} ({weights.get('type')}, "
                                 f"{weights.get('num_bits')} bits) is not supported: int of 1-8 bits or float8")


INT8_AT_LOAD = "int8"  # --quantization int8: weight-only int8 made at load (models/int8_linear)
_KERNEL_NAMES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}  # vLLM's names for a kernel of a method


def check_requested(requested: str | None, quantization: dict | None, source: str) -> None:
    """``--quantization``, as vLLM checks it: the checkpoint's own method (or a vLLM kernel of it), or
    ``int8``, which rounds an unquantized checkpoint's projections to int8 as it loads (``int8_linear``)."""
    if requested is None:
        return
    method = (quantization or {}).get("quant_method")
    if requested == INT8_AT_LOAD:
        if method is not None:
            raise ValueError(f"--quantization {requested} rounds an unquantized checkpoint's weights to int8 as they "
                             f"load; {source} is quantized already ({method}): leave the flag out to serve it")
        return
    if method is None:
        raise ValueError(f"--quantization {requested}: {source} is not quantized, and the only quantization at load is "
                         f"{INT8_AT_LOAD!r} (weight-only, on the CPU); leave the flag out or pass {INT8_AT_LOAD}")
    if _KERNEL_NAMES.get(requested, requested) != method:
        raise ValueError(f"--quantization {requested} does not match {source}'s quantization method {method!r}; "
                         f"leave the flag out to use the checkpoint's")


def describe(quantization: dict) -> str:
    """One line for the load log: the method and its width."""
    method = quantization["quant_method"]
    if method == "compressed-tensors":
        groups = quantization.get("config_groups") or {}
        widths = sorted({f"{(g.get('weights') or {}).get('type', 'int')}{(g.get('weights') or {}).get('num_bits')}"
                         for g in groups.values()})
        return f"compressed-tensors {quantization.get('format')} ({', '.join(widths)})"
    if method in ("gptq", "awq"):
        return f"{method} {quantization.get('bits', 4)}-bit, groups of {quantization.get('group_size')}"
    return f"{method} (float8 weights)"


class QuantizedWeights:
    """The checkpoint's tensors, with each quantized projection's ``<module>.weight`` rebuilt ([out, in], float32)."""

    def __init__(self, tensors: CheckpointTensors, quantization: dict | None):
        self.tensors = tensors
        self.quantization = quantization or {}
        method = self.quantization.get("quant_method")
        self._rebuild: Callable[[str], torch.Tensor | None] | None = {
            "compressed-tensors": self._compressed_tensors, "gptq": self._gptq, "awq": self._awq,
            "fp8": self._float8, "fbgemm_fp8": self._float8}.get(method)

    def get(self, name: str) -> torch.Tensor:
        if self._rebuild is not None and name.endswith(".weight"):
            rebuilt = self._rebuild(name.removesuffix(".weight"))
            if rebuilt is not None:
                return rebuilt
        return self.tensors.get(name)

    def int8_rows(self, module: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A projection stored as int8 with one scale per output row and no zero point (compressed-tensors'
        8-bit integer weights with the channel strategy, symmetric: llm-compressor's W8A16 and W8A8):
        its integers [out, in] (int8) and scales [out] (float32), which the int8 kernels take as they are
        (``int8_linear``); None for any other format or module."""
        if self.quantization.get("quant_method") != "compressed-tensors" or not self._has(module, "weight_scale"):
            return None
        args = self._compressed_tensors_args(module)
        if (args.get("type", "int") != "int" or args.get("num_bits") != 8 or args.get("strategy") != "channel"
                or self._has(module, "weight_zero_point") or self._has(module, "weight_g_idx")):
            return None
        if self._has(module, "weight_packed"):
            in_features = int(self._part(module, "weight_shape")[1])
            values = _unpack_bits(self._part(module, "weight_packed"), 8, in_features) - 128
        else:
            values = self._part(module, "weight")
        scale = self._part(module, "weight_scale").float()
        if values.dim() != 2 or scale.numel() != values.shape[0]:
            return None
        return values.to(torch.int8), scale.reshape(-1).contiguous()

    def _has(self, module: str, part: str) -> bool:
        return f"{module}.{part}" in self.tensors

    def _part(self, module: str, part: str) -> torch.Tensor:
        return self.tensors.get(f"{module}.{part}")

    def _compressed_tensors(self, module: str) -> torch.Tensor | None:
        """llm-compressor's formats: pack-quantized (ints of 1-8 bits, offset to unsigned, packed densely
        along the input dim, zero points along the output dim), int-quantized/naive-quantized (int8) and
        float-quantized (float8 ``weight``), each with ``weight_scale`` per tensor, channel, group or
        block, optional ``weight_zero_point`` and, with activation ordering, ``weight_g_idx``."""
        if not self._has(module, "weight_scale"):
            return None  # an ignored module (lm_head, usually): a plain weight
        args = self._compressed_tensors_args(module)
        if self._has(module, "weight_packed"):
            out_features, in_features = self._part(module, "weight_shape").tolist()
            bits = args.get("num_bits", 4)
            offset = 1 << (bits - 1)
            values = _unpack_bits(self._part(module, "weight_packed"), bits, in_features) - offset
            zero_point = None
            if self._has(module, "weight_zero_point"):
                zero_point = _unpack_bits(self._part(module, "weight_zero_point").t(), bits, out_features).t() - offset
        else:
            values = self._part(module, "weight")
            zero_point = self._part(module, "weight_zero_point") if self._has(module, "weight_zero_point") else None
        g_idx = self._part(module, "weight_g_idx") if self._has(module, "weight_g_idx") else None
        return _scaled(values.float(), self._part(module, "weight_scale").float(), zero_point, g_idx,
                       args.get("group_size"), args.get("block_structure"))

    def _compressed_tensors_args(self, module: str) -> dict:
        """The weight arguments of the config group whose targets name this module (the only group, if none does)."""
        groups = list((self.quantization.get("config_groups") or {}).values())
        for group in groups:
            if any(_targets(target, module) for target in group.get("targets", [])):
                return group.get("weights") or {}
        if len(groups) == 1:
            return groups[0].get("weights") or {}
        raise ValueError(f"compressed-tensors: no config group targets {module!r}")

    def _float8(self, module: str) -> torch.Tensor | None:
        """transformers' ``fp8`` (float8 weights with ``weight_scale_inv`` per block of
        ``weight_block_size``, or AutoFP8's per-tensor ``weight_scale``) and ``fbgemm_fp8`` (``weight_scale``
        per output channel): the weight times its scale."""
        for scale_name in ("weight_scale_inv", "weight_scale"):
            if self._has(module, scale_name):
                return _scaled(self._part(module, "weight").float(), self._part(module, scale_name).float(),
                               block=self.quantization.get("weight_block_size"))
        return None

    def _gptq(self, module: str) -> torch.Tensor | None:
        """AutoGPTQ/GPTQModel's layout: ``qweight`` [in·bits/32, out] packs input rows into int32 words,
        lowest bits first; ``qzeros`` [groups, out·bits/32] packs output columns the same way, each zero
        stored one less in checkpoint_format gptq (v1); ``scales`` [groups, out]; ``g_idx`` [in] names
        each input row's group (activation order), else row // group_size."""
        if not self._has(module, "qweight"):
            return None
        bits = self.quantization["bits"]
        qweight = self._part(module, "qweight")
        in_features, out_features = qweight.shape[0] * 32 // bits, qweight.shape[1]
        values = _unpack_bits(qweight.t(), bits, in_features).t()  # [in, out]
        zeros = _unpack_bits(self._part(module, "qzeros"), bits, out_features)  # [groups, out]
        if self.quantization.get("checkpoint_format", "gptq") == "gptq":
            zeros = zeros + 1
        g_idx = (self._part(module, "g_idx").long() if self._has(module, "g_idx")
                 else torch.arange(in_features) // self._group_size(in_features))
        return _grouped_rows(values, zeros, self._part(module, "scales").float(), g_idx)

    def _awq(self, module: str) -> torch.Tensor | None:
        """AutoAWQ's GEMM layout: ``qweight`` [in, out/8] packs output columns 8 to an int32 word in the
        order 0, 2, 4, 6, 1, 3, 5, 7 (lowest nibble first); ``qzeros`` [groups, out/8] the same;
        ``scales`` [groups, out]; input row r in group r // group_size."""
        if not self._has(module, "qweight"):
            return None
        qweight = self._part(module, "qweight")
        in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
        values = _awq_columns(_unpack_bits(qweight, 4, out_features))
        zeros = _awq_columns(_unpack_bits(self._part(module, "qzeros"), 4, out_features))
        g_idx = torch.arange(in_features) // self._group_size(in_features)
        return _grouped_rows(values, zeros, self._part(module, "scales").float(), g_idx)

    def _group_size(self, in_features: int) -> int:
        group_size = self.quantization.get("group_size", self.quantization.get("q_group_size", -1))
        return in_features if group_size in (None, -1) else group_size


def _targets(target: str, module: str) -> bool:
    """compressed-tensors' target forms: a layer class ("Linear": every projection), "re:<regex>" over
    the module's name, or the name itself."""
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith("." + target)


def _unpack_bits(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """[rows, words] int32 → [rows, count] int64: element i of a row at bits i·bits.. of the row's words
    read as one little-endian bit string (an element may straddle two words when 32 % bits != 0)."""
    words = words.to(torch.int64) & 0xFFFFFFFF
    words = torch.cat([words, torch.zeros_like(words[:, :1])], dim=1)  # a word past the end for straddlers
    start = torch.arange(count) * bits
    word, shift = start // 32, start % 32
    pairs = words[:, word] | (words[:, word + 1] << 32)
    return (pairs >> shift) & ((1 << bits) - 1)


def _awq_columns(values: torch.Tensor) -> torch.Tensor:
    """Undo AWQ's shuffle: in each run of 8 unpacked columns, nibble j holds column _AWQ_ORDER[j]."""
    rows, cols = values.shape
    return values.view(rows, cols // 8, 8)[:, :, list(_AWQ_COLUMN_ORDER)].reshape(rows, cols)


def _grouped_rows(values: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """GPTQ and AWQ: values [in, out] with zeros and scales [groups, out] and each input row's group → weight [out, in]."""
    return ((values - zeros[g_idx]).float() * scales[g_idx]).t().contiguous()


def _scaled(values: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None,
            g_idx: torch.Tensor | None = None, group_size: int | None = None,
            block: list[int] | None = None) -> torch.Tensor:
    """values [out, in] (ints or floats) less their zero point, times their scale, whose shape says how it
    applies: one value (per tensor), [out, 1] (per channel), [out, groups] (per group of input columns,
    or by g_idx) or [ceil(out/b0), ceil(in/b1)] (per block)."""
    out_features, in_features = values.shape
    scale = scale.reshape(1, 1) if scale.numel() == 1 else scale
    if zero_point is not None:
        zero_point = zero_point.reshape(scale.shape).float()
    if scale.shape[0] == out_features or scale.shape == (1, 1):
        if g_idx is None:
            columns = scale.shape[1]
            group_size = group_size or math.ceil(in_features / columns)
            g_idx = torch.arange(in_features) // group_size
        else:
            g_idx = g_idx.long()
        scale, zero_point = (None if t is None else t[:, g_idx] for t in (scale, zero_point))
    else:
        rows, columns = block or (math.ceil(out_features / scale.shape[0]), math.ceil(in_features / scale.shape[1]))
        expand = lambda t: t.repeat_interleave(rows, 0)[:out_features].repeat_interleave(columns, 1)[:, :in_features]  # noqa: E731
        scale, zero_point = (None if t is None else expand(t) for t in (scale, zero_point))
    values = values.float()
    if zero_point is not None:
        values = values - zero_point
    return values * scale
