"""Attention backends: ``torch`` (the CPU path, and the reference) and ``triton`` (GPU kernels for
the KV store, paged decode and paged prefill)."""

import importlib.util
import os

import torch

from services.engine.attention.base import AttentionBackend, AttentionMetadata
from services.engine.attention.torch_backend import TorchAttentionBackend
from services.engine.config import ATTENTION_BACKENDS as BACKENDS

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]


def get_attention_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                          device: torch.device = torch.device("cpu"), block_size: int = 16) -> AttentionBackend:
    """``auto`` is ``triton`` on CUDA (when triton is installed and the block size a power of two),
    else ``torch``."""
    if name not in BACKENDS:
        raise ValueError(f"--attention-backend {name!r} is not one of {', '.join(BACKENDS)}")
    triton_usable = importlib.util.find_spec("triton") is not None and not block_size & (block_size - 1)
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_usable else "torch"
    args = (num_heads, num_kv_heads, head_dim, head_dim ** -0.5, dtype)
    if name == "torch":
        return TorchAttentionBackend(*args)
    if not triton_usable:
        raise ValueError("--attention-backend triton needs the triton package and a power-of-two --block-size")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--attention-backend triton runs on CUDA (or on the CPU under TRITON_INTERPRET=1, "
                         "for tests); use --attention-backend torch on the CPU")
    from services.engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(*args)
