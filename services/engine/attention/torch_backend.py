"""Paged attention in plain torch: the CPU path, and the reference the Triton backend is checked against.

Two paths, chosen per request:

- **Decode** (one new token, float32): no copy of the cache at all. The scores are a sampled matmul
  (``torch.sparse.sampled_addmm``) of the queries against the K pool, restricted by a CSR pattern whose
  row ``(request, head)`` lists the pool rows ``slot * num_kv_heads + kv_head`` of that request's
  context; the probabilities then weight the same V pool rows in one ``embedding_bag`` sum (faster
  than CSR @ dense here). Rows are ragged, so no work is spent on padding except a small padded
  buffer for the softmax.
- **Prefill** (and decode in 16-bit dtypes, which the sparse kernels lack): each request's context is
  gathered from the pool with one ``index_select`` and attended with ``scaled_dot_product_attention``
  under a causal mask offset by the cached prefix, padded to the longest request in the group.

All index tensors are built once per step in ``prepare``; layers only run the kernels.
"""

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine.attention.base import AttentionBackend, AttentionMetadata

# The decode path builds a CSR pattern per step; torch says once per process that CSR is beta.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta", category=UserWarning)
warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled", category=UserWarning)


@dataclass
class SparseDecodeIndex:
    """CSR pattern over the flattened pools ``[num_slots * num_kv_heads, head_dim]`` for decode rows."""

    crow_indices: torch.Tensor  # [num_decodes * num_heads + 1]
    col_indices: torch.Tensor  # [nnz]: slot * num_kv_heads + kv_head, per (request, head) row
    zeros: torch.Tensor  # [nnz]: the ignored values of sampled_addmm's pattern argument
    # crow_indices[:-1] doubles as embedding_bag's offsets: one bag per (request, head) row
    padded_index: torch.Tensor  # [nnz]: position of each entry in a [num_rows, max_len] padded buffer
    max_len: int


@dataclass
class DenseIndex:
    """Gather/scatter indices for the requests attended densely (the batch's last rows).
    Padding reads stale but finite pool entries (the pools start zeroed) and is masked out."""

    kv_slots: torch.Tensor  # [num_reqs, max_seq_len]: slot of each context position
    q_rows: torch.Tensor  # [num_reqs, max_query_len]: batch row of each query (a valid row when padded)
    mask: torch.Tensor  # [num_reqs, 1, max_query_len, max_seq_len] bool: causal, offset by the prefix
    out_rows: torch.Tensor  # [num_dense_tokens]: flat index of each real query in the padded output


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    sparse_decode: SparseDecodeIndex | None = None
    dense: DenseIndex | None = None


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, dtype: torch.dtype) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.use_sparse_decode = dtype == torch.float32

    def prepare(self, metadata: AttentionMetadata) -> TorchAttentionMetadata:
        num_sparse = metadata.num_decodes if self.use_sparse_decode else 0
        sparse = self._sparse_decode_index(metadata, num_sparse) if num_sparse else None
        dense = self._dense_index(metadata, num_sparse) if num_sparse < metadata.num_reqs else None
        return TorchAttentionMetadata(**vars(metadata), sparse_decode=sparse, dense=dense)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: TorchAttentionMetadata) -> torch.Tensor:
        # k_slots, v_slots: [num_slots, num_kv_heads, head_dim] views of the pools
        k_slots = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        v_slots = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        k_slots.index_copy_(0, metadata.slot_mapping, k)
        v_slots.index_copy_(0, metadata.slot_mapping, v)
        outputs = []
        if metadata.sparse_decode is not None:
            outputs.append(self._decode(q[:metadata.num_decodes], k_cache, v_cache, metadata.sparse_decode))
        if metadata.dense is not None:
            outputs.append(self._dense(q, k_slots, v_slots, metadata.dense))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                index: SparseDecodeIndex) -> torch.Tensor:
        num_rows = q.shape[0] * self.num_heads
        # k_rows, v_rows: [num_slots * num_kv_heads, head_dim]
        k_rows = k_cache.view(-1, self.head_dim)
        v_rows = v_cache.view(-1, self.head_dim)
        shape = (num_rows, k_rows.shape[0])
        pattern = torch.sparse_csr_tensor(index.crow_indices, index.col_indices, index.zeros, shape,
                                          check_invariants=False)
        q_rows = (q * self.scale).view(num_rows, self.head_dim)  # [reqs * heads, D]
        scores = torch.sparse.sampled_addmm(pattern, q_rows, k_rows.t(), beta=0.0).values()  # [nnz]
        padded = torch.full((num_rows * index.max_len,), float("-inf"), dtype=q.dtype, device=q.device)
        padded.index_copy_(0, index.padded_index, scores)
        probs = padded.view(num_rows, index.max_len).softmax(-1).view(-1).index_select(0, index.padded_index)
        out = F.embedding_bag(index.col_indices, v_rows, index.crow_indices[:-1], mode="sum",
                              per_sample_weights=probs)  # [reqs * heads, D]
        return out.view(q.shape)  # [reqs, heads, D]

    def _dense(self, q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
               index: DenseIndex) -> torch.Tensor:
        num_reqs, max_query_len = index.q_rows.shape
        max_seq_len = index.kv_slots.shape[1]
        # q_pad: [R, heads, Q, D]; k_ctx, v_ctx: [R, kv_heads, S, D] (strided views of the gathered rows)
        q_pad = q.index_select(0, index.q_rows.view(-1)).view(num_reqs, max_query_len, self.num_heads, -1)
        k_ctx = k_slots.index_select(0, index.kv_slots.view(-1)).view(num_reqs, max_seq_len, self.num_kv_heads, -1)
        v_ctx = v_slots.index_select(0, index.kv_slots.view(-1)).view(num_reqs, max_seq_len, self.num_kv_heads, -1)
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2), k_ctx.transpose(1, 2), v_ctx.transpose(1, 2),
            attn_mask=index.mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        out = out.transpose(1, 2).reshape(num_reqs * max_query_len, self.num_heads, self.head_dim)
        return out.index_select(0, index.out_rows)  # [dense tokens, heads, D]

    def _sparse_decode_index(self, m: AttentionMetadata, num_decodes: int) -> SparseDecodeIndex:
        device = m.slot_mapping.device
        seq_lens = m.seq_lens[:num_decodes]  # [B]
        max_len = int(seq_lens.max())
        positions = torch.arange(max_len, device=device)  # [L]
        slots = m.block_tables[:num_decodes, positions // m.block_size] * m.block_size + positions % m.block_size
        kv_head = torch.arange(self.num_heads, device=device) // (self.num_heads // self.num_kv_heads)
        # cols_padded: [B, heads, L]; valid: [B, heads, L]
        cols_padded = slots.unsqueeze(1) * self.num_kv_heads + kv_head.view(1, -1, 1)
        valid = (positions.view(1, 1, -1) < seq_lens.view(-1, 1, 1)).expand_as(cols_padded)
        padded_index = valid.reshape(-1).nonzero().squeeze(1)
        col_indices = cols_padded.reshape(-1).index_select(0, padded_index)
        row_lens = seq_lens.repeat_interleave(self.num_heads)
        crow_indices = torch.cat([row_lens.new_zeros(1), row_lens.cumsum(0)])
        zeros = torch.zeros(col_indices.shape[0], dtype=torch.float32, device=device)
        return SparseDecodeIndex(crow_indices, col_indices, zeros, padded_index, max_len)

    def _dense_index(self, m: AttentionMetadata, first: int) -> DenseIndex:
        device = m.slot_mapping.device
        starts = m.query_start_loc[first:-1]  # [R]
        query_lens = m.query_start_loc[first + 1:] - starts
        context_lens = m.context_lens[first:]
        seq_lens = m.seq_lens[first:]
        max_query_len, max_seq_len = int(query_lens.max()), int(seq_lens.max())
        kv_pos = torch.arange(max_seq_len, device=device)  # [S]
        kv_slots = m.block_tables[first:, kv_pos // m.block_size] * m.block_size + kv_pos % m.block_size  # [R, S]
        q_pos = torch.arange(max_query_len, device=device)  # [Q]
        is_real = q_pos < query_lens.unsqueeze(1)  # [R, Q]
        q_rows = torch.where(is_real, starts.unsqueeze(1) + q_pos, starts.unsqueeze(1))  # [R, Q]
        mask = kv_pos.view(1, 1, -1) <= (context_lens.view(-1, 1, 1) + q_pos.view(1, -1, 1))  # [R, Q, S]
        out_rows = is_real.reshape(-1).nonzero().squeeze(1)
        return DenseIndex(kv_slots, q_rows, mask.unsqueeze(1), out_rows)
