// The per-row operations between a Llama layer's projections, in the model's dtype: RMSNorm, rotary
// and silu(gate) * up, each rounded where the torch forward (models/layers.py, models/rope.py) rounds.
// The decode step (decode_forward.cpp) runs them inside its parallel region; fused_ops.cpp runs them
// over the many rows of a prefill.

#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "linear_panels.h"
#include "paged_decode_kernels.h"

namespace {

// The model's element type: float32, or bfloat16 as its bits.
template <typename T>
struct Elem;
template <>
struct Elem<float> {
  static constexpr int kDtype = kFloat32;
  using Packed = float;  // x as the panel kernels read it
  static float load(float v) { return v; }
  static float store(float v) { return v; }
  static float round(float v) { return v; }
};
template <>
struct Elem<uint16_t> {
  static constexpr int kDtype = kBFloat16;
  using Packed = XElement;
  static float load(uint16_t v) { return bf16_to_f32(v); }
  static uint16_t store(float v) { return f32_to_bf16(v); }
  static float round(float v) { return bf16_to_f32(f32_to_bf16(v)); }
};

#ifdef STRATA_AVX512
// 16 values of T at p (the lanes in mask) as float32: paged_decode_kernels.h's load16 for T's dtype.
template <typename T>
inline __m512 load_row16(const T* p, __mmask16 mask) {
  return load16<Elem<T>::kDtype>(p, 0, mask);
}

// Back to T, rounded as Elem<T>::store rounds (store16, below).
// 16 float32 values as bfloat16, each as f32_to_bf16 rounds it. Where the CPU converts to bfloat16 itself
// (AVX512_BF16) its instruction does it, one where the integer path below takes about eight: it rounds to
// nearest even and quiets a NaN the same way, but turns a subnormal input into zero, so a vector holding
// one goes the integer way. Measured on the 2-core Xeon (AVX512_BF16), two threads, 2,048 bfloat16 rows,
// alternating in one session: silu(gate) * up 1.48 -> 1.32-1.37 ms, the residual add with RMSNorm over
// 512 wide 348-398 -> 291-296 us, rotary on 16 heads of 64 519-683 -> 415-517 us.
inline __m256i bf16_16(__m512 v) {
#ifdef __AVX512BF16__
  if (_mm512_fpclass_ps_mask(v, 0x20) == 0) return (__m256i)_mm512_cvtneps_pbh(v);  // 0x20: subnormal
#endif
  const __m512i u = _mm512_castps_si512(v);
  const __m512i high = _mm512_srli_epi32(u, 16);
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(high, _mm512_set1_epi32(1)))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40))));
}

template <typename T>
inline void store16(T* p, __m512 v, __mmask16 mask) {
  if constexpr (std::is_same_v<T, float>)
    _mm512_mask_storeu_ps(p, mask, v);
  else
    _mm256_mask_storeu_epi16(p, mask, bf16_16(v));
}

// Elem<T>::round, 16 at a time.
template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_16(v)), 16));
}
#endif

#ifdef STRATA_AVX2
// The same on 8 whole lanes (the loops below leave a row's last n % 8 values to the scalar code).
template <typename T>
inline __m256 load_row8(const T* p) {
  return load8<Elem<T>::kDtype>(p, 0, 8);
}

// 8 float32 values rounded to bfloat16 as f32_to_bf16 rounds them, each in the low half of its lane.
inline __m256i bf16_8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i high = _mm256_srli_epi32(u, 16);
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(high, _mm256_set1_epi32(1)))), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(rounded, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
}

template <typename T>
inline void store8(T* p, __m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm256_storeu_ps(p, v);
  } else {
    const __m256i bits = bf16_8(v);  // packus works per 128-bit half: gather the halves' 64-bit results
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
}

template <typename T>
inline __m256 round8(__m256 v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_8(v), 16));
}
#endif

// residual += addend over one row of n, the sum rounded to T (as torch's in-place add).
template <typename T>
void add_row(T* residual, const T* addend, int64_t n) {
  int64_t i = 0;
#ifdef STRATA_AVX512
  for (; i < n; i += 16) {
    const __mmask16 mask = lanes(n - i);
    store16(residual + i, _mm512_add_ps(load_row16(residual + i, mask), load_row16(addend + i, mask)), mask);
  }
#elif defined(STRATA_AVX2)
  for (; i + 8 <= n; i += 8) store8(residual + i, _mm256_add_ps(load_row8(residual + i), load_row8(addend + i)));
#endif
  for (; i < n; ++i) residual[i] = Elem<T>::store(Elem<T>::load(residual[i]) + Elem<T>::load(addend[i]));
}

// out = norm(x) * weight over one row of n, as models/layers.py's RMSNorm: float32 throughout for a
// float32 model; for bfloat16 the normalised row is rounded before the weight multiplies it. The sum
// of squares runs in 16 lanes (element i in lane i % 16), then over the lanes in order.
template <typename T>
void rms_norm_row(const T* x, const T* weight, int64_t n, float eps, T* out) {
  float sums[16] = {};
#ifdef STRATA_AVX512
  __m512 lane_sums = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = load_row16(x + i, lanes(n - i));
    lane_sums = _mm512_add_ps(lane_sums, _mm512_mul_ps(v, v));
  }
  _mm512_storeu_ps(sums, lane_sums);
#else
  int64_t i = 0;
#ifdef STRATA_AVX2
  __m256 low_sums = _mm256_setzero_ps(), high_sums = _mm256_setzero_ps();  // lanes 0-7 and 8-15
  for (; i + 16 <= n; i += 16) {
    const __m256 low = load_row8(x + i), high = load_row8(x + i + 8);
    low_sums = _mm256_add_ps(low_sums, _mm256_mul_ps(low, low));
    high_sums = _mm256_add_ps(high_sums, _mm256_mul_ps(high, high));
  }
  _mm256_storeu_ps(sums, low_sums);
  _mm256_storeu_ps(sums + 8, high_sums);
#endif
  for (; i < n; ++i) {
    const float v = Elem<T>::load(x[i]);
    sums[i % 16] += v * v;
  }
#endif
  float sum = 0.0f;
  for (float s : sums) sum += s;
  const float inverse = 1.0f / std::sqrt(sum / float(n) + eps);
#ifdef STRATA_AVX512
  const __m512 scale = _mm512_set1_ps(inverse);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = lanes(n - i);
    const __m512 normed = round16<T>(_mm512_mul_ps(load_row16(x + i, mask), scale));
    store16(out + i, _mm512_mul_ps(load_row16(weight + i, mask), normed), mask);
  }
#else
  i = 0;
#ifdef STRATA_AVX2
  for (; i + 8 <= n; i += 8) {
    const __m256 normed = round8<T>(_mm256_mul_ps(load_row8(x + i), _mm256_set1_ps(inverse)));
    store8(out + i, _mm256_mul_ps(load_row8(weight + i), normed));
  }
#endif
  for (; i < n; ++i)
    out[i] = Elem<T>::store(Elem<T>::load(weight[i]) * Elem<T>::round(Elem<T>::load(x[i]) * inverse));
#endif
}

// Rotates one head's D values in place at `position`, as models/rope.py's apply_rotary_ (HF's
// x * cos + rotate_half(x) * sin), each product and sum rounded to T.
template <typename T>
void rotate_head(T* x, const T* cos, const T* sin, int64_t dim) {
  const int64_t half = dim / 2;
  int64_t d = 0;
#ifdef STRATA_AVX512
  for (; d < half; d += 16) {
    const __mmask16 mask = lanes(half - d);
    const __m512 x1 = load_row16(x + d, mask), x2 = load_row16(x + d + half, mask);
    const __m512 partner1 = round16<T>(_mm512_mul_ps(x1, load_row16(sin + d, mask)));
    const __m512 partner2 = round16<T>(_mm512_mul_ps(x2, load_row16(sin + d + half, mask)));
    const __m512 c1 = round16<T>(_mm512_mul_ps(x1, load_row16(cos + d, mask)));
    const __m512 c2 = round16<T>(_mm512_mul_ps(x2, load_row16(cos + d + half, mask)));
    store16(x + d, _mm512_add_ps(c1, partner2), mask);
    store16(x + d + half, _mm512_add_ps(c2, partner1), mask);
  }
#elif defined(STRATA_AVX2)
  for (; d + 8 <= half; d += 8) {
    const __m256 x1 = load_row8(x + d), x2 = load_row8(x + d + half);
    const __m256 partner1 = round8<T>(_mm256_mul_ps(x1, load_row8(sin + d)));
    const __m256 partner2 = round8<T>(_mm256_mul_ps(x2, load_row8(sin + d + half)));
    const __m256 c1 = round8<T>(_mm256_mul_ps(x1, load_row8(cos + d)));
    const __m256 c2 = round8<T>(_mm256_mul_ps(x2, load_row8(cos + d + half)));
    store8(x + d, _mm256_add_ps(c1, partner2));
    store8(x + d + half, _mm256_add_ps(c2, partner1));
  }
#endif
  for (; d < half; ++d) {
    const float x1 = Elem<T>::load(x[d]), x2 = Elem<T>::load(x[d + half]);
    const float partner1 = Elem<T>::round(x1 * Elem<T>::load(sin[d]));
    const float partner2 = Elem<T>::round(x2 * Elem<T>::load(sin[d + half]));
    const float c1 = Elem<T>::round(x1 * Elem<T>::load(cos[d]));
    const float c2 = Elem<T>::round(x2 * Elem<T>::load(cos[d + half]));
    x[d] = Elem<T>::store(c1 + partner2);
    x[d + half] = Elem<T>::store(c2 + partner1);
  }
}

// silu(gate) * up for `count` elements, silu's result rounded to T before the product.
template <typename T>
void silu_mul(const T* gate, const T* up, T* out, int64_t count) {
  int64_t i = 0;
#ifdef STRATA_AVX512
  const __m512 one = _mm512_set1_ps(1.0f);
  // kSiluVectors vectors at a time: exp's chain of dependent FMAs is long, and independent chains side
  // by side keep the core busy where one vector at a time left it waiting on each chain's latency
  // (bfloat16, 2,048 rows of 1,376, two threads on the 2-core Xeon: 1.65-1.71 -> 1.48 ms).
  constexpr int kSiluVectors = 4;
  for (; i < count; i += 16 * kSiluVectors) {
    __mmask16 mask[kSiluVectors];
    __m512 x[kSiluVectors], e[kSiluVectors];
    for (int v = 0; v < kSiluVectors; ++v) {
      mask[v] = lanes(std::max<int64_t>(0, count - i - 16 * v));
      x[v] = load_row16(gate + i + 16 * v, mask[v]);
      // sigmoid from e = exp(-|x|) <= 1: 1 / (1 + e) for x >= 0, e / (1 + e) below
      e[v] = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x[v])));
    }
    for (int v = 0; v < kSiluVectors; ++v) {
      const __mmask16 negative = _mm512_cmp_ps_mask(x[v], _mm512_setzero_ps(), _CMP_LT_OQ);
      const __m512 sigmoid = _mm512_div_ps(_mm512_mask_mov_ps(one, negative, e[v]), _mm512_add_ps(one, e[v]));
      store16(out + i + 16 * v, _mm512_mul_ps(round16<T>(_mm512_mul_ps(x[v], sigmoid)), load_row16(up + i + 16 * v, mask[v])),
              mask[v]);
    }
  }
#elif defined(STRATA_AVX2)
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
  constexpr int kSiluVectors = 4;  // independent exp chains side by side, as above
  for (; i + 8 <= count;) {
    const int vectors = int(std::min<int64_t>(kSiluVectors, (count - i) / 8));
    __m256 x[kSiluVectors], e[kSiluVectors];
    for (int v = 0; v < vectors; ++v) {
      x[v] = load_row8(gate + i + 8 * v);
      e[v] = exp_nonpositive8(_mm256_or_ps(x[v], sign));  // exp(-|x|)
    }
    for (int v = 0; v < vectors; ++v) {
      const __m256 negative = _mm256_cmp_ps(x[v], zero, _CMP_LT_OQ);
      const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e[v], negative), _mm256_add_ps(one, e[v]));
      store8(out + i + 8 * v, _mm256_mul_ps(round8<T>(_mm256_mul_ps(x[v], sigmoid)), load_row8(up + i + 8 * v)));
    }
    i += 8 * vectors;
  }
#endif
  for (; i < count; ++i) {
    const float x = Elem<T>::load(gate[i]);
    out[i] = Elem<T>::store(Elem<T>::round(x / (1.0f + std::exp(-x))) * Elem<T>::load(up[i]));
  }
}

}  // namespace
