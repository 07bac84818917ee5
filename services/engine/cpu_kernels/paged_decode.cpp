// Paged decode attention on the CPU: one new query token per request, straight over the block pool.
//
// A work item is a request's context chunk, each tile of its tokens attended for every kv head. It reads
// each K/V row of the chunk once for all the query heads of a GQA group, keeps float32 accumulators with an online
// softmax over tiles of tokens, and either writes the normalised output (a request in one chunk) or
// its partials (max, sum, acc per kv head) for a merge pass (a long context split in several chunks,
// so both cores work even at batch 1).
// Pools hold float32, bfloat16 or float16; the output is always float32 (the caller casts).

#include "paged_decode_kernels.h"

namespace {

template <int Dt>
void run(const Problem& p, int64_t min_chunk_tokens) {
  const Plan plan = plan_chunks(p, min_chunk_tokens, omp_get_max_threads());
  std::vector<Partial> partials(plan.split ? plan.num_partials(p) : 0);
#pragma omp parallel
  {
    OmpSplit split;
    attend<Dt>(p, plan, partials.data(), split);
  }
}

}  // namespace

extern "C" {

int64_t strata_paged_decode_max_group() { return kMaxGroup; }
int64_t strata_paged_decode_max_head_dim() { return kMaxHeadDim; }

// q: [num_reqs, num_heads, head_dim] with strides (q_stride_req, q_stride_head, 1);
// k_cache, v_cache: contiguous [num_blocks, block_size, num_kv_heads, head_dim] of q's dtype;
// block_tables: [num_reqs, >= max blocks] int64 with row stride table_stride; seq_lens: [num_reqs] int64,
// each >= 1 (the new token's K/V already stored); out: contiguous float32 [num_reqs, num_heads, head_dim].
// window > 0: the query at position seq_len - 1 sees positions seq_len - window .. seq_len - 1.
// min_chunk_tokens: the shortest context span a work item attends when long contexts are split so that
// every thread has work (the chunks' partials are then merged).
void strata_paged_decode(int32_t dtype, const void* q, const void* k_cache, const void* v_cache,
                         const int64_t* block_tables, const int64_t* seq_lens, float* out, int64_t num_reqs,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                         int64_t q_stride_req, int64_t q_stride_head, int64_t table_stride, int64_t window,
                         float scale, int64_t min_chunk_tokens) {
  const Problem p{q, k_cache, v_cache, block_tables, seq_lens, out, num_reqs, num_heads, num_kv_heads,
                  head_dim, block_size, q_stride_req, q_stride_head, table_stride, window, scale};
  switch (dtype) {
    case kFloat32: run<kFloat32>(p, min_chunk_tokens); break;
    case kBFloat16: run<kBFloat16>(p, min_chunk_tokens); break;
    case kFloat16: run<kFloat16>(p, min_chunk_tokens); break;
  }
}

}  // extern "C"
