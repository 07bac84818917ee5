"""Sampling a batch of rows as one native call (``sampling.cpp``): temperature, min_p, top_k, top_p and
the draw; greedy rows' argmax; and the sampled tokens' log-probabilities, ranks and top alternatives
(``logprobs``).

The sampler's torch path (``sampler.py``: temperature, softmax, the masks, then ``inverse_cdf.py``'s
draw) is about 25 operator calls per step whatever the batch, ~0.2 ms at one row of a 4,096-token
vocabulary on 2 cores, a tenth of a small model's decode step at one stream; its passes over the rows
with temporaries between them cost 24 ms for 64 rows of Llama 3's 128,256 tokens; and top_k or top_p
sort every row's whole vocabulary: 105 ms for 64 rows of 32,000 tokens, 440 ms of 128,256. Here each
row is a few passes on OpenMP's threads: its max, its weights exp(logit / T - max / T); min_p zeroes
the weights below min_p; top_k and top_p keep the leading run of the weights in descending order, found
from a histogram of the weights with only the bucket where the run ends sorted; then the walk to the
token where the running float64 sum passes u x the row's mass. Draws follow the same distribution as
the torch path's and, like it, take one uniform per row: a seeded request draws the same tokens alone
or in any batch. A row without a finite positive mass (all -inf, or a NaN) gets its argmax, and a token
of weight 0 is never drawn.

It takes float32 logits on the CPU where the library is built (``can_run``).
"""

import array
import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.engine.cpu_kernels.build import load_function

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _function(symbol: str, *argtypes):
    return load_function("sampling.cpp", symbol, list(argtypes))


def _kernel():
    return _function("strata_sample", _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr)


def _bitmask_kernel():
    return _function("strata_apply_bitmask", _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64)


def _penalty_kernel():
    return _function("strata_penalize", _ptr, _i64, _i64, _i64, *[_ptr] * 9, ctypes.c_int32)


def _argmax_kernel():
    return _function("strata_argmax", _ptr, _i64, _i64, _i64, _ptr)


def _logprobs_kernel():
    return _function("strata_logprobs", _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr)


def is_available() -> bool:
    """Whether the library is built here (building it on first use: call it at start-up)."""
    return _kernel() is not None


def can_run(logits: torch.Tensor) -> bool:
    """Whether ``sample`` takes these logits: ``[rows, vocab]`` float32 on the CPU, unit stride along the
    vocabulary, the library built here."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and is_available())


def sample(logits: torch.Tensor, uniforms: torch.Tensor, temperatures: Sequence[float],
           top_ks: Sequence[int] | None = None, top_ps: Sequence[float] | None = None,
           min_ps: Sequence[float] | None = None) -> torch.Tensor:
    """``logits [m, vocab]`` (see ``can_run``), a uniform in [0, 1) (float64) and a temperature > 0 per row,
    and optionally per row a top_k (0: off), top_p (in (0, 1]; 1: off) and min_p (in [0, 1]; 0: off)
    → ``[m]`` int64 token ids, row i drawn from softmax(logits[i] / temperatures[i]) restricted, in this
    order, to the tokens of probability at least min_p x the largest, the top_k most likely of those, and
    the smallest run of those, most likely first, whose mass reaches top_p."""
    rows = logits.shape[0]
    columns = {"temperatures": temperatures, "top_ks": top_ks, "top_ps": top_ps, "min_ps": min_ps}
    wrong = [f"{len(values)} {name}" for name, values in columns.items() if values is not None and len(values) != rows]
    if uniforms.shape != (rows,):
        wrong.append(f"uniforms of shape {tuple(uniforms.shape)}")
    if wrong:
        raise ValueError(f"sample: {rows} rows, but {', '.join(wrong)}")
    # The per-row parameters go in as arrays, not tensors: a step's host work runs with the caches the
    # model's weights just went through, where each torch call costs tens of microseconds.
    temperature = array.array("f", temperatures)
    top_k = _column(top_ks, 0, "q")  # None: the filter is off for every row
    top_p = _column(top_ps, 1.0, "f")
    min_p = _column(min_ps, 0.0, "f")
    uniforms = uniforms.to(torch.float64).contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        _kernel()(logits.data_ptr(), rows, logits.shape[1], logits.stride(0), _address(temperature),
                  *(None if column is None else _address(column) for column in (top_k, top_p, min_p)),
                  uniforms.data_ptr(), out.data_ptr())
    return out


def _column(values: Sequence | None, off, typecode: str) -> array.array | None:
    """``values`` as an array of C ``typecode`` (``"q"``: int64, ``"f"``: float32), or None where there are
    none or every one is ``off``."""
    if values is None or all(value == off for value in values):
        return None
    return array.array(typecode, values)


def _address(values: array.array) -> int:
    return values.buffer_info()[0]


def apply_bitmask(logits: torch.Tensor, logit_rows: Sequence[int], bitmask: torch.Tensor, mask_rows: Sequence[int],
                  unprocessed: torch.Tensor) -> None:
    """Sets ``logits[logit_rows[p]]``'s disallowed tokens to -inf in place, by bitmask row ``mask_rows[p]``
    (``bitmask`` int32 ``[n, words]``, bit j of word w: token 32 w + j allowed; tokens past its words are
    not); a row left with no logit above -inf takes its row of ``unprocessed``, masked. ``logits`` and
    ``unprocessed``: see ``can_run``, the same shape."""
    if logits.shape != unprocessed.shape or bitmask.dtype != torch.int32 or not bitmask.is_contiguous() \
            or len(logit_rows) != len(mask_rows):
        raise ValueError(f"apply_bitmask: logits {tuple(logits.shape)}, unprocessed {tuple(unprocessed.shape)}, "
                         f"bitmask {bitmask.dtype} contiguous={bitmask.is_contiguous()}, "
                         f"{len(logit_rows)} logit rows and {len(mask_rows)} mask rows")
    if not logit_rows:
        return
    logit_index, mask_index = array.array("q", logit_rows), array.array("q", mask_rows)
    _bitmask_kernel()(logits.data_ptr(), unprocessed.data_ptr(), logits.shape[1], logits.stride(0),
                      unprocessed.stride(0), bitmask.data_ptr(), bitmask.shape[1], _address(logit_index),
                      _address(mask_index), len(logit_rows))


@dataclass(frozen=True)
class PenaltyRows:
    """A step's penalties for ``penalize``, one entry per row of its logits: the address of the row's
    distinct seen token ids (int64) and how many (0: no repetition penalty), its repetition penalty; the
    address of its distinct output token ids (int64) and of their counts (float32) and how many (0: no
    frequency or presence penalty), its frequency and presence penalties. Arrays of C int64 (``"q"``)
    and float32 (``"f"``); the token arrays must outlive the calls."""

    seen_at: array.array
    num_seen: array.array
    repetition: array.array
    output_at: array.array
    counts_at: array.array
    num_output: array.array
    frequency: array.array
    presence: array.array

    @classmethod
    def empty(cls) -> "PenaltyRows":
        return cls(*(array.array(code) for code in "qqfqqqff"))

    def __len__(self) -> int:
        return len(self.seen_at)


def penalize(logits: torch.Tensor, rows: PenaltyRows) -> torch.Tensor:
    """Row i of ``logits`` (see ``can_run``; ``len(rows)`` rows) penalized in place by ``rows``' entry i:
    the repetition penalty on its seen tokens (a positive logit divided by it, another multiplied), then
    its output tokens' logits less frequency x count and presence, as ``logit_edits`` defines them. Token
    ids outside the vocabulary are left alone. Returns the values replaced, for ``unpenalize``."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"penalize: {logits.shape[0]} rows of logits, {len(rows)} rows of penalties")
    saved = torch.empty(sum(rows.num_seen) + sum(rows.num_output), dtype=torch.float32)
    _penalty_call(logits, rows, saved, restore=False)
    return saved


def unpenalize(logits: torch.Tensor, rows: PenaltyRows, saved: torch.Tensor) -> None:
    """Puts back the logits ``penalize(logits, rows)`` changed, from what it returned."""
    _penalty_call(logits, rows, saved, restore=True)


def _penalty_call(logits: torch.Tensor, rows: PenaltyRows, saved: torch.Tensor, restore: bool) -> None:
    if len(rows):
        _penalty_kernel()(logits.data_ptr(), len(rows), logits.shape[1], logits.stride(0),
                          *(_address(column) for column in (rows.seen_at, rows.num_seen, rows.repetition,
                                                            rows.output_at, rows.counts_at, rows.num_output,
                                                            rows.frequency, rows.presence)),
                          saved.data_ptr(), int(restore))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits [m, vocab]`` (see ``can_run``) → ``[m]`` int64, each row's index as ``torch.argmax`` picks
    it: the first NaN, else the first of the largest."""
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    if logits.shape[0]:
        _argmax_kernel()(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr())
    return out


def logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """``logits [m, vocab]`` (see ``can_run``), a token id per row and ``k`` (0 to vocab) → per row the
    token's log-probability under log_softmax(logits) ``[m]`` float32, its rank ``[m]`` int64 (1 + how many
    logits exceed its own), and the ``k`` largest log-probabilities' ids ``[m, k]`` int64 and values
    ``[m, k]`` float32, most likely first (equal ones: the lower id first). One pass for logZ (float64
    sums), one for the rank and the top k: no ``[m, vocab]`` tensor of log-probabilities."""
    rows, vocab = logits.shape
    tokens = tokens.to(torch.int64).contiguous()
    if tokens.shape != (rows,) or not 0 <= k <= vocab:
        raise ValueError(f"logprobs: {rows} rows of {vocab}, but tokens of shape {tuple(tokens.shape)} and k={k}")
    token_logprobs, ranks = torch.empty(rows), torch.empty(rows, dtype=torch.int64)
    top_ids, top_logprobs = torch.empty(rows, k, dtype=torch.int64), torch.empty(rows, k)
    if rows:
        _logprobs_kernel()(logits.data_ptr(), rows, vocab, logits.stride(0), tokens.data_ptr(), k,
                           token_logprobs.data_ptr(), ranks.data_ptr(), top_ids.data_ptr(), top_logprobs.data_ptr())
    return token_logprobs, ranks, top_ids, top_logprobs
