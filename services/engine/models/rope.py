"""Rotary position embedding (the GPT-NeoX "rotate half" layout that HF Llama uses), with the
default, linear, dynamic (NTK), llama3 and yarn frequency schedules."""

import math

import torch
from torch import nn

from services.engine.models.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """The inverse frequencies ``[head_dim // 2]`` (float32) and the factor cos/sin are scaled by."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    p = rope.params
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / p["factor"], 1.0
    if rope.rope_type == "dynamic":
        return _dynamic_ntk_inv_freq(rope.theta, head_dim, p), 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, p), 1.0
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope.theta, head_dim, p)
    raise ValueError(f"unsupported rope type {rope.rope_type!r}")


def _dynamic_ntk_inv_freq(theta: float, head_dim: int, p: dict) -> torch.Tensor:
    """Dynamic NTK scaling as vLLM serves it: one base for every position, the one transformers' dynamic
    rope reaches at the extended length (``factor`` x the original ``max_position_embeddings``). transformers
    itself keeps the original base up to that original length and raises it with the sequence's length
    beyond, which keys already in a KV cache cannot follow."""
    factor = p["factor"]
    base = theta * (factor * factor - (factor - 1)) ** (head_dim / (head_dim - 2))
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(theta: float, head_dim: int, p: dict) -> tuple[torch.Tensor, float]:
    factor = p["factor"]
    old_len = p["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return head_dim * math.log(old_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin per position. ``tables`` gathers a step's rows once; ``apply_rotary_``
    rotates q and k with them in every layer."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(rope, head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, D/2]
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        self.cos = torch.cat((cos, cos), dim=-1).to(device=device, dtype=dtype)  # [P, D]
        self.sin = torch.cat((sin, -sin), dim=-1).to(device=device, dtype=dtype)  # [P, D]: signs for apply_rotary_

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` for ``positions [T]``, each ``[T, 1, D]``."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates ``x: [T, heads, D]`` in place: ``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`` for the
    halves ``x1, x2``, rounded exactly as HF's ``x * cos + rotate_half(x) * sin``."""
    partner = x * sin  # [T, heads, D]: (x1 * sin, -(x2 * sin))
    x.mul_(cos)
    x1, x2 = x.chunk(2, dim=-1)
    partner1, partner2 = partner.chunk(2, dim=-1)
    x1.add_(partner2)
    x2.add_(partner1)
