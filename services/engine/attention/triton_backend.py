"""The GPU attention backend: KV writes through the ``kv_store`` kernel, decode through
``paged_decode`` and prefill chunks (with or without a cached prefix) through ``paged_prefill``, all
reading the block pool in place; and, through ``use_triton_kernels``, the model's RMSNorm,
SiLU-and-mul and rotary embedding as kernels too. Block sizes under 16 (too small for ``tl.dot``)
prefill through the torch backend's ``scaled_dot_product_attention`` paths instead.

On the CPU it runs only under ``TRITON_INTERPRET=1`` (the tests do), which is for correctness, not speed.
"""

import torch

from services.engine.attention.base import AttentionMetadata
from services.engine.attention.torch_backend import StepIndex, TorchAttentionBackend, TorchAttentionMetadata
from services.engine.kernels.kv_store import kv_store
from services.engine.kernels.paged_decode import paged_decode
from services.engine.kernels.paged_prefill import paged_prefill

MIN_PREFILL_BLOCK_SIZE = 16


class TritonAttentionBackend(TorchAttentionBackend):
    use_triton_kernels = True  # the model's RMSNorm, SiLU-and-mul and rotary run as kernels too

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: TorchAttentionMetadata, sliding_window: int | None = None
                ) -> torch.Tensor:
        kv_store(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        num_decodes = metadata.num_decodes
        if num_decodes:
            out[:num_decodes] = paged_decode(q[:num_decodes], k_cache, v_cache, metadata.block_tables[:num_decodes],
                                             metadata.seq_lens[:num_decodes], self.scale, sliding_window)
        if not metadata.num_prefills:
            return out
        if metadata.block_size >= MIN_PREFILL_BLOCK_SIZE:
            paged_prefill(q, k_cache, v_cache, metadata.block_tables, metadata.query_start_loc, metadata.context_lens,
                          num_decodes, metadata.num_prefills, metadata.max_query_len, self.scale, out, sliding_window)
            return out
        index = metadata.indices.get(sliding_window)
        if index is None:
            index = metadata.indices[sliding_window] = self._step_index(metadata, sliding_window)
        k_slots = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        v_slots = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        for chunk in index.prefills:
            out[chunk.start:chunk.end] = self._prefill(q, k, v, k_slots, v_slots, chunk)
        return out

    def _step_index(self, metadata: AttentionMetadata, window: int | None) -> StepIndex:
        return StepIndex(False, None, None, self._prefill_chunks(metadata, window))  # decode needs no index
