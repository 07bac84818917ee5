// Sampling on the CPU: per row, the weights exp(logit / T - max / T), the min_p, top_k and top_p filters
// on them, and one inverse-CDF draw (the token whose running sum first passes u x the row's mass), as the
// torch path of sampler.py and inverse_cdf.py computes it with dozens of operator calls and, for top_k
// and top_p, a sort of the whole vocabulary (see sampling.py).
//
// Per row: a pass for the max, a pass for the weights (kept in a thread-local buffer); min_p zeroes the
// weights below min_p (a probability below min_p x the largest); top_k and top_p keep a leading run of the
// tokens in descending weight, found without sorting the vocabulary: the weights below a floor the run
// provably ends above are dropped in one pass (most of a language model's vocabulary), then a histogram
// of the other weights' bit patterns (positive floats order as their bits) picks the one bucket where the
// run ends, and only that bucket's tokens are sorted. Then the float64 sums per block of kBlock tokens, a
// walk over them to the block the target falls in and a walk inside it. The passes over the vocabulary
// are vector code: on 2 cores, 64 rows of a 152k vocabulary of a language model's shape (the top token
// ~0.7) took 9.5 ms at temperature 1, 18.2 ms with top_p 0.9 and 18.8 with top_k 50 with scalar ones and
// every positive weight searched, against 2.1-2.3, 3.0-3.1 and 3.4-3.7 ms. Rows are independent: a row draws the same
// token in any batch.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "paged_decode_kernels.h"  // exp_nonpositive, lanes (AVX-512); exp_nonpositive8 (AVX2)

namespace {

constexpr int64_t kBlock = 256;  // tokens per block of the two-level running sum

// w[i] = exp(x[i] / t - shift) for x[i] / t <= shift, exactly 0 where x[i] is -inf (a masked token). At
// t = 1 (OpenAI's default temperature) without the division, which is most of this pass's time.
void shifted_exp(const float* x, int64_t n, float t, float shift, float* w) {
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  const bool unit = t == 1.0f;
  int64_t i = 0;
#ifdef STRATA_AVX512
  const __m512 tv = _mm512_set1_ps(t), sv = _mm512_set1_ps(shift), masked = _mm512_set1_ps(kMasked);
  for (; i < n; i += 16) {
    const __mmask16 mask = lanes(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(mask, x + i);
    const __mmask16 live = _mm512_cmp_ps_mask(v, masked, _CMP_NEQ_OQ);
    const __m512 scaled = unit ? v : _mm512_div_ps(v, tv);
    _mm512_mask_storeu_ps(w + i, mask, _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(scaled, sv))));
  }
#elif defined(STRATA_AVX2)
  const __m256 tv = _mm256_set1_ps(t), sv = _mm256_set1_ps(shift), masked = _mm256_set1_ps(kMasked);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(unit ? v : _mm256_div_ps(v, tv), sv));
    _mm256_storeu_ps(w + i, _mm256_and_ps(e, _mm256_cmp_ps(v, masked, _CMP_NEQ_OQ)));
  }
#endif
  for (; i < n; ++i) w[i] = x[i] == kMasked ? 0.0f : std::exp(std::min(x[i] / t - shift, 0.0f));
}

// The row's largest value and whether it holds a NaN (`top` is then meaningless).
void row_max(const float* x, int64_t n, float& top, bool& has_nan) {
  top = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#ifdef STRATA_AVX512
  __m512 best = _mm512_set1_ps(top);
  __mmask16 nan_seen = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan_seen |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  top = _mm512_reduce_max_ps(best);
  has_nan = nan_seen != 0;
#elif defined(STRATA_AVX2)
  __m256 best = _mm256_set1_ps(top), nan_seen = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan_seen = _mm256_or_ps(nan_seen, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    best = _mm256_max_ps(best, v);
  }
  alignas(32) float lanes8[8];
  _mm256_store_ps(lanes8, best);
  for (float v : lanes8) top = std::max(top, v);
  has_nan = _mm256_movemask_ps(nan_seen) != 0;
#else
  has_nan = false;
#endif
  for (; i < n; ++i) {
    top = std::max(top, x[i]);
    has_nan |= std::isnan(x[i]);
  }
}

// The float64 sum of w[0, n), in several running sums at once (one running sum is a chain of dependent
// additions, ~4 cycles per token).
double sum_of(const float* w, int64_t n) {
  int64_t i = 0;
  double sum = 0.0;
#ifdef STRATA_AVX512
  __m512d low = _mm512_setzero_pd(), high = _mm512_setzero_pd();
  for (; i + 16 <= n; i += 16) {
    low = _mm512_add_pd(low, _mm512_cvtps_pd(_mm256_loadu_ps(w + i)));
    high = _mm512_add_pd(high, _mm512_cvtps_pd(_mm256_loadu_ps(w + i + 8)));
  }
  sum = _mm512_reduce_add_pd(_mm512_add_pd(low, high));
#elif defined(STRATA_AVX2)
  __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
  for (; i + 8 <= n; i += 8) {
    low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm_loadu_ps(w + i)));
    high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm_loadu_ps(w + i + 4)));
  }
  alignas(32) double lanes4[4];
  _mm256_store_pd(lanes4, _mm256_add_pd(low, high));
  sum = (lanes4[0] + lanes4[1]) + (lanes4[2] + lanes4[3]);
#endif
  for (; i < n; ++i) sum += w[i];
  return sum;
}

// torch.argmax's choice, one element at a time: the first NaN, else the first of the largest.
int64_t argmax_scalar(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

// torch.argmax's choice; on AVX-512 a pass for the max (and whether any NaN), then one for its first index.
int64_t argmax(const float* x, int64_t n) {
#ifdef STRATA_AVX512
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan_seen = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = lanes(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(mask, x + i);
    nan_seen |= _mm512_mask_cmp_ps_mask(mask, v, v, _CMP_UNORD_Q);
    best = _mm512_mask_max_ps(best, mask, best, v);
  }
  if (nan_seen) return argmax_scalar(x, n);
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = lanes(n - i);
    const __mmask16 equal = _mm512_mask_cmp_ps_mask(mask, _mm512_maskz_loadu_ps(mask, x + i), top, _CMP_EQ_OQ);
    if (equal) return i + __builtin_ctz(equal);
  }
#endif
  return argmax_scalar(x, n);
}

struct Scratch {
  std::vector<float> weights;
  std::vector<double> block_sums;
  std::vector<uint32_t> counts;
  std::vector<double> masses;
  std::vector<int32_t> group, gathered;  // token ids (a vocabulary has fewer than 2^31)
  std::vector<int32_t> kept;             // drop_below's, grown to the vocabulary once (resize zero-fills)
  std::vector<float> sample;             // top_k_floor's
};

inline uint32_t bits_of(float w) {
  uint32_t b;
  std::memcpy(&b, &w, sizeof b);
  return b;
}

// Buckets of the leading run's search: a weight's bits 30..19 (its exponent and 4 bits of mantissa), then
// inside the bucket where the run ends, its bits 18..7 when that bucket holds more than kSortDirectly.
constexpr int kBucketBits = 12;
constexpr int kShifts[2] = {19, 7};
constexpr size_t kSortDirectly = 2048;

// Zeroes the positive weights below `floor` and lists the others' ids in s.group, ascending.
void drop_below(float* w, int64_t n, float floor, Scratch& s) {
  if (static_cast<int64_t>(s.kept.size()) < n) s.kept.resize(n);
  int32_t* kept_ids = s.kept.data();
  int64_t count = 0, i = 0;
#ifdef STRATA_AVX512
  const __m512 floors = _mm512_set1_ps(floor), zero = _mm512_setzero_ps();
  __m512i ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i sixteen = _mm512_set1_epi32(16);
  for (; i + 16 <= n; i += 16, ids = _mm512_add_epi32(ids, sixteen)) {
    const __m512 v = _mm512_loadu_ps(w + i);
    const __mmask16 positive = _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ);
    const __mmask16 kept = _mm512_mask_cmp_ps_mask(positive, v, floors, _CMP_GE_OQ);
    _mm512_mask_storeu_ps(w + i, positive & ~kept, zero);
    _mm512_mask_compressstoreu_epi32(kept_ids + count, kept, ids);
    count += __builtin_popcount(kept);
  }
#endif
  for (; i < n; ++i) {
    if (!(w[i] > 0.0f)) continue;
    if (w[i] < floor) w[i] = 0.0f;
    else kept_ids[count++] = static_cast<int32_t>(i);
  }
  s.group.assign(kept_ids, kept_ids + count);
}

// The largest float at most `bound`.
float float_at_most(double bound) {
  float f = static_cast<float>(bound);
  return static_cast<double>(f) > bound ? std::nextafter(f, 0.0f) : f;
}

// A weight that at least k of the n weights reach (0 where finding one would not pay): the k-th largest of
// every stride-th weight, a subset of them. The run of top_k ends at or above it.
float top_k_floor(const float* w, int64_t n, int64_t k, Scratch& s) {
  constexpr int64_t kSample = 2048;
  const int64_t stride = n / kSample;
  if (stride < 2 || k > kSample / 8) return 0.0f;
  s.sample.clear();
  for (int64_t i = 0; i < n; i += stride) s.sample.push_back(w[i]);
  std::nth_element(s.sample.begin(), s.sample.begin() + (k - 1), s.sample.end(), std::greater<float>());
  return s.sample[k - 1];
}

// Zeroes all but the leading run of the positive weights taken in descending order (equal weights: the
// lower index first). `make_stop(total)`, given the float64 mass of the positive weights, returns
// `stop(count_before, mass_before)`: true at the first token to drop, given how many tokens come before
// it and their mass; it must stay true once true.
//
// `floor`: the weights below it come after the run's end (the caller's proof), and are dropped at once
// without the search, which then takes the tokens left: most of a language model's vocabulary for top_p
// and top_k (64 rows of a 152k vocabulary on 2 cores: 18 ms with every positive weight searched).
template <typename MakeStop>
void keep_leading_run(float* w, int64_t n, double total, float floor, MakeStop make_stop, Scratch& s) {
  const uint32_t num_buckets = 1u << kBucketBits, bucket_mask = num_buckets - 1;
  int64_t count_before = 0;
  double mass_before = 0.0;
  drop_below(w, n, floor, s);  // s.group: the tokens the run may hold
  const auto stop = make_stop(total);
  for (int level = 0; level < 2; ++level) {
    const int shift = kShifts[level];
    s.counts.assign(num_buckets, 0);
    s.masses.assign(num_buckets, 0.0);
    for (const int32_t i : s.group) {
      const uint32_t b = (bits_of(w[i]) >> shift) & bucket_mask;
      ++s.counts[b];
      s.masses[b] += w[i];
    }
    int64_t end = -1;  // the bucket the run ends in
    for (int64_t b = num_buckets - 1; b >= 0; --b) {
      if (!s.counts[b]) continue;
      if (stop(count_before + s.counts[b], mass_before + s.masses[b])) {
        end = b;
        break;
      }
      count_before += s.counts[b];
      mass_before += s.masses[b];
    }
    if (end < 0) return;  // the run holds every token left
    // Drop the tokens of the buckets below `end`, and gather those of `end`.
    s.gathered.clear();
    for (const int32_t i : s.group) {
      const int64_t b = (bits_of(w[i]) >> shift) & bucket_mask;
      if (b < end) w[i] = 0.0f;
      else if (b == end) s.gathered.push_back(i);
    }
    s.group.swap(s.gathered);
    if (s.group.size() <= kSortDirectly) break;
  }
  // The run ends inside `group` (in ascending index order): sort it, keep its tokens up to the first stop.
  std::stable_sort(s.group.begin(), s.group.end(), [w](int32_t a, int32_t b) { return w[a] > w[b]; });
  bool dropping = false;
  for (const int32_t i : s.group) {
    dropping = dropping || stop(count_before, mass_before);
    if (dropping) {
      w[i] = 0.0f;
      continue;
    }
    ++count_before;
    mass_before += w[i];
  }
}

struct Filters {
  float temperature;
  int64_t top_k;  // 0: off
  float top_p;    // 1: off
  float min_p;    // 0: off
};

// The draw from weights w (zero where a token cannot be drawn), or -1 where they have no finite positive mass.
int64_t draw(const float* w, int64_t vocab, double uniform, std::vector<double>& block_sums) {
  const int64_t num_blocks = (vocab + kBlock - 1) / kBlock;
  block_sums.resize(num_blocks);
  double total = 0.0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    block_sums[b] = sum_of(w + b * kBlock, std::min(vocab, (b + 1) * kBlock) - b * kBlock);
    total += block_sums[b];
  }
  if (!(total > 0.0) || !std::isfinite(total)) return -1;
  // The walk over the blocks adds the same float64 sums in the same order as `total`, so a target below
  // the total falls in some block of positive mass. The walk inside it adds its weights one by one, in
  // another order than its sum: where that rounds the block's end below the target, the draw is its last
  // token of positive weight.
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
    int64_t last_positive = b * kBlock;
    for (int64_t i = b * kBlock; i < std::min(vocab, (b + 1) * kBlock); ++i) {
      inside += w[i];
      if (running + inside > target) return i;
      if (w[i] > 0.0f) last_positive = i;
    }
    return last_positive;
  }
  // a target rounded up to the total: the last token of positive weight, never one of weight 0
  for (int64_t i = std::min(vocab, (last_block + 1) * kBlock) - 1; i > last_block * kBlock; --i)
    if (w[i] > 0.0f) return i;
  return last_block * kBlock;
}

int64_t sample_row(const float* logits, int64_t vocab, const Filters& f, double uniform, Scratch& s) {
  float top;
  bool has_nan;
  row_max(logits, vocab, top, has_nan);
  if (has_nan || !std::isfinite(top)) return argmax(logits, vocab);  // no mass to draw from (or -inf everywhere)
  s.weights.resize(vocab);
  float* w = s.weights.data();
  shifted_exp(logits, vocab, f.temperature, top / f.temperature, w);  // the largest weighs 1
  if (f.min_p > 0.0f) {  // probability < min_p x the largest probability: weight < min_p
    const float floor = f.min_p;
    for (int64_t i = 0; i < vocab; ++i) w[i] = w[i] < floor ? 0.0f : w[i];
  }
  if (f.top_k > 0 && f.top_k < vocab) {  // below a weight that k tokens reach: not among the k largest
    const int64_t k = f.top_k;
    keep_leading_run(w, vocab, 0.0, top_k_floor(w, vocab, k, s),
                     [k](double) { return [k](int64_t count_before, double) { return count_before >= k; }; }, s);
  }
  if (f.top_p < 1.0f) {  // keep a token while the mass before it is below top_p of the mass left
    // The tokens below (1 - top_p) x mass / vocab come last and together weigh less than 1 - top_p of it:
    // every one of them has at least top_p of the mass before it.
    const double top_p = f.top_p, total = sum_of(w, vocab);
    keep_leading_run(w, vocab, total, float_at_most((1.0 - top_p) * total / static_cast<double>(vocab)),
                     [top_p](double total) {
                       return [limit = top_p * total](int64_t, double mass_before) { return mass_before >= limit; };
                     }, s);
  }
  const int64_t token = draw(w, vocab, uniform, s.block_sums);
  return token >= 0 ? token : argmax(logits, vocab);
}

// A row's log-probabilities where it asked for them: log softmax(x) at `token` (x[token] - logZ, logZ =
// max + log sum exp(x - max) summed in float64), the token's rank (1 + how many logits exceed its own) and
// the k largest log-probabilities, most likely first (equal ones: the lower id first). A row with a NaN
// gets NaN log-probabilities, as torch's log_softmax.
void row_logprobs(const float* x, int64_t vocab, int64_t token, int64_t k, std::vector<float>& weights,
                  float* token_logprob, int64_t* rank, int64_t* top_ids, float* top_logprobs) {
  float top;
  bool has_nan;
  row_max(x, vocab, top, has_nan);
  double log_z = std::numeric_limits<double>::quiet_NaN();  // NaN rows, and rows of -inf only (0 / 0)
  if (!has_nan && std::isfinite(top)) {
    weights.resize(vocab);
    shifted_exp(x, vocab, 1.0f, top, weights.data());
    log_z = top + std::log(sum_of(weights.data(), vocab));
  }
  const float own = x[token];
  *token_logprob = static_cast<float>(own - log_z);
  int64_t above = 0;
  for (int64_t i = 0; i < vocab; ++i) above += x[i] > own;
  *rank = above + 1;
  // the k largest, kept sorted (ids and values in top_ids / top_logprobs, values raw until the end)
  int64_t held = 0;
  auto offer = [&](int64_t i) {
    const float v = x[i];
    if (held == k && !(v > top_logprobs[k - 1])) return;
    int64_t at = held < k ? held++ : k - 1;
    while (at > 0 && v > top_logprobs[at - 1]) {
      top_logprobs[at] = top_logprobs[at - 1];
      top_ids[at] = top_ids[at - 1];
      --at;
    }
    top_logprobs[at] = v;
    top_ids[at] = i;
  };
  int64_t i = 0;
  for (; i < vocab && held < k; ++i) offer(i);
#ifdef STRATA_AVX512
  // Once k are held, only the lanes above the k-th largest can enter (the threshold only rises, so a
  // lane below it when its vector is read would have been passed over one by one too): most vectors
  // have none (64 rows of a 152k vocabulary, k = 5: 6.1 ms one by one on 2 cores).
  for (; k > 0 && i + 16 <= vocab; i += 16) {
    __mmask16 above = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), _mm512_set1_ps(top_logprobs[k - 1]), _CMP_GT_OQ);
    for (; above; above &= above - 1) offer(i + __builtin_ctz(above));
  }
#endif
  for (; k > 0 && i < vocab; ++i) offer(i);
  for (int64_t j = 0; j < held; ++j) top_logprobs[j] = static_cast<float>(top_logprobs[j] - log_z);
}

// Sets the logits of the tokens that bitmask row `bits` disallows to -inf (bit j of word w: token 32 w + j
// allowed; a token past the words is not); returns whether an allowed logit is left above -inf (a NaN
// counts, as for torch.isneginf).
bool mask_row(float* x, int64_t vocab, const uint32_t* bits, int64_t words) {
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  const int64_t covered = std::min(vocab, words * 32);
  bool left = false;
  int64_t i = 0;
#ifdef STRATA_AVX512
  const __m512 masked = _mm512_set1_ps(kMasked);
  for (; i + 16 <= covered; i += 16) {
    const __mmask16 allowed = static_cast<__mmask16>(bits[i / 32] >> (i % 32));
    _mm512_mask_storeu_ps(x + i, static_cast<__mmask16>(~allowed), masked);
    left = left || _mm512_mask_cmp_ps_mask(allowed, _mm512_loadu_ps(x + i), masked, _CMP_NEQ_UQ) != 0;
  }
#endif
  for (; i < covered; ++i) {
    if ((bits[i / 32] >> (i % 32)) & 1u) left = left || !(x[i] == kMasked);
    else x[i] = kMasked;
  }
  for (; i < vocab; ++i) x[i] = kMasked;
  return left;
}

// One row's penalties (see strata_penalize), the values they replace into `saved`: the repetition
// penalty on its `num_seen` distinct tokens, then the frequency and presence penalties on its `num_output`
// distinct output tokens. As the torch path computes them (logit_edits.py), operation for operation:
// v / p for a positive logit v, else v * p; (v - frequency x count) - presence. An id outside the
// vocabulary is left alone. Lookups are scattered over the row: the one kPenaltyAhead ahead is prefetched.
constexpr int64_t kPenaltyAhead = 16;

void penalize_row(float* row, int64_t vocab, const int64_t* seen, int64_t num_seen, float repetition,
                  const int64_t* output, const float* counts, int64_t num_output, float frequency, float presence,
                  float* saved) {
  for (int64_t j = 0; j < num_seen; ++j) {
    if (j + kPenaltyAhead < num_seen)
      __builtin_prefetch(row + std::clamp<int64_t>(seen[j + kPenaltyAhead], 0, vocab - 1), 1);
    const int64_t id = seen[j];
    if (id < 0 || id >= vocab) continue;
    const float v = row[id];
    saved[j] = v;
    row[id] = v > 0.0f ? v / repetition : v * repetition;
  }
  saved += num_seen;
  for (int64_t j = 0; j < num_output; ++j) {
    if (j + kPenaltyAhead < num_output)
      __builtin_prefetch(row + std::clamp<int64_t>(output[j + kPenaltyAhead], 0, vocab - 1), 1);
    const int64_t id = output[j];
    if (id < 0 || id >= vocab) continue;
    const float v = row[id];
    saved[j] = v;
    float by_count = frequency * counts[j];
    asm("" : "+m"(by_count));  // rounded to float32 before the subtraction, as torch does: not fused into an FMA
    row[id] = (v - by_count) - presence;
  }
}

// Puts back what penalize_row replaced, the output tokens' values first: an output token is also a seen
// one, and the value saved before the repetition penalty is the one it had.
void unpenalize_row(float* row, int64_t vocab, const int64_t* seen, int64_t num_seen, const int64_t* output,
                    int64_t num_output, const float* saved) {
  for (int64_t j = 0; j < num_output; ++j)
    if (output[j] >= 0 && output[j] < vocab) row[output[j]] = saved[num_seen + j];
  for (int64_t j = 0; j < num_seen; ++j)
    if (seen[j] >= 0 && seen[j] < vocab) row[seen[j]] = saved[j];
}

}  // namespace

extern "C" {

// The structured-output masks of a step: for each pair p, logits row `logit_rows[p]` masked by bitmask row
// `mask_rows[p]` (`words` uint32 per row); a row left with no logit above -inf (the constraint allows only
// what a penalty or min_tokens took away) takes its `unprocessed` row, masked: the constraint wins.
void strata_apply_bitmask(float* logits, const float* unprocessed, int64_t vocab, int64_t stride,
                          int64_t unprocessed_stride, const uint32_t* bitmask, int64_t words, const int64_t* logit_rows,
                          const int64_t* mask_rows, int64_t pairs) {
#pragma omp parallel for schedule(static) if (pairs > 1 && pairs * vocab >= (1LL << 20))
  for (int64_t p = 0; p < pairs; ++p) {
    float* row = logits + logit_rows[p] * stride;
    const uint32_t* bits = bitmask + mask_rows[p] * words;
    if (!mask_row(row, vocab, bits, words)) {
      std::memcpy(row, unprocessed + logit_rows[p] * unprocessed_stride, vocab * sizeof(float));
      mask_row(row, vocab, bits, words);
    }
  }
}

// logits: [rows, vocab] float32, row stride `stride`; per row a temperature (> 0), top_k (0: off), top_p
// (in (0, 1]; 1: off), min_p (in [0, 1]; 0: off) and a uniform in [0, 1); out: [rows] token ids. A null
// top_ks, top_ps or min_ps turns that filter off for every row.
void strata_sample(const float* logits, int64_t rows, int64_t vocab, int64_t stride, const float* temperatures,
                   const int64_t* top_ks, const float* top_ps, const float* min_ps, const double* uniforms,
                   int64_t* out) {
#pragma omp parallel if (rows > 1 && rows * vocab >= (1 << 16))
  {
    static thread_local Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; ++r)
      out[r] = sample_row(logits + r * stride, vocab,
                          {temperatures[r], top_ks ? top_ks[r] : 0, top_ps ? top_ps[r] : 1.0f, min_ps ? min_ps[r] : 0.0f},
                          uniforms[r], scratch);
  }
}

// logits: [rows, vocab] float32, row stride `stride`; tokens: [rows]; k <= vocab. Out: token_logprobs
// [rows], ranks [rows], top_ids [rows, k], top_logprobs [rows, k].
void strata_logprobs(const float* logits, int64_t rows, int64_t vocab, int64_t stride, const int64_t* tokens,
                     int64_t k, float* token_logprobs, int64_t* ranks, int64_t* top_ids, float* top_logprobs) {
#pragma omp parallel if (rows > 1 && rows * vocab >= (1 << 16))
  {
    static thread_local std::vector<float> weights;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      row_logprobs(logits + r * stride, vocab, tokens[r], k, weights, token_logprobs + r, ranks + r,
                   top_ids + r * k, top_logprobs + r * k);
  }
}

// logits: [rows, vocab] float32, row stride `stride` -> out: [rows], each row's argmax as torch.argmax picks it
// (the first NaN, else the first of the largest). On one thread below 2^20 logits: right after a decode step
// the worker may be asleep, and waking it cost more than it saved (64 x 4,096 inside a step: 161 us on two
// threads, 121 on one); 64 x 32,000 just after its head, 150 us on two against 241 on one.
void strata_argmax(const float* logits, int64_t rows, int64_t vocab, int64_t stride, int64_t* out) {
#pragma omp parallel for schedule(static) if (rows > 1 && rows * vocab >= (1LL << 20))
  for (int64_t r = 0; r < rows; ++r) out[r] = argmax(logits + r * stride, vocab);
}

// The penalties of a step's rows, in place (logit_edits.py): row r's repetition penalty on its
// `num_seen[r]` distinct seen tokens (int64 ids at address `seen_at[r]`), its frequency and presence
// penalties on its `num_output[r]` distinct output tokens (ids at `output_at[r]`, their float32 counts at
// `counts_at[r]`); a row without one has 0 tokens for it. `saved` receives the values replaced, row after
// row (sum of num_seen + num_output floats). With `restore`, puts those values back instead.
void strata_penalize(float* logits, int64_t rows, int64_t vocab, int64_t stride, const int64_t* seen_at,
                     const int64_t* num_seen, const float* repetition, const int64_t* output_at,
                     const int64_t* counts_at, const int64_t* num_output, const float* frequency,
                     const float* presence, float* saved, int32_t restore) {
  std::vector<int64_t> offset(rows + 1, 0);
  for (int64_t r = 0; r < rows; ++r) offset[r + 1] = offset[r] + num_seen[r] + num_output[r];
#pragma omp parallel for schedule(dynamic, 1) if (rows > 1 && offset[rows] >= (1 << 14))
  for (int64_t r = 0; r < rows; ++r) {
    const auto* seen = reinterpret_cast<const int64_t*>(seen_at[r]);
    const auto* output = reinterpret_cast<const int64_t*>(output_at[r]);
    if (restore)
      unpenalize_row(logits + r * stride, vocab, seen, num_seen[r], output, num_output[r], saved + offset[r]);
    else
      penalize_row(logits + r * stride, vocab, seen, num_seen[r], repetition[r], output,
                   reinterpret_cast<const float*>(counts_at[r]), num_output[r], frequency[r], presence[r],
                   saved + offset[r]);
  }
}

}  // extern "C"
