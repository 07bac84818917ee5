"""Every layer's attention call, which a compiled forward sees as one opaque op.

Eager, ``paged_attention`` calls the backend directly. Under ``torch.compile`` it becomes the custom
op ``strata::paged_attention``, which the compiler neither traces nor fuses: it takes the layer's
tensors (q, k, v and the K/V pools it writes) and nothing else, while the step's backend and metadata
(Python objects that a graph cannot carry) come from ``attention_step``, the context a compiled
forward runs in, as vLLM's forward context. So the whole model is one graph per shape, with no break
per layer (a ``torch.compiler.disable`` on the call instead breaks the graph around it, and every
layer then resumes in a frame of its own, compiled once per layer and guarded on its weights).
"""

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from services.engine.attention.base import AttentionBackend, AttentionMetadata

_step = threading.local()  # .current: (backend, metadata) of the compiled forward running in this thread


@contextmanager
def attention_step(backend: AttentionBackend, metadata: AttentionMetadata) -> Iterator[None]:
    """Runs a compiled forward whose ``strata::paged_attention`` calls attend with ``metadata``."""
    previous = getattr(_step, "current", None)
    _step.current = (backend, metadata)
    try:
        yield
    finally:
        _step.current = previous


@torch.library.custom_op("strata::paged_attention", mutates_args=("k_cache", "v_cache"))
def _paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, sliding_window: int) -> torch.Tensor:
    current = getattr(_step, "current", None)
    if current is None:
        raise RuntimeError("strata::paged_attention runs only inside attention_step(backend, metadata)")
    backend, metadata = current
    # The compiled graph expects the fresh, contiguous [T, heads, D] its fake promises.
    return backend.forward(q, k, v, k_cache, v_cache, metadata, sliding_window or None).contiguous()


@_paged_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
      sliding_window: int) -> torch.Tensor:
    return q.new_empty(q.shape)


def paged_attention(backend: AttentionBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                    sliding_window: int | None) -> torch.Tensor:
    """``backend.forward``; while compiling, the opaque op that calls it with ``attention_step``'s metadata."""
    if torch.compiler.is_compiling():
        return _paged_attention_op(q, k, v, k_cache, v_cache, sliding_window or 0)
    return backend.forward(q, k, v, k_cache, v_cache, metadata, sliding_window)
