// The paged prefill attention kernels behind paged_prefill.cpp and decode_forward.cpp (see
// paged_prefill.cpp): header-only, in an anonymous namespace, so each kernel library gets its own copy.

#pragma once

#include <algorithm>
#include <memory>
#include <vector>

#include "amx_tiles.h"
#include "paged_decode_kernels.h"  // load16 / load8, lanes, exp_nonpositive(8), prefetch

#if defined(STRATA_AVX512) && defined(__AVX512BF16__)
#define STRATA_BF16_PAIRS 1  // the bfloat16 path (see paged_prefill.cpp)
#endif

namespace {

constexpr int64_t kRows = 64;      // query rows of a work item (four vectors of 16 lanes)
constexpr int kRowVectors = kRows / 16;
constexpr int64_t kKeyTile = 32;   // keys per tile
constexpr int64_t kKeysPerPass = 4;

struct PrefillProblem {
  const void* q;             // [T, num_heads, head_dim], strides (q_stride_tok, q_stride_head, 1)
  const void* k_cache;       // [blocks, block_size, num_kv_heads, head_dim]
  const void* v_cache;
  const int64_t* block_tables;    // [num_reqs, >= blocks], row stride table_stride
  const int64_t* query_start;     // [num_reqs + 1]: request r's rows of q
  const int64_t* context_lens;    // [num_reqs]: positions before its first query
  float* out;                // [T, num_heads, head_dim], contiguous
  int64_t num_reqs, num_heads, num_kv_heads, head_dim, block_size;
  int64_t q_stride_tok, q_stride_head, table_stride;
  int64_t window;  // 0: whole context
  float scale;
};

// One work item's state: Q^T (scaled), the tile's K and V in float32, the scores, the output rows.
// K, V and O rows lie `ld` (head_dim rounded up to 16) floats apart, not kMaxHeadDim: rows a whole 1 KB
// apart would all fall in the same few sets of the L1 cache and evict each other.
struct Scratch {
  alignas(64) float q_t[kMaxHeadDim][kRows];
  alignas(64) float k[kKeyTile * kMaxHeadDim];
  alignas(64) float v[kKeyTile * kMaxHeadDim];
  alignas(64) float scores[kKeyTile][kRows];  // transposed: [key][row]
  alignas(64) float o[kRows * kMaxHeadDim];
  alignas(64) float max[kRows];
  alignas(64) float sum[kRows];
  alignas(64) int32_t pos[kRows];  // each row's query position; -1 for rows past the item's
#ifdef STRATA_BF16_PAIRS
  // bfloat16 pairs, one per 32-bit word (low half first): the operands of the bfloat16 path
  alignas(64) uint32_t q_pairs[kMaxHeadDim / 2][kRows];     // [i][r]: (q_r[2i], q_r[2i + 1]), scale not applied
  alignas(64) uint32_t v_pairs[kKeyTile / 2 * kMaxHeadDim];  // [j * ld + d]: (v_2j[d], v_2j+1[d])
  alignas(64) uint32_t w_pairs[kKeyTile / 2][kRows];         // [j][r]: (weight_2j[r], weight_2j+1[r])
  const uint32_t* key_rows[kKeyTile];                        // the tile's K rows in the pool, as pairs
#endif
#ifdef STRATA_AMX
  // The AMX path's operands (see scores_amx, accumulate_amx): the tile's K rows as they lie in the pool,
  // one after another, and each row's weights as [row][key pair]
  alignas(64) uint16_t k_rows[kKeyTile * kMaxHeadDim];
  alignas(64) uint32_t p_pairs[kRows][kKeyTile / 2];
#endif
  int64_t ld = 0;
};

// The tile's K (or V) rows of `kv_head` for positions [t0, t0 + n), as float32 rows `ld` apart, zero
// past head_dim; the next tile's rows (up to position `last`) are asked for meanwhile, one per row loaded.
template <int Dt>
void load_rows(const PrefillProblem& p, const int64_t* table, const void* pool, int64_t kv_head, int64_t t0,
               int64_t n, int64_t last, int64_t ld, float* rows) {
  const int64_t dim = p.head_dim;
  auto offset_of = [&](int64_t pos) {
    return ((table[pos / p.block_size] * p.block_size + pos % p.block_size) * p.num_kv_heads + kv_head) * dim;
  };
  const char* base = static_cast<const char*>(pool);
  const int64_t row_bytes = dim * element_size<Dt>();
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = t0 + t;
    const int64_t offset = offset_of(pos);
    if (pos + kKeyTile <= last) {
      const char* ahead = base + offset_of(pos + kKeyTile) * element_size<Dt>();
      for (int64_t b = 0; b < row_bytes; b += 64) prefetch(ahead + b);
    }
#ifdef STRATA_AVX512
    for (int64_t d = 0; d < dim; d += 16) _mm512_store_ps(rows + t * ld + d, load16<Dt>(pool, offset + d, lanes(dim - d)));
#elif defined(STRATA_AVX2)
    for (int64_t d = 0; d < ld; d += 8) _mm256_store_ps(rows + t * ld + d, load8<Dt>(pool, offset + d, dim - d));
#else
    for (int64_t d = 0; d < dim; ++d) rows[t * ld + d] = to_float<Dt>(pool, offset + d);
#endif
  }
}

#ifdef STRATA_AVX512
// rows[i] becomes column i of the 16 x 16 block the rows held.
inline void transpose16(__m512 rows[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(rows[2 * i], rows[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(rows[2 * i], rows[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + j], 128-bit lane L: column 4L + j of rows 4i .. 4i + 3
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 a = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88), b = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xdd);
    const __m512 c = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88), d = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xdd);
    rows[j] = _mm512_shuffle_f32x4(a, c, 0x88);
    rows[8 + j] = _mm512_shuffle_f32x4(a, c, 0xdd);
    rows[4 + j] = _mm512_shuffle_f32x4(b, d, 0x88);
    rows[12 + j] = _mm512_shuffle_f32x4(b, d, 0xdd);
  }
}
#endif

// scores[t][r] = q_r . k_t for t < n, every row (the rows past the item's are zero in q_t).
void score_keys(const Scratch& s, int64_t dim, int64_t n, float (*scores)[kRows]) {
  for (int64_t t0 = 0; t0 < n; t0 += kKeysPerPass) {
    const int64_t keys = std::min(kKeysPerPass, n - t0);
#ifdef STRATA_AVX512
    __m512 acc[kKeysPerPass][kRowVectors];
    for (int j = 0; j < kKeysPerPass; ++j)
      for (int c = 0; c < kRowVectors; ++c) acc[j][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; ++d) {
      __m512 q[kRowVectors];
      for (int c = 0; c < kRowVectors; ++c) q[c] = _mm512_load_ps(s.q_t[d] + 16 * c);
      for (int j = 0; j < kKeysPerPass; ++j) {  // past n: stale keys, whose scores are not stored
        const __m512 key = _mm512_set1_ps(s.k[(t0 + j) * s.ld + d]);
        for (int c = 0; c < kRowVectors; ++c) acc[j][c] = _mm512_fmadd_ps(key, q[c], acc[j][c]);
      }
    }
    for (int64_t j = 0; j < keys; ++j)
      for (int c = 0; c < kRowVectors; ++c) _mm512_store_ps(scores[t0 + j] + 16 * c, acc[j][c]);
#elif defined(STRATA_AVX2)
    // 2 keys x 32 rows at a time (8 sums, 4 rows of Q^T, 2 broadcasts): the 16 registers hold no more.
    for (int64_t r0 = 0; r0 < kRows; r0 += 32)
      for (int64_t j0 = 0; j0 < keys; j0 += 2) {
        __m256 acc[2][4];
        for (int j = 0; j < 2; ++j)
          for (int c = 0; c < 4; ++c) acc[j][c] = _mm256_setzero_ps();
        const float* k0 = s.k + (t0 + j0) * s.ld;  // the second key may lie past n: a stale row of the tile
        for (int64_t d = 0; d < dim; ++d) {
          const __m256 key0 = _mm256_broadcast_ss(k0 + d), key1 = _mm256_broadcast_ss(k0 + s.ld + d);
          for (int c = 0; c < 4; ++c) {
            __m256 q = _mm256_load_ps(s.q_t[d] + r0 + 8 * c);
            asm("" : "+x"(q));  // one load for both keys (see accumulate_rows8)
            acc[0][c] = _mm256_fmadd_ps(key0, q, acc[0][c]);
            acc[1][c] = _mm256_fmadd_ps(key1, q, acc[1][c]);
          }
        }
        // Both keys' scores, the stale one's too (its row lies inside the tile, unread): a store bounded
        // by `keys` kept GCC writing all 8 sums to the stack on every step of the d loop.
        for (int j = 0; j < 2; ++j)
          for (int c = 0; c < 4; ++c) _mm256_store_ps(scores[t0 + j0 + j] + r0 + 8 * c, acc[j][c]);
      }
#else
    for (int64_t j = 0; j < keys; ++j)
      for (int64_t r = 0; r < kRows; ++r) {
        float dot = 0.0f;
        for (int64_t d = 0; d < dim; ++d) dot += s.q_t[d][r] * s.k[(t0 + j) * s.ld + d];
        scores[t0 + j][r] = dot;
      }
#endif
  }
}

// Masks the tile's scores (keys at t0 + t a row may not see), updates each row's running max and sum,
// rescales its output row, and turns the scores into weights.
void softmax_keys(Scratch& s, int64_t dim, int64_t t0, int64_t n, int64_t window) {
  alignas(64) float rescale[kRows];
#ifdef STRATA_AVX512
  for (int64_t r0 = 0; r0 < kRows; r0 += 16) {
    const __m512i pos = _mm512_load_si512(s.pos + r0);
    __mmask16 seen[kKeyTile];
    __m512 tile_max = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < n; ++t) {
      const __m512i key = _mm512_set1_epi32(int32_t(t0 + t));
      seen[t] = _mm512_cmp_epi32_mask(key, pos, _MM_CMPINT_LE);  // causal (rows at -1 see nothing)
      if (window > 0)
        seen[t] &= _mm512_cmp_epi32_mask(key, _mm512_sub_epi32(pos, _mm512_set1_epi32(int32_t(window))),
                                         _MM_CMPINT_GT);
      tile_max = _mm512_mask_max_ps(tile_max, seen[t], tile_max, _mm512_load_ps(s.scores[t] + r0));
    }
    const __m512 old_max = _mm512_load_ps(s.max + r0);
    const __m512 new_max = _mm512_max_ps(old_max, tile_max);
    // Rows that have seen no key yet keep max -inf: their weights are 0 and nothing is rescaled.
    const __mmask16 live = _mm512_cmp_ps_mask(new_max, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    const __m512 shift = _mm512_maskz_mov_ps(live, new_max);
    const __m512 factor = _mm512_mask_blend_ps(
        _mm512_cmp_ps_mask(old_max, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
        _mm512_set1_ps(1.0f), exp_nonpositive(_mm512_sub_ps(old_max, shift)));
    __m512 tile_sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const __m512 w = _mm512_maskz_mov_ps(seen[t], exp_nonpositive(_mm512_sub_ps(_mm512_load_ps(s.scores[t] + r0), shift)));
      _mm512_store_ps(s.scores[t] + r0, w);
      tile_sum = _mm512_add_ps(tile_sum, w);
    }
    _mm512_store_ps(s.max + r0, new_max);
    _mm512_store_ps(s.sum + r0, _mm512_fmadd_ps(_mm512_load_ps(s.sum + r0), factor, tile_sum));
    _mm512_store_ps(rescale + r0, factor);
  }
#elif defined(STRATA_AVX2)
  const __m256 minus_infinity = _mm256_set1_ps(-INFINITY);
  for (int64_t r0 = 0; r0 < kRows; r0 += 8) {
    const __m256i pos = _mm256_load_si256(reinterpret_cast<const __m256i*>(s.pos + r0));
    const __m256i oldest = _mm256_sub_epi32(pos, _mm256_set1_epi32(int32_t(window)));
    __m256 seen[kKeyTile];
    __m256 tile_max = minus_infinity;
    for (int64_t t = 0; t < n; ++t) {
      const __m256i key = _mm256_set1_epi32(int32_t(t0 + t));
      __m256i sees = _mm256_andnot_si256(_mm256_cmpgt_epi32(key, pos), _mm256_set1_epi32(-1));  // causal
      if (window > 0) sees = _mm256_and_si256(sees, _mm256_cmpgt_epi32(key, oldest));
      seen[t] = _mm256_castsi256_ps(sees);
      tile_max = _mm256_blendv_ps(tile_max, _mm256_max_ps(tile_max, _mm256_load_ps(s.scores[t] + r0)), seen[t]);
    }
    const __m256 old_max = _mm256_load_ps(s.max + r0);
    const __m256 new_max = _mm256_max_ps(old_max, tile_max);
    // Rows that have seen no key yet keep max -inf: their weights are 0 and nothing is rescaled.
    const __m256 shift = _mm256_and_ps(_mm256_cmp_ps(new_max, minus_infinity, _CMP_NEQ_OQ), new_max);
    const __m256 factor = _mm256_blendv_ps(_mm256_set1_ps(1.0f), exp_nonpositive8(_mm256_sub_ps(old_max, shift)),
                                           _mm256_cmp_ps(old_max, minus_infinity, _CMP_NEQ_OQ));
    __m256 tile_sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const __m256 w = _mm256_and_ps(seen[t], exp_nonpositive8(_mm256_sub_ps(_mm256_load_ps(s.scores[t] + r0), shift)));
      _mm256_store_ps(s.scores[t] + r0, w);
      tile_sum = _mm256_add_ps(tile_sum, w);
    }
    _mm256_store_ps(s.max + r0, new_max);
    _mm256_store_ps(s.sum + r0, _mm256_fmadd_ps(_mm256_load_ps(s.sum + r0), factor, tile_sum));
    _mm256_store_ps(rescale + r0, factor);
  }
#else
  for (int64_t r = 0; r < kRows; ++r) {
    auto sees = [&](int64_t key) { return key <= s.pos[r] && (window <= 0 || key > s.pos[r] - window); };
    float tile_max = -INFINITY;
    for (int64_t t = 0; t < n; ++t)
      if (sees(t0 + t)) tile_max = std::max(tile_max, s.scores[t][r]);
    const float new_max = std::max(s.max[r], tile_max);
    const float shift = new_max == -INFINITY ? 0.0f : new_max;
    rescale[r] = s.max[r] == -INFINITY ? 1.0f : std::exp(s.max[r] - shift);
    float tile_sum = 0.0f;
    for (int64_t t = 0; t < n; ++t) {
      s.scores[t][r] = sees(t0 + t) ? std::exp(s.scores[t][r] - shift) : 0.0f;
      tile_sum += s.scores[t][r];
    }
    s.max[r] = new_max;
    s.sum[r] = s.sum[r] * rescale[r] + tile_sum;
  }
#endif
  for (int64_t r = 0; r < kRows; ++r)
    if (rescale[r] != 1.0f)
      for (int64_t d = 0; d < dim; ++d) s.o[r * s.ld + d] *= rescale[r];
}

// o[r] += sum_t weight[t][r] * v_t for the rows r0 .. r0 + 3 and the Vectors x 16 dims from d0: `steps`
// keys of float32 FMAs (scores, v), or with Pairs `steps` pairs of keys of VDPBF16PS (w_pairs, v_pairs).
#ifdef STRATA_AVX512
template <int Vectors, bool Pairs>
void accumulate_rows(Scratch& s, int64_t steps, int64_t r0, int64_t d0) {
  __m512 acc[4][Vectors];
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < Vectors; ++c) acc[i][c] = _mm512_load_ps(s.o + (r0 + i) * s.ld + d0 + 16 * c);
  for (int64_t t = 0; t < steps; ++t) {
#ifdef STRATA_BF16_PAIRS
    if constexpr (Pairs) {
      __m512i v[Vectors];
      for (int c = 0; c < Vectors; ++c) v[c] = _mm512_load_si512(s.v_pairs + t * s.ld + d0 + 16 * c);
      for (int i = 0; i < 4; ++i) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(int32_t(s.w_pairs[t][r0 + i]));
        for (int c = 0; c < Vectors; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], (__m512bh)v[c], w);
      }
      continue;
    }
#endif
    __m512 v[Vectors];
    for (int c = 0; c < Vectors; ++c) v[c] = _mm512_load_ps(s.v + t * s.ld + d0 + 16 * c);
    for (int i = 0; i < 4; ++i) {
      const __m512 w = _mm512_set1_ps(s.scores[t][r0 + i]);
      for (int c = 0; c < Vectors; ++c) acc[i][c] = _mm512_fmadd_ps(w, v[c], acc[i][c]);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < Vectors; ++c) _mm512_store_ps(s.o + (r0 + i) * s.ld + d0 + 16 * c, acc[i][c]);
}
#endif

#ifdef STRATA_AVX2
// As accumulate_rows with 8-lane vectors: 4 rows x Vectors x 8 dims from d0.
template <int Vectors>
void accumulate_rows8(Scratch& s, int64_t n, int64_t r0, int64_t d0) {
  // The row loops unrolled by pragma: at -O3 GCC otherwise kept a copy of the sums on the stack and
  // stored all of them on every step of the t loop.
  __m256 acc[4][Vectors];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < Vectors; ++c) acc[i][c] = _mm256_load_ps(s.o + (r0 + i) * s.ld + d0 + 8 * c);
  for (int64_t t = 0; t < n; ++t) {
    __m256 v[Vectors];
    for (int c = 0; c < Vectors; ++c) {
      v[c] = _mm256_load_ps(s.v + t * s.ld + d0 + 8 * c);
      asm("" : "+x"(v[c]));  // in a register: GCC would fold the load into each of the 4 rows' FMAs
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m256 w = _mm256_broadcast_ss(&s.scores[t][r0 + i]);
      for (int c = 0; c < Vectors; ++c) acc[i][c] = _mm256_fmadd_ps(w, v[c], acc[i][c]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < Vectors; ++c) _mm256_store_ps(s.o + (r0 + i) * s.ld + d0 + 8 * c, acc[i][c]);
}
#endif

// o[r] += sum_t weight[t][r] * v_t over the tile's n keys for every row below `rows` rounded up to 4 (o's
// rows up to kRows exist; those past the item's stay unused); with Pairs, from w_pairs and v_pairs.
template <bool Pairs = false>
void accumulate_keys(Scratch& s, int64_t dim, int64_t n, int64_t rows) {
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
#ifdef STRATA_AVX512
    const int64_t steps = Pairs ? (n + 1) / 2 : n;
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {
      switch (std::min<int64_t>(4, (dim - d0 + 15) / 16)) {
        case 1: accumulate_rows<1, Pairs>(s, steps, r0, d0); break;
        case 2: accumulate_rows<2, Pairs>(s, steps, r0, d0); break;
        case 3: accumulate_rows<3, Pairs>(s, steps, r0, d0); break;
        default: accumulate_rows<4, Pairs>(s, steps, r0, d0); break;
      }
    }
#elif defined(STRATA_AVX2)
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {  // 4 rows x 16 dims: 8 sums, 2 rows of V, a broadcast
      if (dim - d0 > 8)
        accumulate_rows8<2>(s, n, r0, d0);
      else
        accumulate_rows8<1>(s, n, r0, d0);
    }
#else
    for (int64_t i = r0; i < std::min<int64_t>(r0 + 4, kRows); ++i)
      for (int64_t t = 0; t < n; ++t)
        for (int64_t d = 0; d < dim; ++d) s.o[i * s.ld + d] += s.scores[t][i] * s.v[t * s.ld + d];
#endif
  }
}

#ifdef STRATA_BF16_PAIRS
// The first n of 32 bfloat16 lanes (all of them for n >= 32).
inline __mmask32 lanes32(int64_t n) { return n >= 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1; }

// Word indices that interleave two vectors of 32 bfloat16 (a, then b: 32 + i) into pairs (a[i], b[i]):
// of their first 16 elements from `from` = 0, of their last 16 from `from` = 16.
inline __m512i interleave_words(int from) {
  alignas(64) int16_t index[32];
  for (int i = 0; i < 16; ++i) index[2 * i] = int16_t(from + i), index[2 * i + 1] = int16_t(32 + from + i);
  return _mm512_load_si512(index);
}

// q_pairs[i][r] = row r's dims 2i and 2i + 1, by 16 x 16 transposes of 32-bit words; rows past the item's zero.
template <typename QOffset>
void load_query_pairs(const PrefillProblem& p, QOffset q_offset, int64_t rows, Scratch& s) {
  const auto* q = static_cast<const uint16_t*>(p.q);
  for (int64_t r0 = 0; r0 < kRows; r0 += 16)
    for (int64_t d0 = 0; d0 < p.head_dim; d0 += 32) {
      __m512 block[16];
      for (int64_t i = 0; i < 16; ++i)
        block[i] = r0 + i < rows ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(lanes32(p.head_dim - d0),
                                                                                q + q_offset(r0 + i) + d0))
                                 : _mm512_setzero_ps();
      transpose16(block);
      for (int64_t i = 0; i < std::min<int64_t>(16, (p.head_dim - d0) / 2); ++i)
        _mm512_store_ps(reinterpret_cast<float*>(s.q_pairs[d0 / 2 + i] + r0), block[i]);
    }
}

// The tile's K rows (key_rows) and its V rows as pairs of keys (v_pairs) for positions [t0, t0 + n); an odd
// tile's last key is paired with itself (its partner's weight is zero). The next tile's K and V lines (up to
// position `last`) are asked for meanwhile.
void load_key_value_pairs(const PrefillProblem& p, const int64_t* table, int64_t kv_head, int64_t t0, int64_t n,
                          int64_t last, Scratch& s) {
  const int64_t dim = p.head_dim;
  auto offset_of = [&](int64_t pos) {
    return ((table[pos / p.block_size] * p.block_size + pos % p.block_size) * p.num_kv_heads + kv_head) * dim;
  };
  const auto* k_pool = static_cast<const uint16_t*>(p.k_cache);
  const auto* v_pool = static_cast<const uint16_t*>(p.v_cache);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t offset = offset_of(t0 + t);
    s.key_rows[t] = reinterpret_cast<const uint32_t*>(k_pool + offset);
    if (t0 + t + kKeyTile <= last) {
      const int64_t ahead = offset_of(t0 + t + kKeyTile);
      for (int64_t b = 0; b < dim * 2; b += 64) {
        prefetch(reinterpret_cast<const char*>(k_pool + ahead) + b);
        prefetch(reinterpret_cast<const char*>(v_pool + ahead) + b);
      }
    }
  }
  const __m512i first_half = interleave_words(0), second_half = interleave_words(16);
  for (int64_t j = 0; 2 * j < n; ++j) {
    const uint16_t* a = v_pool + offset_of(t0 + 2 * j);
    const uint16_t* b = v_pool + offset_of(t0 + std::min(2 * j + 1, n - 1));
    uint32_t* out = s.v_pairs + j * s.ld;
    for (int64_t d0 = 0; d0 < dim; d0 += 32) {
      const __m512i va = _mm512_maskz_loadu_epi16(lanes32(dim - d0), a + d0);
      const __m512i vb = _mm512_maskz_loadu_epi16(lanes32(dim - d0), b + d0);
      _mm512_store_si512(out + d0, _mm512_permutex2var_epi16(va, first_half, vb));
      if (d0 + 16 < dim) _mm512_store_si512(out + d0 + 16, _mm512_permutex2var_epi16(va, second_half, vb));
    }
  }
}

// scores[t][r] = scale * q_r . k_t for t < n, every row, two dims a step: 4 keys x 64 rows of VDPBF16PS, each
// key's pair of dims broadcast from its row in the pool.
void score_key_pairs(const Scratch& s, int64_t dim, int64_t n, float scale, float (*scores)[kRows]) {
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < n; t0 += kKeysPerPass) {
    const int64_t keys = std::min(kKeysPerPass, n - t0);
    const uint32_t* key[kKeysPerPass];
    for (int j = 0; j < kKeysPerPass; ++j) key[j] = s.key_rows[std::min<int64_t>(t0 + j, n - 1)];  // past n: unstored
    __m512 acc[kKeysPerPass][kRowVectors];
    for (int j = 0; j < kKeysPerPass; ++j)
      for (int c = 0; c < kRowVectors; ++c) acc[j][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim / 2; ++i) {
      __m512i q[kRowVectors];
      for (int c = 0; c < kRowVectors; ++c) q[c] = _mm512_load_si512(s.q_pairs[i] + 16 * c);
      for (int j = 0; j < kKeysPerPass; ++j) {
        const __m512bh k = (__m512bh)_mm512_set1_epi32(int32_t(key[j][i]));
        for (int c = 0; c < kRowVectors; ++c) acc[j][c] = _mm512_dpbf16_ps(acc[j][c], (__m512bh)q[c], k);
      }
    }
    for (int64_t j = 0; j < keys; ++j)
      for (int c = 0; c < kRowVectors; ++c) _mm512_store_ps(scores[t0 + j] + 16 * c, _mm512_mul_ps(acc[j][c], scale16));
  }
}

// The weights of keys 2j and 2j + 1 (zero past n) of rows r0 .. r0 + 15, rounded to bfloat16, as 16 pairs.
inline __m512i weight_pairs(const Scratch& s, int64_t j, int64_t n, int64_t r0) {
  static const __m512i interleave = [] {  // even's 16 words, then odd's -> (even[i], odd[i])
    alignas(64) int16_t index[32];
    for (int i = 0; i < 16; ++i) index[2 * i] = int16_t(i), index[2 * i + 1] = int16_t(16 + i);
    return _mm512_load_si512(index);
  }();
  const __m512 even = _mm512_load_ps(s.scores[2 * j] + r0);
  const __m512 odd = 2 * j + 1 < n ? _mm512_load_ps(s.scores[2 * j + 1] + r0) : _mm512_setzero_ps();
  return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

// w_pairs[j][r] = row r's weights of keys 2j and 2j + 1 (zero past n), rounded to bfloat16.
void pair_weights(Scratch& s, int64_t n) {
  for (int64_t j = 0; 2 * j < n; ++j)
    for (int64_t r0 = 0; r0 < kRows; r0 += 16) _mm512_store_si512(s.w_pairs[j] + r0, weight_pairs(s, j, n, r0));
}
#endif

#ifdef STRATA_AMX
// The AMX path (bfloat16, head_dim a multiple of 32, AMX granted): the two products of each key tile on
// the matrix unit, the softmax as the pairs path runs it. The operands are the pairs path's, laid out for
// TDPBF16PS (amx_tiles.h), which adds products of the same bfloat16 operands in float32:
//   scores^T [keys][rows] = K Q^T: A = 16 keys' rows as they lie (a row of 32 dims is 16 pairs), B = Q^T
//                           as q_pairs, [dim pair][row];
//   O [rows][dims] += P V:  A = each row's weights as key pairs (p_pairs), B = V as v_pairs, [key pair][dim],
//                           O's tile loaded from s.o and stored back (the softmax rescales it in memory).
// Tiles: 0-1 scores (two 16-key halves), 2-3 their K halves, 4 Q^T; 5 P, 6 V, 7 O.
inline bool amx_serves_prefill(int64_t head_dim) { return head_dim % 32 == 0 && amx_granted(); }

// The tile's n K rows (key_rows) one after another in k_rows; rows past n zero.
void copy_key_rows(Scratch& s, int64_t dim, int64_t n) {
  for (int64_t t = 0; t < n; ++t) std::memcpy(s.k_rows + t * dim, s.key_rows[t], dim * sizeof(uint16_t));
  if (n < kKeyTile) std::fill(s.k_rows + n * dim, s.k_rows + kKeyTile * dim, uint16_t(0));
}

// scores[t][r] = scale * q_r . k_t for t < n (the keys past n score 0) and the rows below `rows` rounded up to 16.
void scores_amx(Scratch& s, int64_t dim, int64_t n, int64_t rows, float scale) {
  const int64_t q_stride = kRows * sizeof(uint32_t), k_stride = dim * sizeof(uint16_t);
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t d0 = 0; d0 < dim; d0 += 32) {
      _tile_loadd(4, s.q_pairs[d0 / 2] + r0, q_stride);
      _tile_loadd(2, s.k_rows + d0, k_stride);
      _tile_dpbf16ps(0, 2, 4);
      if (n > 16) {
        _tile_loadd(3, s.k_rows + 16 * dim + d0, k_stride);
        _tile_dpbf16ps(1, 3, 4);
      }
    }
    _tile_stored(0, s.scores[0] + r0, q_stride);
    if (n > 16) _tile_stored(1, s.scores[16] + r0, q_stride);
  }
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t r0 = 0; r0 < rows; r0 += 16)
      _mm512_store_ps(s.scores[t] + r0, _mm512_mul_ps(_mm512_load_ps(s.scores[t] + r0), scale16));
}

// p_pairs[r][j] = row r's weights of keys 2j and 2j + 1 (zero past n), rounded to bfloat16, for the rows
// below `rows` rounded up to 16: pairs as pair_weights makes them, then 16 x 16 transposes of 32-bit words.
void pair_weights_by_row(Scratch& s, int64_t n, int64_t rows) {
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    __m512 block[16];  // block[j]: the pairs of keys 2j, 2j + 1 of rows r0 .. r0 + 15
    for (int64_t j = 0; j < kKeyTile / 2; ++j)
      block[j] = 2 * j < n ? _mm512_castsi512_ps(weight_pairs(s, j, n, r0)) : _mm512_setzero_ps();
    transpose16(block);
    for (int64_t i = 0; i < 16; ++i) _mm512_store_ps(reinterpret_cast<float*>(s.p_pairs[r0 + i]), block[i]);
  }
}

// o[r] += sum_t weight[t][r] * v_t over the tile's n keys, for the rows below `rows` rounded up to 16.
void accumulate_amx(Scratch& s, int64_t dim, int64_t n, int64_t rows) {
  const int64_t pairs = (n + 1) / 2;  // v_pairs' rows past them: zero, so that stale values add nothing
  if (pairs < kKeyTile / 2) std::fill(s.v_pairs + pairs * s.ld, s.v_pairs + kKeyTile / 2 * s.ld, 0u);
  const int64_t o_stride = s.ld * sizeof(float), v_stride = s.ld * sizeof(uint32_t);
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    _tile_loadd(5, s.p_pairs[r0], kKeyTile / 2 * sizeof(uint32_t));
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
      _tile_loadd(7, s.o + r0 * s.ld + d0, o_stride);
      _tile_loadd(6, s.v_pairs + d0, v_stride);
      _tile_dpbf16ps(7, 5, 6);
      _tile_stored(7, s.o + r0 * s.ld + d0, o_stride);
    }
  }
}
#endif

// The item's output rows, each divided by its softmax sum.
void write_rows(const PrefillProblem& p, int64_t req, int64_t kv_head, int64_t first, int64_t rows, const Scratch& s) {
  const int64_t group = p.num_heads / p.num_kv_heads, dim = p.head_dim;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = p.query_start[req] + first + r / group, head = kv_head * group + r % group;
    float* out = p.out + (row * p.num_heads + head) * dim;
    const float inverse = s.sum[r] > 0.0f ? 1.0f / s.sum[r] : 0.0f;
    for (int64_t d = 0; d < dim; ++d) out[d] = s.o[r * s.ld + d] * inverse;
  }
}

// Request `req`'s query tokens [first, first + tokens) (of its new ones), heads of `kv_head`'s group.
template <int Dt>
void attend_block(const PrefillProblem& p, int64_t req, int64_t kv_head, int64_t first, int64_t tokens, Scratch& s) {
  const int64_t group = p.num_heads / p.num_kv_heads, dim = p.head_dim;
  const int64_t rows = tokens * group;
  const int64_t context = p.context_lens[req];
  const int64_t* table = p.block_tables + req * p.table_stride;
  s.ld = (dim + 15) / 16 * 16;
  std::fill(s.o, s.o + kRows * s.ld, 0.0f);
  for (int64_t r = 0; r < kRows; ++r) {
    s.pos[r] = r < rows ? int32_t(context + first + r / group) : -1;
    s.max[r] = -INFINITY;
    s.sum[r] = 0.0f;
  }
  auto q_offset = [&](int64_t r) {  // of query row r's head_dim elements in q
    const int64_t row = p.query_start[req] + first + r / group, head = kv_head * group + r % group;
    return row * p.q_stride_tok + head * p.q_stride_head;
  };
  const int64_t last = context + first + tokens - 1;  // the last query's position: no key lies past it
  const int64_t lo = p.window > 0 ? std::max<int64_t>(0, context + first - p.window + 1) : 0;
#ifdef STRATA_AMX
  if (Dt == kBFloat16 && amx_serves_prefill(dim)) {
    configure_tiles();
    load_query_pairs(p, q_offset, rows, s);
    for (int64_t t0 = lo; t0 <= last; t0 += kKeyTile) {
      const int64_t n = std::min(kKeyTile, last + 1 - t0);
      load_key_value_pairs(p, table, kv_head, t0, n, last, s);
      copy_key_rows(s, dim, n);
      scores_amx(s, dim, n, rows, p.scale);
      softmax_keys(s, dim, t0, n, p.window);
      pair_weights_by_row(s, n, rows);
      accumulate_amx(s, dim, n, rows);
    }
    _tile_release();
    write_rows(p, req, kv_head, first, rows, s);
    return;
  }
#endif
#ifdef STRATA_BF16_PAIRS
  if (Dt == kBFloat16 && dim % 2 == 0) {
    load_query_pairs(p, q_offset, rows, s);
    for (int64_t t0 = lo; t0 <= last; t0 += kKeyTile) {
      const int64_t n = std::min(kKeyTile, last + 1 - t0);
      load_key_value_pairs(p, table, kv_head, t0, n, last, s);
      score_key_pairs(s, dim, n, p.scale, s.scores);
      softmax_keys(s, dim, t0, n, p.window);
      pair_weights(s, n);
      accumulate_keys<true>(s, dim, n, rows);
    }
    write_rows(p, req, kv_head, first, rows, s);
    return;
  }
#endif
#ifdef STRATA_AVX512
  const __m512 scale = _mm512_set1_ps(p.scale);
  for (int64_t r0 = 0; r0 < kRows; r0 += 16)  // Q^T, 16 x 16 blocks at a time; rows past the item's zero
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
      __m512 block[16];
      for (int64_t i = 0; i < 16; ++i)
        block[i] = r0 + i < rows ? _mm512_mul_ps(load16<Dt>(p.q, q_offset(r0 + i) + d0, lanes(dim - d0)), scale)
                                 : _mm512_setzero_ps();
      transpose16(block);
      for (int64_t i = 0; i < std::min<int64_t>(16, dim - d0); ++i) _mm512_store_ps(s.q_t[d0 + i] + r0, block[i]);
    }
#else
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t d = 0; d < dim; ++d) s.q_t[d][r] = r < rows ? to_float<Dt>(p.q, q_offset(r) + d) * p.scale : 0.0f;
#endif
  for (int64_t t0 = lo; t0 <= last; t0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, last + 1 - t0);
    load_rows<Dt>(p, table, p.k_cache, kv_head, t0, n, last, s.ld, s.k);
    load_rows<Dt>(p, table, p.v_cache, kv_head, t0, n, last, s.ld, s.v);
    score_keys(s, dim, n, s.scores);
    softmax_keys(s, dim, t0, n, p.window);
    accumulate_keys(s, dim, n, rows);
  }
  write_rows(p, req, kv_head, first, rows, s);
}

// The work items of a problem, in order: request, kv head, block of query tokens (the items taken
// together read the same kv head's K/V, which then stays in cache). Each item may run twice, at once
// even (work_split.h's stealing): it writes only its own output rows, with their final values.
class PrefillItems {
 public:
  explicit PrefillItems(const PrefillProblem& p)
      : tokens_per_item_(std::max<int64_t>(1, kRows / (p.num_heads / p.num_kv_heads))), start_(p.num_reqs + 1, 0) {
    for (int64_t r = 0; r < p.num_reqs; ++r)
      start_[r + 1] = start_[r] + blocks(p, r) * p.num_kv_heads;
  }
  int64_t count() const { return start_.back(); }

  template <int Dt>
  void run(const PrefillProblem& p, int64_t item) const {
    static thread_local std::unique_ptr<Scratch> scratch;
    if (!scratch) scratch = std::make_unique<Scratch>();
    const int64_t req = std::upper_bound(start_.begin(), start_.end(), item) - start_.begin() - 1;
    const int64_t local = item - start_[req], per_head = blocks(p, req);
    const int64_t first = local % per_head * tokens_per_item_;
    const int64_t num_tokens = p.query_start[req + 1] - p.query_start[req];
    attend_block<Dt>(p, req, local / per_head, first, std::min(tokens_per_item_, num_tokens - first), *scratch);
  }

 private:
  int64_t blocks(const PrefillProblem& p, int64_t req) const {
    return (p.query_start[req + 1] - p.query_start[req] + tokens_per_item_ - 1) / tokens_per_item_;
  }
  int64_t tokens_per_item_;
  std::vector<int64_t> start_;
};

}  // namespace
