// Temperature sampling on the CPU: per row, the weights exp(logit / T - max / T) and one inverse-CDF
// draw from them (the token whose running sum first passes u x the row's mass), as the torch path of
// sampler.py and inverse_cdf.py computes it with about 25 operator calls (see sampling.py).
//
// Per row: a pass for the max, a pass for the weights (kept in a thread-local buffer) with their float64
// sums per block of kBlock tokens, then a walk over the block sums to the block the target falls in and
// a walk inside it. Rows are independent: a row draws the same token in any batch.

#include <omp.h>

#include <cmath>
#include <limits>
#include <vector>

#include "paged_decode_kernels.h"  // exp_nonpositive, lanes (AVX-512); exp_nonpositive8 (AVX2)

namespace {

constexpr int64_t kBlock = 256;  // tokens per block of the two-level running sum

// w[i] = exp(x[i] / t - shift) for x[i] / t <= shift, exactly 0 where x[i] is -inf (a masked token).
void shifted_exp(const float* x, int64_t n, float t, float shift, float* w) {
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#ifdef STRATA_AVX512
  const __m512 tv = _mm512_set1_ps(t), sv = _mm512_set1_ps(shift), masked = _mm512_set1_ps(kMasked);
  for (; i < n; i += 16) {
    const __mmask16 mask = lanes(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(mask, x + i);
    const __mmask16 live = _mm512_cmp_ps_mask(v, masked, _CMP_NEQ_OQ);
    _mm512_mask_storeu_ps(w + i, mask, _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(_mm512_div_ps(v, tv), sv))));
  }
#elif defined(STRATA_AVX2)
  const __m256 tv = _mm256_set1_ps(t), sv = _mm256_set1_ps(shift), masked = _mm256_set1_ps(kMasked);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_div_ps(v, tv), sv));
    _mm256_storeu_ps(w + i, _mm256_and_ps(e, _mm256_cmp_ps(v, masked, _CMP_NEQ_OQ)));
  }
#endif
  for (; i < n; ++i) w[i] = x[i] == kMasked ? 0.0f : std::exp(std::min(x[i] / t - shift, 0.0f));
}

// torch.argmax's choice: the first NaN, else the first of the largest.
int64_t argmax(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

int64_t sample_row(const float* logits, int64_t vocab, float temperature, double uniform, std::vector<float>& weights,
                   std::vector<double>& block_sums) {
  float top = -std::numeric_limits<float>::infinity();
  bool has_nan = false;
  for (int64_t i = 0; i < vocab; ++i) {
    top = std::max(top, logits[i]);
    has_nan |= std::isnan(logits[i]);
  }
  if (has_nan || !std::isfinite(top)) return argmax(logits, vocab);  // no mass to draw from (or -inf everywhere)
  weights.resize(vocab);
  shifted_exp(logits, vocab, temperature, top / temperature, weights.data());
  const int64_t num_blocks = (vocab + kBlock - 1) / kBlock;
  block_sums.resize(num_blocks);
  double total = 0.0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    double sum = 0.0;
    for (int64_t i = b * kBlock; i < std::min(vocab, (b + 1) * kBlock); ++i) sum += weights[i];
    block_sums[b] = sum;
    total += sum;
  }
  if (!(total > 0.0) || !std::isfinite(total)) return argmax(logits, vocab);
  // The walk adds the same float64 sums in the same order as `total`, so a target below the total is
  // passed inside some block, at a token of positive weight.
  const double target = uniform * total;
  double running = 0.0;
  int64_t last_block = 0;  // the last block of positive mass
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (block_sums[b] > 0.0) last_block = b;
    if (running + block_sums[b] <= target) {
      running += block_sums[b];
      continue;
    }
    double inside = 0.0;
    for (int64_t i = b * kBlock; i < std::min(vocab, (b + 1) * kBlock); ++i) {
      inside += weights[i];
      if (running + inside > target) return i;
    }
  }
  // a target rounded up to the total: the last token of positive weight, never one of weight 0
  for (int64_t i = std::min(vocab, (last_block + 1) * kBlock) - 1; i > last_block * kBlock; --i)
    if (weights[i] > 0.0f) return i;
  return last_block * kBlock;
}

}  // namespace

extern "C" {

// logits: [rows, vocab] float32, row stride `stride`; temperatures: [rows] (> 0); uniforms: [rows] in
// [0, 1); out: [rows] token ids.
void strata_sample_temperature(const float* logits, int64_t rows, int64_t vocab, int64_t stride,
                               const float* temperatures, const double* uniforms, int64_t* out) {
#pragma omp parallel if (rows > 1 && rows * vocab >= (1 << 16))
  {
    static thread_local std::vector<float> weights;
    static thread_local std::vector<double> block_sums;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      out[r] = sample_row(logits + r * stride, vocab, temperatures[r], uniforms[r], weights, block_sums);
  }
}

}  // extern "C"
