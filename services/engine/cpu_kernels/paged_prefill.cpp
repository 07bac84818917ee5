// Paged prefill attention on the CPU: the new tokens of each request attend, causally, to every position
// up to their own, K/V read straight from the block pools (a cached prefix, an earlier chunk and this
// chunk's own K/V, which the caller stored first, alike).
//
// A work item is one kv head of a block of a request's query tokens: the GQA group's heads of those
// tokens, M = tokens x group <= kRows query rows. Their keys go by in tiles of kKeyTile tokens, each tile's
// K and V rows converted once into float32 scratch, and an online softmax runs per query row:
//   scores^T [tile][M] = K_tile Q^T: 4 keys x 64 rows of float32 FMAs at a time, each key element
//                        broadcast against Q^T's rows (Q^T is laid out once per item, by 16 x 16
//                        transposes), so no dot product is reduced across lanes;
//   the causal (and sliding-window) mask, the running max and sum, lane-wise over the rows;
//   O [M][D] += P V_tile: 4 rows x 64 dims of FMAs at a time.
// Tiles past a block's last query position are never read, and the next tile's rows are asked for
// from memory while one is loaded. Accumulation is float32 whatever the pools hold (float32, bfloat16
// or float16); the output is float32 (the caller casts). Measured against SDPA in torch_backend.py.
//
// bfloat16 pools on a CPU with AVX512-BF16 (and an even head_dim) multiply in bfloat16 instead, as
// FlashAttention does on a GPU (products of bfloat16 operands, the softmax in float32, the weights
// rounded to bfloat16 for P V): each VDPBF16PS adds two products per lane to a float32 sum, so every
// 32-bit word of its operands is a pair. The scores take pairs of dims: Q^T as [dim pair][row] and a
// key's pair broadcast straight from the pool (no copy of K); P V takes pairs of keys: the tile's V as
// [key pair][dim] and each row's weights as [key pair][row]. Half the instructions of the float32 FMAs:
// on the small shape's heads (8 prompts x 256 new tokens, two threads of a Zen 4) 2.4-2.5 ms a call
// against 5.0 ms (3.9 with only the scores in pairs). Rounding the weights costs an output bit at times:
// ~8% of the outputs one bfloat16 step from the float64 reference, where the float32 weights (and torch's
// CPU SDPA) missed almost none; the Triton kernel rounds them alike (`p.to(v.dtype)`).
//
// On a CPU with AMX (and a head_dim in whole tiles of 32) the same bfloat16 products run on the tiles
// (scores_amx, accumulate_amx): one prompt of the small shape's heads (8 over 4, dim 64), two threads
// of a 2-vCPU Xeon, 0.27 ms at 288 tokens and 8.3 at 2,048 against 0.59 and 23.2 on the pairs, and
// against torch's SDPA on the same tiles 0.29 and 7.9 (which is why bfloat16 used to stay on SDPA there).

#include <memory>

#include "paged_prefill_kernels.h"

namespace {

template <int Dt>
void run(const PrefillProblem& p) {
  const PrefillItems items(p);
  PhaseCounters counters(1);
#pragma omp parallel
  {
    ProgressSplit split(counters);
    split.items(items.count(), 1, [&](int64_t item) { items.run<Dt>(p, item); });
  }
}

}  // namespace

extern "C" {

// q: [T, num_heads, head_dim] with strides (q_stride_tok, q_stride_head, 1); request r owns rows
// query_start[r] .. query_start[r + 1] - 1, at positions context_lens[r] onwards, and sees positions up to
// each row's own (window > 0: only the last `window` of them). k_cache, v_cache: contiguous [num_blocks,
// block_size, num_kv_heads, head_dim] of q's dtype, holding every position the rows see; block_tables:
// [num_reqs, >= blocks] int64 with row stride table_stride; out: contiguous float32 [T, num_heads, head_dim].
// The same limits as strata_paged_decode (its max group and head dim).
void strata_paged_prefill(int32_t dtype, const void* q, const void* k_cache, const void* v_cache,
                          const int64_t* block_tables, const int64_t* query_start, const int64_t* context_lens,
                          float* out, int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, int64_t q_stride_tok, int64_t q_stride_head, int64_t table_stride,
                          int64_t window, float scale) {
  const PrefillProblem p{q, k_cache, v_cache, block_tables, query_start, context_lens, out, num_reqs, num_heads,
                         num_kv_heads, head_dim, block_size, q_stride_tok, q_stride_head, table_stride, window, scale};
  switch (dtype) {
    case kFloat32: run<kFloat32>(p); break;
    case kBFloat16: run<kBFloat16>(p); break;
    case kFloat16: run<kFloat16>(p); break;
  }
}

// 1 where bfloat16 rows of this head_dim run on the AMX tiles here (paged_prefill_kernels.h), else 0.
int32_t strata_paged_prefill_bf16_uses_amx(int64_t head_dim) {
#ifdef STRATA_AMX
  return amx_serves_prefill(head_dim);
#else
  (void)head_dim;
  return 0;
#endif
}

}  // extern "C"
