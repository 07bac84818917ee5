"""A whole step of the Llama family in one native call (``decode_forward.cpp``): a decode step, or a
step with prompt chunks beside its decoding requests.

At batch 1 a decode step is about 40 projections of tens of microseconds each with norms, rotary and
the activation between them; called one by one from Python (or from a compiled graph's wrapper), each
pays its dispatch and an OpenMP region whose threads may have gone to sleep, which cost more than the
arithmetic. ``DecodeStep`` hands the C++ side the model's tensors once (pointers to the weights blocked
by ``linear.block_weight``, the norms, the rotary tables and the K/V pools), and each step then runs
every layer in one parallel region, each phase ending when its last work item is done, and the logits
head after them (``logits``), which would otherwise start a parallel region of its own from Python:
measured on a 2-core Zen 3 at batch 1 (small shape, alternating in one process), 0.19-0.24 ms less
per bfloat16 step of 2.4-3.6 ms, up to 0.1 ms per float32 step of ~5 ms.

It serves decode steps, and steps with prompt chunks (prefill, chunked or not) beside the decoding
requests, float32 or bfloat16 (with int8 weights too: ``models/int8_linear``), on the CPU; the model
runner keeps the torch forward for everything else. Every intermediate is rounded where the torch
forward rounds it, so the two agree to float32 summation order (tested against it and against HF). A
step with prompt chunks, as a chain of torch operations, was one OpenMP region per operation with a
barrier at its end: on cores shared with the gateway, the tokenizer and the clients, a thread that lost
its core held the other at each barrier; here the threads share each phase's items, and a thread taken
away is taken over (``work_split.h``). Its GEMMs run on the native panel kernels, 2-6% below oneDNN's
on the small shape at 2,048 rows in the same process on a 2-core Zen 4 (float32 199-207 against 196-215
GFLOP/s, bfloat16 373-414 against 398-429). On a 2-vCPU Xeon with AMX they fall behind from a few
hundred rows (bfloat16 on the tiles: the small shape's four projections 1.00-1.02x oneDNN's time at
256-512 rows, 1.16x at 1,024, 1.59x at 2,048), so a step of more than ``MAX_NATIVE_ROWS`` rows runs the
torch forward (oneDNN's GEMMs, the same native attention): ``strata bench offline`` (64 prompts of
64-512 tokens, mostly prefill) ran 3,330 tok/s in bfloat16 with every prompt step native and
3,570-3,770 with those past 512 rows on the torch forward (float32 1,280 against 1,390-1,510), two to
four runs each, 256 and 768 rows within the noise of 512.

Memory: the step's buffers (every activation of a layer, in two sets that the layers alternate
between, see ``decode_forward.cpp``) come from an arena each ``DecodeStep`` keeps at the size of the
largest step it ran: at ``MAX_NATIVE_ROWS`` (512) rows ~52 MB for the small shape in float32 (27 MB in
bfloat16), ~425 MB for a 7B Llama shape in float32 (225 MB in bfloat16), beside the torch forward's
transient ~one layer's worth. A step whose rows would take more than ``MAX_ARENA_BYTES`` (``max_rows``,
for a model far larger than 7B) runs the torch forward instead, so that it does not hold gigabytes more
than the torch forward would.
"""

import ctypes
import dataclasses
import functools
import logging

import torch

from services.engine.cpu_kernels import paged_decode
from services.engine.cpu_kernels.build import load_function

log = logging.getLogger(__name__)

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_ARENA_BYTES = 2 << 30  # the most a step's buffers may take (see Memory above)
MAX_NATIVE_ROWS = 512  # more rows run the torch forward, whose oneDNN GEMMs are then faster (see above)
_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class _LayerWeights(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("qkv", _ptr), ("qkv_bias", _ptr), ("o", _ptr), ("o_bias", _ptr),
                ("post_norm", _ptr), ("gate_up", _ptr), ("gate_up_bias", _ptr), ("down", _ptr),
                ("down_bias", _ptr), ("k_cache", _ptr), ("v_cache", _ptr), ("window", _i64),
                ("qkv_scales", _ptr), ("o_scales", _ptr), ("gate_up_scales", _ptr), ("down_scales", _ptr)]


class _ModelWeights(ctypes.Structure):
    _fields_ = [("num_layers", _i64), ("hidden", _i64), ("num_heads", _i64), ("num_kv_heads", _i64),
                ("head_dim", _i64), ("intermediate", _i64), ("block_size", _i64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("embed", _ptr), ("final_norm", _ptr), ("cos", _ptr), ("sin", _ptr),
                ("layers", ctypes.POINTER(_LayerWeights)), ("logits", _ptr), ("logits_bias", _ptr), ("vocab", _i64),
                ("logits_scales", _ptr)]


class _StepInputs(ctypes.Structure):
    _fields_ = [("num_rows", _i64), ("token_ids", _ptr), ("positions", _ptr), ("slot_mapping", _ptr),
                ("block_tables", _ptr), ("seq_lens", _ptr), ("table_stride", _i64), ("min_chunk_tokens", _i64),
                ("out", _ptr), ("num_logit_rows", _i64), ("logit_rows", _ptr), ("logits", _ptr),
                ("num_decodes", _i64), ("num_prefills", _i64), ("query_start", _ptr), ("context_lens", _ptr),
                ("thread_cores", _ptr), ("num_thread_cores", _i64)]


@functools.cache
def _kernel() -> ctypes._CFuncPtr | None:
    return load_function("decode_forward.cpp", "strata_decode_step",
                         [ctypes.c_int32, ctypes.POINTER(_ModelWeights), ctypes.POINTER(_StepInputs), _ptr])


class _StepArena:
    """The memory the native steps of one engine carve their buffers from (``StepArena``): it grows to
    the largest step and is freed with this object."""

    def __init__(self) -> None:
        self._free = load_function("decode_forward.cpp", "strata_step_arena_free", [_ptr])
        self._bytes = load_function("decode_forward.cpp", "strata_step_arena_bytes", [_ptr], ctypes.c_int64)
        self.pointer = load_function("decode_forward.cpp", "strata_step_arena_new", [], _ptr)()

    @property
    def num_bytes(self) -> int:
        """What it holds now (the largest step so far)."""
        return self._bytes(self.pointer)

    def __del__(self) -> None:
        if getattr(self, "pointer", None):
            self._free(self.pointer)


def arena_bytes_per_row(mc, dtype: torch.dtype) -> int:
    """At most what one row of a step takes in the arena: ``decode_forward.cpp``'s two LayerBuffers
    sets (x's packed copies counted at 4 bytes an element, the most they take) and the final norm's
    row; a step adds its decode attention's partials and the head's rows beside them."""
    hidden, q_size, inter = mc.hidden_size, mc.num_heads * mc.head_dim, mc.intermediate_size
    qkv_size = q_size + 2 * mc.num_kv_heads * mc.head_dim
    element = torch.empty(0, dtype=dtype).element_size()
    def packed(k: int) -> int:  # LayerBuffers::packed_size's elements of a row
        return k + k // 16 + 35

    per_set = ((6 * hidden + qkv_size + 2 * q_size + 3 * inter) * element + 4 * q_size
               + 4 * (2 * packed(hidden) + packed(q_size) + packed(inter)))
    return 2 * per_set + hidden * element


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def unsupported_reason(model, dtype: torch.dtype, device: torch.device, kv_caches: list = ()) -> str | None:
    """Why ``DecodeStep`` cannot serve this model here (over these K/V pools, where given), or None
    when it can."""
    mc = model.config
    if device.type != "cpu" or dtype not in _DTYPE_CODES:
        return f"it runs float32 and bfloat16 on the CPU, not {dtype} on {device.type}"
    if _kernel() is None:
        return "the native kernels are not built here"
    if not paged_decode.can_run(mc.num_heads, mc.num_kv_heads, mc.head_dim, dtype) or mc.head_dim % 2:
        return f"its attention kernel does not take {mc.num_heads} heads over {mc.num_kv_heads} of dim {mc.head_dim}"
    linears = [model.lm_head]  # the head: the tied embedding's too, after pack_linears
    for layer in model.model.layers:
        linears += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    if any(getattr(linear, "blocked", None) is None for linear in linears):
        return "the projections are not blocked for the native linear kernel"
    if any(pool.dtype != dtype or not pool.is_contiguous() for pools in kv_caches for pool in pools):
        return "the K/V pools are not contiguous pools of the model's dtype"
    return None


@dataclasses.dataclass(frozen=True)
class PromptChunks:
    """The prompt chunks of a step, after its decode rows: chunk ``p`` owns the step's rows ``D +
    query_start[p] .. D + query_start[p + 1] - 1`` (``D`` decode rows before them), at positions
    ``context_lens[p]`` onwards (int64 ``[P + 1]`` and ``[P]``, contiguous)."""

    query_start: torch.Tensor
    context_lens: torch.Tensor


class DecodeStep:
    """``step(input_ids, positions, slot_mapping, block_tables, seq_lens) -> [M, H]``: the final-norm
    hidden state of ``M`` requests decoding one token each, their K/V stored at ``slot_mapping``;
    ``step.logits(..., rows)`` the same step's logits of those rows, and with ``prompts`` a step whose
    rows after the decode ones are prompt chunks. Holds pointers into ``model`` and ``kv_caches``, which
    must stay as they are while it lives.

    The logits are written into a buffer kept across steps, valid until the next step: a new one of
    more than 32 MB (glibc's largest heap block: 64 rows of a 152k vocabulary are 39 MB) is a fresh
    mapping whose pages fault in every step, 8.9 ms to write it against 0.7 ms for a kept one.

    ``thread_cores``: the cores a step's threads bind to, thread i to the i-th, while a step runs on two
    of them or more and no more than there are (``cpu_kernels/core_binding.h``; the engine's come from
    ``threads.binding_cores``); empty, the threads go where the OS puts them."""

    def __init__(self, model, kv_caches: list, scale: float,
                 min_chunk_tokens: int = paged_decode.MIN_CHUNK_TOKENS, thread_cores: tuple[int, ...] = ()) -> None:
        mc = model.config
        self.dtype = model.model.embed_tokens.weight.dtype
        self.hidden_size = mc.hidden_size
        self.min_chunk_tokens = min_chunk_tokens
        self.thread_cores = tuple(thread_cores)
        self._cores = (ctypes.c_int32 * len(self.thread_cores))(*self.thread_cores)
        self._kernel = _kernel()
        self._arena = _StepArena()
        # the most rows a step takes here (more run the torch forward), at least a whole decode batch's
        self.max_rows = max(64, min(MAX_NATIVE_ROWS, MAX_ARENA_BYTES // arena_bytes_per_row(mc, self.dtype)))
        layers = model.model.layers
        self._layers = (_LayerWeights * len(layers))()
        for slot, layer, (k_cache, v_cache) in zip(self._layers, layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            for name, linear in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                                 ("down", mlp.down_proj)):
                setattr(slot, name, linear.blocked.data_ptr())
                setattr(slot, f"{name}_bias", _pointer(linear.bias))
                setattr(slot, f"{name}_scales", _pointer(getattr(linear, "scales", None)))  # int8 weights
            slot.input_norm = layer.input_layernorm.weight.data_ptr()
            slot.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            slot.k_cache, slot.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            slot.window = attn.sliding_window or 0
        rotary = model.model.rotary
        self._weights = _ModelWeights(
            num_layers=len(layers), hidden=mc.hidden_size, num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim, intermediate=mc.intermediate_size, block_size=kv_caches[0][0].shape[1],
            eps=model.model.norm.eps, scale=scale, embed=model.model.embed_tokens.weight.data_ptr(),
            final_norm=model.model.norm.weight.data_ptr(), cos=rotary.cos.data_ptr(), sin=rotary.sin.data_ptr(),
            layers=self._layers)
        head = model.lm_head
        self.vocab_size = self._weights.vocab = head.out_features
        self._logits = torch.empty(0, self.vocab_size)
        self._weights.logits, self._weights.logits_bias = head.blocked.data_ptr(), _pointer(head.bias)
        self._weights.logits_scales = _pointer(getattr(head, "scales", None))
        self._keep = (model, kv_caches)  # the tensors the pointers point into

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        return self._run(input_ids, positions, slot_mapping, block_tables, seq_lens, None)[0]

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor,
               prompts: PromptChunks | None = None) -> torch.Tensor:
        """The step, then the head on the final-norm hidden states of ``rows`` (int64 ``[S]``, each one
        of the step's rows, as the runner's ``sample_rows``): float32 logits ``[S, vocab]``, rounded to
        the model's dtype first, as ``compute_logits`` rounds them. With ``prompts``, the step's first
        ``D = len(seq_lens)`` rows decode (one per request) and the rest are the prompt chunks';
        ``block_tables`` then has a row per decode request and then per chunk."""
        if rows.dtype != torch.int64 or rows.dim() != 1 or not rows.is_contiguous():
            raise ValueError(f"DecodeStep: rows must be a contiguous int64 [S], got {rows.dtype} {tuple(rows.shape)}")
        return self._run(input_ids, positions, slot_mapping, block_tables, seq_lens, rows, prompts)[1]

    def _logits_of(self, num_rows: int) -> torch.Tensor:
        """``[num_rows, vocab]`` float32 of the kept buffer, grown to the most rows asked for so far."""
        if self._logits.shape[0] < num_rows:
            self._logits = torch.empty(num_rows, self.vocab_size)
        return self._logits[:num_rows]

    def _run(self, input_ids, positions, slot_mapping, block_tables, seq_lens, rows: torch.Tensor | None,
             prompts: PromptChunks | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        num_rows = input_ids.shape[0]
        num_decodes = seq_lens.shape[0] if prompts is not None else num_rows
        num_prefills = prompts.context_lens.shape[0] if prompts is not None else 0
        for name, tensor, length in (("input_ids", input_ids, num_rows), ("positions", positions, num_rows),
                                     ("slot_mapping", slot_mapping, num_rows), ("seq_lens", seq_lens, num_decodes),
                                     *(() if prompts is None else (
                                         ("query_start", prompts.query_start, num_prefills + 1),
                                         ("context_lens", prompts.context_lens, num_prefills)))):
            if tensor.dtype != torch.int64 or tensor.shape != (length,) or not tensor.is_contiguous():
                raise ValueError(f"DecodeStep: {name} must be a contiguous int64 [{length}], "
                                 f"got {tensor.dtype} {tuple(tensor.shape)}")
        if prompts is not None and (prompts.query_start[0] != 0 or prompts.query_start[-1] != num_rows - num_decodes):
            raise ValueError(f"DecodeStep: query_start must run from 0 to the {num_rows - num_decodes} prompt rows")
        num_tables = num_decodes + num_prefills
        if block_tables.dtype != torch.int64 or block_tables.dim() != 2 or block_tables.shape[0] != num_tables \
                or block_tables.stride(1) != 1:
            raise ValueError(f"DecodeStep: block_tables must be int64 [{num_tables}, blocks] with unit column "
                             f"stride, got {block_tables.dtype} {tuple(block_tables.shape)}")
        out = torch.empty(num_rows, self.hidden_size, dtype=self.dtype)
        logits = None if rows is None else self._logits_of(rows.shape[0])
        if num_rows:
            inputs = _StepInputs(num_rows, input_ids.data_ptr(), positions.data_ptr(), slot_mapping.data_ptr(),
                                 block_tables.data_ptr(), seq_lens.data_ptr(), block_tables.stride(0),
                                 self.min_chunk_tokens, out.data_ptr(), 0 if rows is None else rows.shape[0],
                                 _pointer(rows), _pointer(logits), num_decodes, num_prefills,
                                 None if prompts is None else prompts.query_start.data_ptr(),
                                 None if prompts is None else prompts.context_lens.data_ptr(),
                                 ctypes.addressof(self._cores) if self.thread_cores else None, len(self.thread_cores))
            self._kernel(_DTYPE_CODES[self.dtype], ctypes.byref(self._weights), ctypes.byref(inputs), self._arena.pointer)
        return out, logits
