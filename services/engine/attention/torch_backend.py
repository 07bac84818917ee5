"""Paged attention in plain torch, with a native decode kernel: the CPU path, and the reference the
Triton backend is checked against.

Five paths, chosen per request:

- **Native decode** (one new token, any dtype, on the CPU where ``cpu_kernels.paged_decode`` is built):
  a C++ kernel reads each request's K/V rows straight from the pools through its block table, once
  per GQA group, with a float32 online softmax; no index, no copy, no padding. It is faster than both
  torch decode paths below, in float32 as in bfloat16, at every batch and context measured.
- **Sparse decode** (one new token, float32, without the native kernel): no copy of the cache. The
  scores are a sampled matmul (``torch.sparse.sampled_addmm``) of the queries against the K pool,
  restricted by a CSR pattern whose row ``(request, head)`` lists the pool rows
  ``slot * num_kv_heads + kv_head`` of that request's context; the probabilities then weight the same
  V pool rows in one ``embedding_bag`` sum (faster than CSR @ dense here). Rows are ragged, so no work
  is spent on padding except a small padded buffer for the softmax.
- **Gathered decode** (one new token, 16-bit dtypes, which the sparse kernels lack, without the native
  kernel): the contexts are gathered from the pool whole blocks at a time with one ``index_select``
  (contiguous copies of ``block_size`` tokens, about twice as fast as token rows), padded to the
  longest, and attended with ``scaled_dot_product_attention`` under a length mask.
- **Native prefill** (more than one new token, float32 or float16, and bfloat16 where the kernel runs on
  AMX tiles or the CPU has none, on the CPU where ``cpu_kernels.paged_prefill`` is built): a C++ kernel attends every prefill row of
  the step in one call, causally, straight from the pools (cached prefix, earlier chunks and the new K/V
  alike), skipping the keys past each block of queries. Against the SDPA path below, one prompt of the
  small shape's heads (8 over 4, dim 64), two threads: float32 1.4-1.6x faster at 128-288 tokens, 2.0x
  at 512, 1.1x at 2048; float16 1.6-1.9x at 128-512, 1.2x at 2048 (a 2-core Xeon). On a 2-core Zen 3
  (AVX2): float32 1.3-1.6x at 128-512, 1.0x at 2048; bfloat16 1.6-1.7x at 288-512, 1.3x at 2048. On a
  2-core Zen 4 (AVX512-BF16, where bfloat16 multiplies in bfloat16 pairs): bfloat16 2.9-3.6x at 128-512,
  2.3x at 2048. On a 2-vCPU Xeon with AMX, where bfloat16 runs on its tiles (head_dim a multiple of 32):
  against SDPA on the same tiles 1.06-1.2x faster at 288-512 tokens, 0.95x at 2048, 0.6x at 64 (0.27,
  0.70, 8.3 and 0.070 ms), where the bfloat16 pairs ran 1.5-3.2x slower than SDPA.
- **Prefill** otherwise, one ``scaled_dot_product_attention`` per request, so no work is spent on
  padding: a request without a cached prefix attends its own new K/V with ``is_causal``; one with a
  prefix gathers its context from the pool under a causal mask offset by it. bfloat16 stays here where
  the CPU has AMX but the kernel cannot use it (a head_dim not a multiple of 32): SDPA's CPU kernel
  runs it on the tiles.

A layer with a sliding window W (Mistral, some Qwen2 layers) sees the last W positions only: its decode
rows list just those, and its prefill masks cut what lies further back. The cache keeps every block.

The index tensors are built once per step and window, by the first layer that needs them; the other
layers only run the kernels. The native decode needs none: it reads the step's block tables and lengths.
"""

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine.attention.base import AttentionBackend, AttentionMetadata
from services.engine.cpu_kernels import paged_decode, paged_prefill


def native_prefill_keeps_up(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the native prefill kernel is at least as fast as SDPA here (see the module docstring):
    float32 and float16; bfloat16 where the kernel runs on AMX tiles too, or where the CPU has none for
    SDPA to run it on (torch unable to say: as with AMX)."""
    if dtype != torch.bfloat16 or paged_prefill.bf16_uses_amx(head_dim):
        return True
    return not getattr(torch.cpu, "_is_amx_tile_supported", lambda: True)()


# The decode path builds a CSR pattern per step; torch says once per process that CSR is beta.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta", category=UserWarning)
warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled", category=UserWarning)


@dataclass
class SparseDecodeIndex:
    """CSR pattern over the flattened pools ``[num_slots * num_kv_heads, head_dim]`` for decode rows."""

    crow_indices: torch.Tensor  # [num_decodes * num_heads + 1]
    col_indices: torch.Tensor  # [nnz]: slot * num_kv_heads + kv_head, per (request, head) row
    # crow_indices[:-1] doubles as embedding_bag's offsets: one bag per (request, head) row
    padded_index: torch.Tensor  # [nnz]: position of each entry in padded_scores
    padded_scores: torch.Tensor  # [num_rows, max_span]: -inf, except at padded_index, where each layer writes


@dataclass
class GatheredDecodeIndex:
    """Gather indices for decode rows attended densely. Padding reads stale but finite pool entries
    (the pools start zeroed) and is masked out."""

    block_ids: torch.Tensor  # [num_reqs, max_blocks]: each request's blocks, padded with block 0
    mask: torch.Tensor  # [num_reqs, 1, 1, max_blocks * block_size] bool: the position is in the (windowed) context


@dataclass
class PrefillChunk:
    """One request's new rows ``start:end``, attended on their own."""

    start: int
    end: int
    # None for plain causal attention over the chunk's own K/V (no cached prefix, no window cut); else
    kv_slots: torch.Tensor | None  # [S]: the pool slots of the keys the chunk sees
    mask: torch.Tensor | None  # [end - start, S] bool: causal (and windowed), offset by the prefix


@dataclass
class StepIndex:
    """What one step's layers of one sliding window (None: whole contexts) attend with. Decode rows
    take at most one path: native (no index: the kernel reads the block tables), sparse or gathered;
    prefill rows either the native kernel (``native_prefill_starts``) or SDPA per chunk (``prefills``)."""

    native_decode: bool
    sparse_decode: SparseDecodeIndex | None
    gathered_decode: GatheredDecodeIndex | None
    prefills: list[PrefillChunk]
    # [num_prefills + 1]: each prefill request's first row among the prefill rows (native prefill), or None
    native_prefill_starts: torch.Tensor | None = None


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    indices: dict[int | None, StepIndex]  # by sliding window, built by the first layer of the step that needs it


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, dtype: torch.dtype,
                 use_native_kernels: bool = True) -> None:
        """``use_native_kernels``: decode (and float32 or float16 prefill) rows on the CPU through the native kernels
        where they are built and take this shape (False: the torch paths everywhere, as where there is
        no compiler)."""
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.use_native_decode = use_native_kernels and paged_decode.can_run(num_heads, num_kv_heads, head_dim, dtype)
        self.use_native_prefill = (use_native_kernels and paged_prefill.can_run(num_heads, num_kv_heads, head_dim, dtype)
                                   and native_prefill_keeps_up(dtype, head_dim))
        self.use_sparse_decode = dtype == torch.float32

    def prepare(self, metadata: AttentionMetadata) -> TorchAttentionMetadata:
        return TorchAttentionMetadata(**vars(metadata), indices={})

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: TorchAttentionMetadata, sliding_window: int | None = None
                ) -> torch.Tensor:
        # k_slots, v_slots: [num_slots, num_kv_heads, head_dim] views of the pools
        k_slots = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        v_slots = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        k_slots.index_copy_(0, metadata.slot_mapping, k)
        v_slots.index_copy_(0, metadata.slot_mapping, v)
        index = metadata.indices.get(sliding_window)
        if index is None:
            index = metadata.indices[sliding_window] = self._step_index(metadata, sliding_window)
        outputs = []
        num_decodes = metadata.num_decodes
        decode_q = q[:num_decodes]
        if index.native_decode:
            outputs.append(paged_decode.paged_decode(decode_q, k_cache, v_cache, metadata.block_tables[:num_decodes],
                                                     metadata.seq_lens[:num_decodes], self.scale, sliding_window))
        if index.sparse_decode is not None:
            outputs.append(self._decode(decode_q, k_cache, v_cache, index.sparse_decode))
        if index.gathered_decode is not None:
            outputs.append(self._gathered_decode(decode_q, k_cache, v_cache, index.gathered_decode))
        if index.native_prefill_starts is not None:
            outputs.append(paged_prefill.paged_prefill(
                q[num_decodes:], k_cache, v_cache, metadata.block_tables[num_decodes:], index.native_prefill_starts,
                metadata.context_lens[num_decodes:], self.scale, sliding_window))
        outputs.extend(self._prefill(q, k, v, k_slots, v_slots, chunk) for chunk in index.prefills)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _step_index(self, metadata: AttentionMetadata, window: int | None) -> StepIndex:
        num_decodes = metadata.num_decodes
        native = bool(num_decodes) and self.use_native_decode and metadata.slot_mapping.device.type == "cpu"
        sparse = gathered = None
        if num_decodes and not native and self.use_sparse_decode:
            sparse = self._sparse_decode_index(metadata, num_decodes, window)
        elif num_decodes and not native:
            gathered = self._gathered_decode_index(metadata, num_decodes, window)
        if metadata.num_prefills and self.use_native_prefill and metadata.slot_mapping.device.type == "cpu":
            starts = metadata.query_start_loc[num_decodes:] - metadata.query_start_loc[num_decodes]
            return StepIndex(native, sparse, gathered, [], starts)
        return StepIndex(native, sparse, gathered, self._prefill_chunks(metadata, window))

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                index: SparseDecodeIndex) -> torch.Tensor:
        num_rows = q.shape[0] * self.num_heads
        # k_rows, v_rows: [num_slots * num_kv_heads, head_dim]
        k_rows = k_cache.view(-1, self.head_dim)
        v_rows = v_cache.view(-1, self.head_dim)
        # The sampled matmul writes the scores into the pattern's own zeroed values (out=pattern), which
        # spares the copy of the pattern it otherwise makes.
        scores = torch.zeros(index.col_indices.shape[0], dtype=q.dtype, device=q.device)  # [nnz]
        pattern = torch.sparse_csr_tensor(index.crow_indices, index.col_indices, scores, (num_rows, k_rows.shape[0]),
                                          check_invariants=False)
        torch.sparse.sampled_addmm(pattern, q.reshape(num_rows, self.head_dim), k_rows.t(), beta=0.0,
                                   alpha=self.scale, out=pattern)
        index.padded_scores.view(-1).index_copy_(0, index.padded_index, scores)
        probs = index.padded_scores.softmax(-1).view(-1).index_select(0, index.padded_index)
        out = F.embedding_bag(index.col_indices, v_rows, index.crow_indices[:-1], mode="sum",
                              per_sample_weights=probs)  # [reqs * heads, D]
        return out.view(q.shape)  # [reqs, heads, D]

    def _gathered_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         index: GatheredDecodeIndex) -> torch.Tensor:
        num_reqs = index.block_ids.shape[0]
        blocks = index.block_ids.view(-1)
        # k_ctx, v_ctx: [R, max_blocks * block_size, kv_heads, D]
        k_ctx = k_cache.index_select(0, blocks).view(num_reqs, -1, self.num_kv_heads, self.head_dim)
        v_ctx = v_cache.index_select(0, blocks).view(num_reqs, -1, self.num_kv_heads, self.head_dim)
        out = self._attend(q.unsqueeze(1), k_ctx, v_ctx, attn_mask=index.mask)  # [R, 1, heads, D]
        return out.squeeze(1)  # [R, heads, D]

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_slots: torch.Tensor,
                 v_slots: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
        q = q[chunk.start:chunk.end]  # [Q, heads, D]
        if chunk.kv_slots is None:
            out = self._attend(q.unsqueeze(0), k[chunk.start:chunk.end].unsqueeze(0),
                               v[chunk.start:chunk.end].unsqueeze(0), is_causal=True)
        else:  # k_ctx, v_ctx: [1, S, kv_heads, D]
            k_ctx = k_slots.index_select(0, chunk.kv_slots).unsqueeze(0)
            v_ctx = v_slots.index_select(0, chunk.kv_slots).unsqueeze(0)
            out = self._attend(q.unsqueeze(0), k_ctx, v_ctx, attn_mask=chunk.mask)
        return out.squeeze(0)  # [Q, heads, D]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **mask) -> torch.Tensor:
        """``q: [B, Q, heads, D]``, ``k, v: [B, S, kv_heads, D]`` → ``[B, Q, heads, D]``."""
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
                                             **mask)
        return out.transpose(1, 2)

    def _sparse_decode_index(self, m: AttentionMetadata, num_decodes: int, window: int | None) -> SparseDecodeIndex:
        device = m.slot_mapping.device
        seq_lens = m.seq_lens[:num_decodes].unsqueeze(1)  # [B, 1]
        first = (seq_lens - window).clamp_(min=0) if window else torch.zeros_like(seq_lens)  # [B, 1]
        span = int((seq_lens - first).max())
        positions = first + torch.arange(span, device=device)  # [B, L]: each row's window, padded past its end
        valid = positions < seq_lens  # [B, L]
        positions = torch.minimum(positions, seq_lens - 1)  # keep the padding inside the block table
        blocks = m.block_tables[:num_decodes].gather(1, positions // m.block_size)
        slots = blocks * m.block_size + positions % m.block_size  # [B, L]
        kv_head = torch.arange(self.num_heads, device=device) // (self.num_heads // self.num_kv_heads)
        # cols_padded: [B, heads, L]; valid: [B, heads, L]
        cols_padded = slots.unsqueeze(1) * self.num_kv_heads + kv_head.view(1, -1, 1)
        padded_index = valid.unsqueeze(1).expand_as(cols_padded).reshape(-1).nonzero().squeeze(1)
        col_indices = cols_padded.reshape(-1).index_select(0, padded_index)
        row_lens = (seq_lens - first).squeeze(1).repeat_interleave(self.num_heads)
        crow_indices = torch.cat([row_lens.new_zeros(1), row_lens.cumsum(0)])
        padded_scores = torch.full((num_decodes * self.num_heads, span), float("-inf"), device=device)
        return SparseDecodeIndex(crow_indices, col_indices, padded_index, padded_scores)

    def _gathered_decode_index(self, m: AttentionMetadata, num_decodes: int, window: int | None
                               ) -> GatheredDecodeIndex:
        seq_lens = m.seq_lens[:num_decodes].unsqueeze(1)  # [R, 1]
        num_blocks = -(-int(seq_lens.max()) // m.block_size)
        kv_pos = torch.arange(num_blocks * m.block_size, device=m.slot_mapping.device)  # [S]
        mask = kv_pos < seq_lens  # [R, S]
        if window:
            mask &= kv_pos >= seq_lens - window
        return GatheredDecodeIndex(m.block_tables[:num_decodes, :num_blocks].contiguous(),
                                   mask.view(num_decodes, 1, 1, -1))

    def _prefill_chunks(self, m: AttentionMetadata, window: int | None) -> list[PrefillChunk]:
        device = m.slot_mapping.device
        first = m.num_decodes
        starts, context_lens = m.query_start_loc[first:].tolist(), m.context_lens[first:].tolist()
        chunks = []
        for i, context_len in enumerate(context_lens):
            start, end = starts[i], starts[i + 1]
            num_new = end - start
            if context_len == 0 and (window is None or num_new <= window):
                chunks.append(PrefillChunk(start, end, None, None))  # plain causal over its own K/V
                continue
            # The keys any of the chunk's queries sees: from the first query's window start on.
            kv_first = max(0, context_len - window + 1) if window else 0
            kv_pos = torch.arange(kv_first, context_len + num_new, device=device)  # [S]
            q_pos = context_len + torch.arange(num_new, device=device).unsqueeze(1)  # [Q, 1]
            mask = kv_pos <= q_pos  # [Q, S]
            if window:
                mask &= kv_pos > q_pos - window
            table = m.block_tables[first + i]
            kv_slots = table[kv_pos // m.block_size] * m.block_size + kv_pos % m.block_size
            chunks.append(PrefillChunk(start, end, kv_slots, mask))
        return chunks
