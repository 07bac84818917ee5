"""The GPU attention backend: KV writes through the ``kv_store`` kernel and decode through the
``paged_decode`` kernel (and, through ``use_triton_kernels``, the model's RMSNorm, SiLU-and-mul and
rotary embedding as kernels) (no copy of the cache, GQA groups read each K/V row once, sliding windows
skip whole blocks). Prefill, with or without a cached prefix, still runs the torch backend's
``scaled_dot_product_attention`` paths; a paged prefill kernel is the next step.

On the CPU it runs only under ``TRITON_INTERPRET=1`` (the tests do), which is for correctness, not speed.
"""

import torch

from services.engine.attention.base import AttentionMetadata
from services.engine.attention.torch_backend import StepIndex, TorchAttentionBackend, TorchAttentionMetadata
from services.engine.kernels.kv_store import kv_store
from services.engine.kernels.paged_decode import paged_decode


class TritonAttentionBackend(TorchAttentionBackend):
    use_triton_kernels = True  # the model's RMSNorm, SiLU-and-mul and rotary run as kernels too
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: TorchAttentionMetadata, sliding_window: int | None = None
                ) -> torch.Tensor:
        kv_store(k, v, k_cache, v_cache, metadata.slot_mapping)
        outputs = []
        num_decodes = metadata.num_decodes
        if num_decodes:
            outputs.append(paged_decode(q[:num_decodes], k_cache, v_cache, metadata.block_tables[:num_decodes],
                                        metadata.seq_lens[:num_decodes], self.scale, sliding_window))
        if metadata.num_prefills:
            index = metadata.indices.get(sliding_window)
            if index is None:
                index = metadata.indices[sliding_window] = self._step_index(metadata, sliding_window)
            k_slots = k_cache.view(-1, self.num_kv_heads, self.head_dim)
            v_slots = v_cache.view(-1, self.num_kv_heads, self.head_dim)
            outputs.extend(self._prefill(q, k, v, k_slots, v_slots, chunk) for chunk in index.prefills)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _step_index(self, metadata: AttentionMetadata, window: int | None) -> StepIndex:
        return StepIndex(None, None, self._prefill_chunks(metadata, window))  # decode needs no index
