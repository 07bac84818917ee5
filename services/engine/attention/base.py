"""The attention backend interface: one step's batch layout, and the op every layer calls."""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """One step's flat batch as attention sees it, built once per step and shared by every layer.

    Requests are ordered decodes first: the first ``num_decodes`` requests have exactly one new token
    (so the first ``num_decodes`` rows of the batch are theirs, one each), the remaining
    ``num_prefills`` have one or more. Request ``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]``,
    whose positions are ``context_lens[i] .. seq_lens[i] - 1``; its K/V for positions ``< context_lens[i]``
    are already in the cache. All tensors live on the model's device.
    """

    num_decodes: int
    num_prefills: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64
    seq_lens: torch.Tensor  # [num_reqs] int64: cached + new tokens
    context_lens: torch.Tensor  # [num_reqs] int64: tokens already in the cache
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int64, rows padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of each new token
    max_query_len: int
    max_seq_len: int
    block_size: int

    @property
    def num_reqs(self) -> int:
        return self.num_decodes + self.num_prefills

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


class AttentionBackend(ABC):
    """Paged attention over per-layer K/V pools ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

    # Whether the model should also run its norms, activation and rotary embedding as Triton kernels
    use_triton_kernels = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        """Called once per step before the forward pass; a backend may return a subclass carrying its
        own precomputed index tensors. The result is what every layer's ``forward`` receives."""
        return metadata

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: AttentionMetadata, sliding_window: int | None = None
                ) -> torch.Tensor:
        """Store the new ``k``, ``v`` ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping``, then
        return causal attention of ``q`` ``[num_tokens, num_heads, head_dim]`` over each request's
        context, as ``[num_tokens, num_heads, head_dim]``. With ``sliding_window`` W, the query at
        position p sees only the keys at positions p - W + 1 .. p (as transformers' sliding window)."""
