"""Attention backends: ``torch`` (CPU, the reference) and, in a later issue, ``triton`` (GPU)."""

import torch

from services.engine.attention.base import AttentionBackend, AttentionMetadata
from services.engine.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]


def get_attention_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype) -> AttentionBackend:
    """``auto`` is ``torch`` until the Triton backend lands."""
    if name in ("auto", "torch"):
        return TorchAttentionBackend(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, dtype)
    raise ValueError(f"--attention-backend {name!r} is not available; use 'torch' or 'auto'")
