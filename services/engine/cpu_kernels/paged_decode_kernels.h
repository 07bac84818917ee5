// The paged decode attention kernels behind paged_decode.cpp and decode_forward.cpp (see
// paged_decode.cpp): header-only, in an anonymous namespace, so each kernel library gets its own copy.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "isa.h"
#include "work_split.h"

namespace {

enum Dtype : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

constexpr int64_t kMaxTile = 32;        // tokens scored before one softmax rescale
constexpr int64_t kTileBytes = 4096;    // ... fewer for long rows: what one tile reads of K (as of V)
constexpr int64_t kMaxGroup = 16;      // query heads per kv head
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kItemsPerThread = 4;  // work items per thread the context split aims at

struct Problem {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int64_t* block_tables;
  const int64_t* seq_lens;
  float* out;  // [num_reqs, num_heads, head_dim], contiguous
  int64_t num_reqs, num_heads, num_kv_heads, head_dim, block_size;
  int64_t q_stride_req, q_stride_head, table_stride;
  int64_t window;  // 0: whole context
  float scale;
};

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f;
  const uint32_t mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0) {
    const float magnitude = std::ldexp(float(mantissa), -24);
    std::memcpy(&bits, &magnitude, 4);
    bits |= sign;
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <int Dt>
constexpr int64_t element_size() { return Dt == kFloat32 ? 4 : 2; }

inline void prefetch(const char* address) { __builtin_prefetch(address, 0, 2); }

// The cache lines of the next tile's K and V rows, asked for a few at a time while the current tile
// is computed. Asked for all at once, a tile's lines (hundreds) outnumber the misses a core can keep
// in flight, so the core stalls issuing them, and then computes with nothing in flight; spread over
// the tile's tokens, the reads overlap the arithmetic. In float32 they are spread over both passes of
// the tile, the scores' (K) and the weighted sum's (V): asked for during the score passes alone, the
// reads in flight ran out while the V rows were summed. The small shape's heads (8 over 4, dim 64),
// 64 requests x 450 tokens x 8 layers (a 472 MB float32 pool), best of 15, alternating builds: two
// threads 21.3-21.8 -> 23.0-23.5 GB/s, one thread 10.2-10.3 -> 11.0-11.1; from L3 (one layer, 59 MB)
// 37.9-39.1 -> 39.1-44.4; 7 query heads a kv head 13.5-14.1 -> 14.8-15.6. In bfloat16 (32-dim V
// steps, tiles of two blocks) the same split gained nothing (236 MB: 18.9-19.1 GB/s -> 18.9-19.4).
struct LineFeed {
  const char* k = nullptr;
  const char* v = nullptr;
  const int64_t* rows = nullptr;  // element offsets of the tokens' rows (of kv head 0)
  int64_t element_bytes = 0, lines_per_token = 0, next = 0, total = 0;
  int64_t token = 0, line = 0;  // next's token and line in it (a division per line cost more than the line)

  void start(const char* k_pool, const char* v_pool, const int64_t* token_rows, int64_t count, int64_t elem,
             int64_t token_bytes) {
    k = k_pool, v = v_pool, rows = token_rows, element_bytes = elem;
    lines_per_token = (token_bytes + 63) / 64;
    next = 0, total = count * lines_per_token, token = 0, line = 0;
  }
  void ask(int64_t lines) {  // the next `lines` lines of K and of V
    for (const int64_t end = std::min(total, next + lines); next < end; ++next) {
      const int64_t offset = rows[token] * element_bytes + line * 64;
      prefetch(k + offset);
      prefetch(v + offset);
      if (++line == lines_per_token) line = 0, ++token;
    }
  }
};

template <int Dt>
inline float to_float(const void* p, int64_t i);
template <>
inline float to_float<kFloat32>(const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }
template <>
inline float to_float<kBFloat16>(const void* p, int64_t i) {
  const uint32_t bits = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
template <>
inline float to_float<kFloat16>(const void* p, int64_t i) { return half_to_float(static_cast<const uint16_t*>(p)[i]); }

// exp_nonpositive's constants, one set for every vector width: inputs clamp at kExpFloor (e^-104 is 0 in
// float32), n = round(x log2 e), r = x - n ln2 with ln2 split in two for precision, and poly(r) the
// Taylor series to r^7 in Horner order.
constexpr float kExpFloor = -104.0f;
constexpr float kLog2E = 1.44269504088896341f;
constexpr float kLn2High = 0.693145751953125f;
constexpr float kLn2Low = 1.428606765330187e-06f;
constexpr int kExpTerms = 8;
constexpr float kExpPoly[kExpTerms] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

#ifdef STRATA_AVX512
// The first n of 16 lanes (all of them for n >= 16).
inline __mmask16 lanes(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }

// 16 elements from p + i (only the lanes in mask) as float32.
template <int Dt>
inline __m512 load16(const void* p, int64_t i, __mmask16 mask) {
  if constexpr (Dt == kFloat32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p) + i);
  } else {
    const __m256i raw = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + i);
    if constexpr (Dt == kBFloat16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    } else {
      return _mm512_cvtph_ps(raw);
    }
  }
}

// e^x for x <= 0 (scores minus their running max): 2^n * poly(r), r = x - n ln2 in [-ln2/2, ln2/2].
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpFloor));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 poly = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < kExpTerms; ++i) poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(kExpPoly[i]));
  return _mm512_scalef_ps(poly, n);
}
#endif

#ifdef STRATA_AVX2
// Lanes [0, n) set (all eight for n >= 8, none for n <= 0), as maskload and the blends take them.
inline __m256i lanes8(int64_t n) {
  alignas(32) static const int32_t ones_then_zeros[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ones_then_zeros + 8 - std::clamp<int64_t>(n, 0, 8)));
}

// 8 elements from p + i as float32; for n < 8 only the first n (none for n <= 0), the rest zero.
template <int Dt>
inline __m256 load8(const void* p, int64_t i, int64_t n) {
  if constexpr (Dt == kFloat32) {
    const float* f = static_cast<const float*>(p) + i;
    return n >= 8 ? _mm256_loadu_ps(f) : _mm256_maskload_ps(f, lanes8(n));
  } else {
    const uint16_t* h = static_cast<const uint16_t*>(p) + i;
    alignas(16) uint16_t part[8] = {};
    if (n < 8 && n > 0) std::memcpy(part, h, size_t(n) * 2);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(n >= 8 ? h : part));
    if constexpr (Dt == kBFloat16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    } else {
      return _mm256_cvtph_ps(raw);
    }
  }
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// exp_nonpositive on 8 lanes. AVX2 has no scalef: 2^n (n down to -150, below the normal floats) is
// applied as two normal factors, 2^(n >> 1) and 2^(n - (n >> 1)), so a subnormal result is rounded once.
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpFloor));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 poly = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < kExpTerms; ++i) poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256i whole = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(whole, 1);
  auto pow2 = [](__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  };
  return _mm256_mul_ps(_mm256_mul_ps(poly, pow2(half)), pow2(_mm256_sub_epi32(whole, half)));
}
#endif

// Running softmax state of one (context chunk, kv head): per query head of the group, the max score,
// the sum of e^(score - max) and the unnormalised weighted sum of V rows.
struct Partial {
  float max[kMaxGroup];
  float sum[kMaxGroup];
  alignas(64) float acc[kMaxGroup * kMaxHeadDim];  // row g at g * kMaxHeadDim (acc_index), zero past acc_span
};

// bfloat16 V rows on AVX-512 accumulate with each block of 32 dims in even-odd order: the even dims in
// its first 16 places, the odd ones in the other 16. One 64-byte load of a V row is 32 bfloat16 dims,
// and a shift and a mask turn it into the float32 of its even and of its odd dims, one instruction per
// 16 dims, where widening 16 dims in order took two. write_output reads the dims back in order. Each
// dim's sum runs in the same order as before: the same bits. The small shape's heads (8 over 4, dim 64),
// 16 requests of 370 tokens, two threads on a Zen 4, best of 300 calls: 29.4-30.0 -> 28.0 ns per token.
template <int Dt>
constexpr bool even_odd_acc() {
#ifdef STRATA_AVX512
  return Dt == kBFloat16;
#else
  return false;
#endif
}

// Where dim d of a query head lies in its accumulator row.
template <int Dt>
inline int64_t acc_index(int64_t d) {
  if constexpr (even_odd_acc<Dt>()) return (d & ~int64_t(31)) + (d & 1) * 16 + (d & 31) / 2;
  return d;
}

// The places of an accumulator row in use: head_dim, up to a whole block of 32 (zero past head_dim in order).
inline int64_t acc_span(int64_t dim) { return (dim + 31) / 32 * 32; }

// The query rows of one group, zero past head_dim: in float32, and as raw bfloat16 for dot products
// straight on bfloat16 keys.
struct Query {
  alignas(64) float f32[kMaxGroup][kMaxHeadDim];
  alignas(64) uint16_t bf16[kMaxGroup][kMaxHeadDim];
};

using Scores = float[kMaxGroup][kMaxTile];

// score[g0 + s][t] = scale * q_(g0 + s) . k_t for the Sub query heads from g0 and the tile's tokens.
template <int Dt, int Sub>
void score_tile(const Problem& p, const Query& q, int64_t g0, const int64_t* row, int64_t count, Scores& score,
                LineFeed& feed, int64_t lines_per_token) {
  // row[t]: the element offset of token t's row of this kv head
  const int64_t dim = p.head_dim;
  for (int64_t t = 0; t < count; ++t) {
    feed.ask(lines_per_token);
#ifdef STRATA_AVX512
    __m512 dot[Sub];
    for (int s = 0; s < Sub; ++s) dot[s] = _mm512_setzero_ps();
#ifdef __AVX512BF16__
    if constexpr (Dt == kBFloat16) {  // 32 products a step, on the raw bfloat16 pairs
      for (int64_t d = 0; d < dim; d += 32) {
        const __mmask32 mask = dim - d >= 32 ? ~__mmask32(0) : (__mmask32(1) << (dim - d)) - 1;
        const auto* k_row = static_cast<const uint16_t*>(p.k_cache) + row[t];
        const __m512bh k = (__m512bh)_mm512_maskz_loadu_epi16(mask, k_row + d);
        for (int s = 0; s < Sub; ++s)
          dot[s] = _mm512_dpbf16_ps(dot[s], (__m512bh)_mm512_load_si512(q.bf16[g0 + s] + d), k);
      }
    } else
#endif
    {
      for (int64_t d = 0; d < dim; d += 16) {
        const __m512 k = load16<Dt>(p.k_cache, row[t] + d, lanes(dim - d));
        for (int s = 0; s < Sub; ++s) dot[s] = _mm512_fmadd_ps(_mm512_load_ps(q.f32[g0 + s] + d), k, dot[s]);
      }
    }
    for (int s = 0; s < Sub; ++s) score[g0 + s][t] = _mm512_reduce_add_ps(dot[s]) * p.scale;
#elif defined(STRATA_AVX2)
    constexpr int kSets = Sub >= 4 ? 1 : 2;  // few heads: two sums each (alternate 8-lane steps)
    __m256 dot[kSets][Sub];
    for (int u = 0; u < kSets; ++u)
      for (int s = 0; s < Sub; ++s) dot[u][s] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 * kSets <= dim; d += 8 * kSets)
      for (int u = 0; u < kSets; ++u) {
        const __m256 k = load8<Dt>(p.k_cache, row[t] + d + 8 * u, 8);
        for (int s = 0; s < Sub; ++s)
          dot[u][s] = _mm256_fmadd_ps(_mm256_load_ps(q.f32[g0 + s] + d + 8 * u), k, dot[u][s]);
      }
    for (; d < dim; d += 8) {
      const __m256 k = load8<Dt>(p.k_cache, row[t] + d, dim - d);
      for (int s = 0; s < Sub; ++s) dot[0][s] = _mm256_fmadd_ps(_mm256_load_ps(q.f32[g0 + s] + d), k, dot[0][s]);
    }
    for (int s = 0; s < Sub; ++s) {
      if constexpr (kSets == 2) dot[0][s] = _mm256_add_ps(dot[0][s], dot[1][s]);
      score[g0 + s][t] = hsum8(dot[0][s]) * p.scale;
    }
#else
    for (int s = 0; s < Sub; ++s) {
      float dot = 0.0f;
      for (int64_t d = 0; d < dim; ++d) dot += q.f32[g0 + s][d] * to_float<Dt>(p.k_cache, row[t] + d);
      score[g0 + s][t] = dot * p.scale;
    }
#endif
  }
}

// acc_(g0 + s) += sum_t weight[g0 + s][t] * v_t, each 16 lanes of the Sub accumulators held in registers
// over the tile (split in independent sums when Sub is small, to hide the FMA latency). `feed` is asked
// for `lines_per_step` lines before each step of 16 dims (none in bfloat16's even-odd steps, see LineFeed).
template <int Dt, int Sub>
void accumulate_tile(const Problem& p, int64_t g0, const int64_t* row, int64_t count, const Scores& weight,
                     float* acc, LineFeed& feed, int64_t lines_per_step) {
  const int64_t dim = p.head_dim;
#ifdef STRATA_AVX512
  if constexpr (even_odd_acc<Dt>()) {  // 32 dims a step, the even ones and the odd ones (acc_index)
    constexpr int kSets = Sub >= 4 ? 1 : 4 / Sub;  // as below: each dim's sum in the same order, the same bits
    const __m512i high_half = _mm512_set1_epi32(int32_t(0xffff0000u));
    for (int64_t d = 0; d < dim; d += 32) {
      const __mmask32 mask = dim - d >= 32 ? ~__mmask32(0) : (__mmask32(1) << (dim - d)) - 1;
      __m512 even[kSets][Sub], odd[kSets][Sub];
      for (int u = 0; u < kSets; ++u)
        for (int s = 0; s < Sub; ++s) {
          even[u][s] = u == 0 ? _mm512_load_ps(acc + (g0 + s) * kMaxHeadDim + d) : _mm512_setzero_ps();
          odd[u][s] = u == 0 ? _mm512_load_ps(acc + (g0 + s) * kMaxHeadDim + d + 16) : _mm512_setzero_ps();
        }
      auto add_token = [&](int64_t t, int u) {
        const __m512i raw = _mm512_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p.v_cache) + row[t] + d);
        const __m512 v_even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        const __m512 v_odd = _mm512_castsi512_ps(_mm512_and_si512(raw, high_half));
        for (int s = 0; s < Sub; ++s) {
          const __m512 w = _mm512_set1_ps(weight[g0 + s][t]);
          even[u][s] = _mm512_fmadd_ps(w, v_even, even[u][s]);
          odd[u][s] = _mm512_fmadd_ps(w, v_odd, odd[u][s]);
        }
      };
      int64_t t = 0;
      for (; t + kSets <= count; t += kSets)
        for (int u = 0; u < kSets; ++u) add_token(t + u, u);
      for (; t < count; ++t) add_token(t, 0);
      for (int s = 0; s < Sub; ++s) {
        for (int u = 1; u < kSets; ++u) {
          even[0][s] = _mm512_add_ps(even[0][s], even[u][s]);
          odd[0][s] = _mm512_add_ps(odd[0][s], odd[u][s]);
        }
        _mm512_store_ps(acc + (g0 + s) * kMaxHeadDim + d, even[0][s]);
        _mm512_store_ps(acc + (g0 + s) * kMaxHeadDim + d + 16, odd[0][s]);
      }
    }
    return;
  }
#endif
  for (int64_t d = 0; d < dim; d += 16) {
    feed.ask(lines_per_step);
#ifdef STRATA_AVX512
    constexpr int kSets = Sub >= 4 ? 1 : 4 / Sub;
    const __mmask16 mask = lanes(dim - d);
    __m512 sums[kSets][Sub];
    for (int u = 0; u < kSets; ++u)
      for (int s = 0; s < Sub; ++s)
        sums[u][s] = u == 0 ? _mm512_load_ps(acc + (g0 + s) * kMaxHeadDim + d) : _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + kSets <= count; t += kSets)
      for (int u = 0; u < kSets; ++u) {
        const __m512 v = load16<Dt>(p.v_cache, row[t + u] + d, mask);
        for (int s = 0; s < Sub; ++s)
          sums[u][s] = _mm512_fmadd_ps(_mm512_set1_ps(weight[g0 + s][t + u]), v, sums[u][s]);
      }
    for (; t < count; ++t) {
      const __m512 v = load16<Dt>(p.v_cache, row[t] + d, mask);
      for (int s = 0; s < Sub; ++s) sums[0][s] = _mm512_fmadd_ps(_mm512_set1_ps(weight[g0 + s][t]), v, sums[0][s]);
    }
    for (int s = 0; s < Sub; ++s) {
      for (int u = 1; u < kSets; ++u) sums[0][s] = _mm512_add_ps(sums[0][s], sums[u][s]);
      _mm512_store_ps(acc + (g0 + s) * kMaxHeadDim + d, sums[0][s]);
    }
#elif defined(STRATA_AVX2)
    constexpr int kSets = Sub >= 4 ? 1 : 4 / Sub;
    // 8 dims from h over the tile's tokens; `whole` (all 8 inside the row) as a constant, so that the
    // loads of a whole step carry no tail check (a bfloat16 tail load zeroes a stack buffer each time)
    auto lanes_from = [&](int64_t h, auto whole) {
      const int64_t n = decltype(whole)::value ? 8 : dim - h;
      __m256 sums[kSets][Sub];
      for (int u = 0; u < kSets; ++u)
        for (int s = 0; s < Sub; ++s)
          sums[u][s] = u == 0 ? _mm256_load_ps(acc + (g0 + s) * kMaxHeadDim + h) : _mm256_setzero_ps();
      int64_t t = 0;
      for (; t + kSets <= count; t += kSets)
        for (int u = 0; u < kSets; ++u) {
          const __m256 v = load8<Dt>(p.v_cache, row[t + u] + h, n);
          for (int s = 0; s < Sub; ++s)
            sums[u][s] = _mm256_fmadd_ps(_mm256_set1_ps(weight[g0 + s][t + u]), v, sums[u][s]);
        }
      for (; t < count; ++t) {
        const __m256 v = load8<Dt>(p.v_cache, row[t] + h, n);
        for (int s = 0; s < Sub; ++s) sums[0][s] = _mm256_fmadd_ps(_mm256_set1_ps(weight[g0 + s][t]), v, sums[0][s]);
      }
      for (int s = 0; s < Sub; ++s) {
        for (int u = 1; u < kSets; ++u) sums[0][s] = _mm256_add_ps(sums[0][s], sums[u][s]);
        _mm256_store_ps(acc + (g0 + s) * kMaxHeadDim + h, sums[0][s]);
      }
    };
    for (int64_t h = d; h < std::min(dim, d + 16); h += 8) {
      if (dim - h >= 8) lanes_from(h, std::true_type{});
      else lanes_from(h, std::false_type{});
    }
#else
    const int64_t width = std::min<int64_t>(16, dim - d);
    for (int s = 0; s < Sub; ++s)
      for (int64_t t = 0; t < count; ++t)
        for (int64_t i = 0; i < width; ++i)
          acc[(g0 + s) * kMaxHeadDim + d + i] += weight[g0 + s][t] * to_float<Dt>(p.v_cache, row[t] + d + i);
#endif
  }
}

// Both tile passes over the group, in sub-groups of 8, 4, 2 and 1 heads (their K/V rows are in cache
// after the first).
template <int Dt>
void score_group(const Problem& p, const Query& q, int64_t group, const int64_t* row, int64_t count, Scores& score,
                 LineFeed& feed, int64_t lines_per_token) {
  for (int64_t g0 = 0; g0 < group;) {
    const int64_t left = group - g0;
    if (left >= 8) { score_tile<Dt, 8>(p, q, g0, row, count, score, feed, lines_per_token); g0 += 8; }
    else if (left >= 4) { score_tile<Dt, 4>(p, q, g0, row, count, score, feed, lines_per_token); g0 += 4; }
    else if (left >= 2) { score_tile<Dt, 2>(p, q, g0, row, count, score, feed, lines_per_token); g0 += 2; }
    else { score_tile<Dt, 1>(p, q, g0, row, count, score, feed, lines_per_token); g0 += 1; }
  }
}

template <int Dt>
void accumulate_group(const Problem& p, int64_t group, const int64_t* row, int64_t count, const Scores& weight,
                      float* acc, LineFeed& feed, int64_t lines_per_step) {
  for (int64_t g0 = 0; g0 < group;) {
    const int64_t left = group - g0;
    if (left >= 8) { accumulate_tile<Dt, 8>(p, g0, row, count, weight, acc, feed, lines_per_step); g0 += 8; }
    else if (left >= 4) { accumulate_tile<Dt, 4>(p, g0, row, count, weight, acc, feed, lines_per_step); g0 += 4; }
    else if (left >= 2) { accumulate_tile<Dt, 2>(p, g0, row, count, weight, acc, feed, lines_per_step); g0 += 2; }
    else { accumulate_tile<Dt, 1>(p, g0, row, count, weight, acc, feed, lines_per_step); g0 += 1; }
  }
}

// Online softmax over one tile: rescale what came before to the new max, turn the scores into weights.
void softmax_tile(int64_t group, int64_t dim, int64_t count, Scores& score, Partial& part) {
  for (int64_t g = 0; g < group; ++g) {
    float tile_max = score[g][0];
    for (int64_t t = 1; t < count; ++t) tile_max = std::max(tile_max, score[g][t]);
    const float new_max = std::max(part.max[g], tile_max);
    const float rescale = std::exp(part.max[g] - new_max);
    part.max[g] = new_max;
    float tile_sum = 0.0f;
#ifdef STRATA_AVX512
    for (int64_t t = 0; t < count; t += 16) {
      const __mmask16 mask = lanes(count - t);
      const __m512 s = _mm512_maskz_loadu_ps(mask, score[g] + t);
      const __m512 w = _mm512_maskz_mov_ps(mask, exp_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
      _mm512_mask_storeu_ps(score[g] + t, mask, w);
      tile_sum += _mm512_reduce_add_ps(w);
    }
#elif defined(STRATA_AVX2)
    for (int64_t t = 0; t < count; t += 8) {  // whole 8-lane steps stay inside the kMaxTile row
      const __m256 s = _mm256_load_ps(score[g] + t);
      const __m256 w = _mm256_and_ps(_mm256_castsi256_ps(lanes8(count - t)),
                                     exp_nonpositive8(_mm256_sub_ps(s, _mm256_set1_ps(new_max))));
      _mm256_store_ps(score[g] + t, w);
      tile_sum += hsum8(w);
    }
#else
    for (int64_t t = 0; t < count; ++t) {
      score[g][t] = std::exp(score[g][t] - new_max);
      tile_sum += score[g][t];
    }
#endif
    part.sum[g] = part.sum[g] * rescale + tile_sum;
    if (rescale != 1.0f)
      for (int64_t d = 0; d < acc_span(dim); ++d) part.acc[g * kMaxHeadDim + d] *= rescale;
  }
}

// Attend every kv head's query heads of request `req` over context positions [lo, hi), into parts[kv_head].
// The tiles of tokens are the outer loop and the kv heads the inner one: a token's rows of all kv heads
// lie side by side in the pool, so each tile reads one contiguous span per token (a block's whole K and
// V in order), where a pass per kv head read one row slice in num_kv_heads of the same blocks each time.
template <int Dt>
void attend_chunk(const Problem& p, int64_t req, int64_t lo, int64_t hi, Partial* const* parts, Query* queries) {
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t dim = p.head_dim;
  const int64_t row_bytes = dim * element_size<Dt>();
  const int64_t token_bytes = p.num_kv_heads * row_bytes;  // one token's rows of every kv head
  const int64_t row_stride = p.num_kv_heads * dim;  // elements between consecutive tokens
  const int64_t* table = p.block_tables + req * p.table_stride;
  const int64_t tile = std::clamp<int64_t>(kTileBytes / row_bytes, 8, kMaxTile);

  const int64_t padded_dim = (dim + 31) / 32 * 32;  // what the dot products read
  for (int64_t kv_head = 0; kv_head < p.num_kv_heads; ++kv_head) {
    Query& q = queries[kv_head];
    Partial& part = *parts[kv_head];
    for (int64_t g = 0; g < group; ++g) {
      const int64_t base = req * p.q_stride_req + (kv_head * group + g) * p.q_stride_head;
      for (int64_t d = 0; d < padded_dim; ++d) q.f32[g][d] = d < dim ? to_float<Dt>(p.q, base + d) : 0.0f;
      const uint16_t* raw = static_cast<const uint16_t*>(p.q) + base;  // read only when q is bfloat16
      for (int64_t d = 0; d < padded_dim; ++d) q.bf16[g][d] = Dt == kBFloat16 && d < dim ? raw[d] : 0;
      part.max[g] = -INFINITY;
      part.sum[g] = 0.0f;
    }
    std::fill(part.acc, part.acc + group * kMaxHeadDim, 0.0f);
  }

  // Element offsets of the tile's tokens' rows (of kv head 0; K and V share them) and of the next tile's.
  // A tile of two blocks or more (bfloat16's 32 tokens of 16-token blocks) takes its tokens from its two
  // halves in turn: two blocks of K and two of V read at once keep more reads in flight than one of each
  // (the order of a tile's tokens changes no score, only the order of the weighted sum). The small
  // shape's attention over a 236 MB bfloat16 pool (64 requests x 450 tokens, 8 layers), two threads:
  // 16.5-18.8 -> 19.6-21.6 GB/s; `strata bench offline` bfloat16, 128 prompts, four alternating pairs:
  // 2,398-2,609 -> 2,438-2,706 tok/s (+1.7% to +6.5%). float32's 16-token tiles gained nothing from
  // 32-token ones read so.
  const bool two_spans = tile >= 2 * p.block_size;
  auto find_rows = [&](int64_t start, int64_t* rows) {
    const int64_t n = std::min(tile, hi - start), half = (n + 1) / 2;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = start + (!two_spans ? t : t % 2 == 0 ? t / 2 : half + t / 2);
      rows[t] = (table[pos / p.block_size] * p.block_size + pos % p.block_size) * row_stride;
    }
  };
  int64_t rows_a[kMaxTile], rows_b[kMaxTile], head_rows[kMaxTile];
  int64_t *row = rows_a, *next_row = rows_b;
  const char* k_pool = static_cast<const char*>(p.k_cache);
  const char* v_pool = static_cast<const char*>(p.v_cache);
  // Blocks are scattered over the pool: the first tile's K and V rows are asked for now, each next
  // tile's a few lines per token scored in the tile before it.
  LineFeed feed;
  find_rows(lo, row);
  feed.start(k_pool, v_pool, row, std::min(tile, hi - lo), element_size<Dt>(), token_bytes);
  feed.ask(feed.total);
  alignas(64) Scores score;
  for (int64_t start = lo; start < hi; start += tile) {
    const int64_t count = std::min(tile, hi - start);
    const int64_t next_count = std::max<int64_t>(0, std::min(tile, hi - start - tile));
    if (next_count > 0) find_rows(start + tile, next_row);
    feed.start(k_pool, v_pool, next_row, next_count, element_size<Dt>(), token_bytes);
    const int64_t scored = p.num_kv_heads * count * ((group + 7) / 8);  // score_tile's token passes, at least
    const int64_t summed = p.num_kv_heads * ((group + 7) / 8) * ((dim + 15) / 16);  // accumulate_tile's steps, at least
    const int64_t over_scores = Dt == kFloat32 ? feed.total / 2 : feed.total;  // the rest over the V steps (LineFeed)
    const int64_t lines_per_pass = (over_scores + scored - 1) / scored;
    const int64_t lines_per_step = (feed.total - over_scores + summed - 1) / summed;
    for (int64_t kv_head = 0; kv_head < p.num_kv_heads; ++kv_head) {
      for (int64_t t = 0; t < count; ++t) head_rows[t] = row[t] + kv_head * dim;
      Partial& part = *parts[kv_head];
      score_group<Dt>(p, queries[kv_head], group, head_rows, count, score, feed, lines_per_pass);
      softmax_tile(group, dim, count, score, part);
      accumulate_group<Dt>(p, group, head_rows, count, score, part.acc, feed, lines_per_step);
    }
    feed.ask(feed.total);  // what the passes left
    std::swap(row, next_row);
  }
}

template <int Dt>
void write_output(const Problem& p, int64_t req, int64_t kv_head, const Partial& part) {
  const int64_t group = p.num_heads / p.num_kv_heads;
  for (int64_t g = 0; g < group; ++g) {
    float* out = p.out + (req * p.num_heads + kv_head * group + g) * p.head_dim;
    const float inverse = part.sum[g] > 0.0f ? 1.0f / part.sum[g] : 0.0f;
    for (int64_t d = 0; d < p.head_dim; ++d) out[d] = part.acc[g * kMaxHeadDim + acc_index<Dt>(d)] * inverse;
  }
}

// Fold the partials of one (request, kv_head)'s chunks into one.
void merge(const Problem& p, const Partial* chunks, int64_t num_chunks, Partial& merged) {
  const int64_t group = p.num_heads / p.num_kv_heads;
  for (int64_t g = 0; g < group; ++g) {
    float max = -INFINITY;
    for (int64_t c = 0; c < num_chunks; ++c) max = std::max(max, chunks[c].max[g]);
    merged.max[g] = max;
    merged.sum[g] = 0.0f;
    float* acc = merged.acc + g * kMaxHeadDim;
    std::fill(acc, acc + kMaxHeadDim, 0.0f);
    for (int64_t c = 0; c < num_chunks; ++c) {
      const float weight = std::exp(chunks[c].max[g] - max);
      merged.sum[g] += chunks[c].sum[g] * weight;
      const float* part = chunks[c].acc + g * kMaxHeadDim;
      for (int64_t d = 0; d < acc_span(p.head_dim); ++d) acc[d] += part[d] * weight;
    }
  }
}

// How one step's work is cut: each request's visible span [first, seq_len) in chunks of chunk_tokens,
// short enough that every thread gets about kItemsPerThread items, never shorter than min_chunk_tokens;
// a work item is a chunk with all its kv heads, so that the K/V rows of a token (every head's, side by
// side in the pool) are read by one thread, in one go (attend_chunk), where (chunk, kv_head) items had two
// threads read the heads' quarter rows apart. Chunks of a split request leave partials (one per chunk
// and kv head) for a merge pass.
struct Plan {
  std::vector<int64_t> first, chunk_start;
  int64_t chunk_tokens = 0, num_chunks = 0;
  bool split = false;
  int64_t num_partials(const Problem& p) const { return num_chunks * p.num_kv_heads; }
};

Plan plan_chunks(const Problem& p, int64_t min_chunk_tokens, int64_t num_threads) {
  Plan plan;
  plan.first.resize(p.num_reqs);
  plan.chunk_start.assign(p.num_reqs + 1, 0);
  int64_t total_span = 0;
  for (int64_t r = 0; r < p.num_reqs; ++r) {
    plan.first[r] = p.window > 0 ? std::max<int64_t>(0, p.seq_lens[r] - p.window) : 0;
    total_span += p.seq_lens[r] - plan.first[r];
  }
  const int64_t target_items = kItemsPerThread * num_threads;
  plan.chunk_tokens = std::max(min_chunk_tokens, (total_span + target_items - 1) / target_items);
  for (int64_t r = 0; r < p.num_reqs; ++r) {
    const int64_t span = p.seq_lens[r] - plan.first[r];
    plan.chunk_start[r + 1] = plan.chunk_start[r] + std::max<int64_t>(1, (span + plan.chunk_tokens - 1) / plan.chunk_tokens);
  }
  plan.num_chunks = plan.chunk_start[p.num_reqs];
  plan.split = plan.num_chunks > p.num_reqs;
  return plan;
}

// What attend_chunk and merge use of a Partial (`group` rows of acc_span(dim)), from `from` into `to`.
inline void copy_partial(const Partial& from, int64_t group, int64_t dim, Partial& to) {
  std::copy(from.max, from.max + group, to.max);
  std::copy(from.sum, from.sum + group, to.sum);
  for (int64_t g = 0; g < group; ++g)
    std::copy(from.acc + g * kMaxHeadDim, from.acc + g * kMaxHeadDim + acc_span(dim), to.acc + g * kMaxHeadDim);
}

// The work items of `plan` split over the threads of the enclosing parallel region by `split`
// (work_split.h; serial outside one), then the merges. `partials` holds plan.num_partials(p) entries
// when it splits.
template <int Dt, typename Split>
void attend(const Problem& p, const Plan& plan, Partial* partials, Split& split) {
  Partial local;  // the merge's
  // Each thread's own state for every kv head of a work item: the query rows, and the running softmax
  // of a request attended in one chunk (a split request's go to `partials`); kept across calls, so
  // nothing is allocated (or zeroed) per layer and step.
  static thread_local std::vector<Query> queries;
  static thread_local std::vector<Partial> locals;
  static thread_local std::vector<Partial*> parts;
  if (int64_t(queries.size()) < p.num_kv_heads) {
    queries.resize(p.num_kv_heads);
    locals.resize(p.num_kv_heads);
    parts.resize(p.num_kv_heads);
  }
  const int64_t group = p.num_heads / p.num_kv_heads;
  split.items(plan.num_chunks, 1, [&](int64_t chunk) {
    const int64_t req =
        std::upper_bound(plan.chunk_start.begin(), plan.chunk_start.end(), chunk) - plan.chunk_start.begin() - 1;
    const int64_t lo = plan.first[req] + (chunk - plan.chunk_start[req]) * plan.chunk_tokens;
    const int64_t hi = std::min(p.seq_lens[req], lo + plan.chunk_tokens);
    const bool alone = plan.chunk_start[req + 1] - plan.chunk_start[req] == 1;
    for (int64_t kv_head = 0; kv_head < p.num_kv_heads; ++kv_head) parts[kv_head] = &locals[kv_head];
    attend_chunk<Dt>(p, req, lo, hi, parts.data(), queries.data());
    // A split request's running softmax is copied out whole: a shared Partial only ever holds final
    // values (a work item may run twice at once, work_split.h).
    for (int64_t kv_head = 0; kv_head < p.num_kv_heads; ++kv_head) {
      if (alone)
        write_output<Dt>(p, req, kv_head, locals[kv_head]);
      else
        copy_partial(locals[kv_head], group, p.head_dim, partials[kv_head * plan.num_chunks + chunk]);
    }
  });
  if (plan.split) {
    split.items(p.num_reqs * p.num_kv_heads, 1, [&](int64_t item) {
      const int64_t req = item / p.num_kv_heads, kv_head = item % p.num_kv_heads;
      const int64_t count = plan.chunk_start[req + 1] - plan.chunk_start[req];
      if (count == 1) return;
      merge(p, &partials[kv_head * plan.num_chunks + plan.chunk_start[req]], count, local);
      write_output<Dt>(p, req, kv_head, local);
    });
  }
}

}  // namespace
