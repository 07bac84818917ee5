"""Temperature sampling of a batch of rows as one native call (``sampling.cpp``).

The sampler's torch path (``sampler.py``: temperature, softmax, then ``inverse_cdf.py``'s draw) is about
25 operator calls per step whatever the batch, ~0.2 ms at one row of a 4,096-token vocabulary on
2 cores, a tenth of a small model's decode step at one stream; and its passes over the rows with
temporaries between them cost 24 ms for 64 rows of Llama 3's 128,256 tokens. Here each row is three
passes on OpenMP's threads: its max, its weights exp(logit / T - max / T) with their float64 sums per
block, and the walk to the token where the running sum passes u x the row's mass. Draws follow the
same distribution as the torch path's and, like it, take one uniform per row: a seeded request draws
the same tokens alone or in any batch. A row without a finite positive mass (all -inf, or a NaN) gets
its argmax, and a token of weight 0 is never drawn.

It serves rows that only set a temperature (no top_k, top_p or min_p, as OpenAI's defaults), float32
logits on the CPU, where the library is built (``can_run``).
"""

import ctypes
import functools

import torch

from services.engine.cpu_kernels.build import load_function

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _kernel():
    return load_function("sampling.cpp", "strata_sample_temperature", [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr])


def is_available() -> bool:
    """Whether the library is built here (building it on first use: call it at start-up)."""
    return _kernel() is not None


def can_run(logits: torch.Tensor) -> bool:
    """Whether ``sample_temperature`` takes these logits: ``[rows, vocab]`` float32 on the CPU, unit stride
    along the vocabulary, the library built here."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and is_available())


def sample_temperature(logits: torch.Tensor, temperatures: list[float], uniforms: torch.Tensor) -> torch.Tensor:
    """``logits [m, vocab]`` (see ``can_run``), a temperature > 0 and a uniform in [0, 1) (float64) per row
    → ``[m]`` int64 token ids, row i drawn from softmax(logits[i] / temperatures[i])."""
    rows = logits.shape[0]
    if len(temperatures) != rows or uniforms.shape != (rows,):
        raise ValueError(f"sample_temperature: {rows} rows, {len(temperatures)} temperatures, uniforms "
                         f"{tuple(uniforms.shape)}")
    temperature = torch.tensor(temperatures, dtype=torch.float32)
    uniforms = uniforms.to(torch.float64).contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        _kernel()(logits.data_ptr(), rows, logits.shape[1], logits.stride(0), temperature.data_ptr(),
                  uniforms.data_ptr(), out.data_ptr())
    return out
