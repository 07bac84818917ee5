// The blocked-weight panel kernels behind linear.cpp and decode_forward.cpp (see linear.cpp for the
// layouts): header-only, in an anonymous namespace, so each kernel library gets its own copy.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "work_split.h"

#include "amx_tiles.h"
#include "isa.h"

namespace {

constexpr int64_t kPanel = 16;
constexpr int kRowsPerPass = 8;
constexpr int kPrefetchBytes = 1024;  // ahead of the current 64-byte line of the panel stream, into L1
constexpr int kStreamPrefetchBytes = 4096;  // the same for one row, into L2 (see prefetch)
constexpr int kChains = 4;          // independent sums of a one-row panel (hides the FMA latency)
constexpr int kPanelsPerGrab = 4;     // panels a thread takes at a time (contiguous, one stream to prefetch)
constexpr int kGroupPanels = 3;       // panels computed together from two rows up (panel_group_f32, _bf16)
constexpr int64_t kPassesPerRowBlock = 16;  // passes of rows a group runs against at a time (run_panel_groups)

inline float bf16_to_f32(uint16_t h) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}

// Asks for the panel stream's line some way ahead of `p`, in a kernel of MR rows. From two rows up the
// arithmetic bounds the kernel and the line comes into L1 shortly before its turn. One row is bound by
// the weight read alone: the line comes into L2 four times as far ahead, keeping more reads in flight
// (the hardware prefetchers stop at each 4 KiB page). Over the small shape's 33 bfloat16 projections
// in step order on a 2-core Zen 4 (48 MB, caches flushed between passes): 32-35 -> 40-42 GB/s, where
// a plain read of the same bytes ran at 52-54; the small shape's batch-1 decode step at a context of
// 256, four interleaved pairs: bfloat16 1.67-1.93 -> 1.47-1.73 ms, float32 3.44-3.71 -> 2.75-2.97 ms.
template <int MR>
inline void prefetch(const void* p) {
#ifdef __AVX512F__
    if constexpr (MR == 1)
        _mm_prefetch(static_cast<const char*>(p) + kStreamPrefetchBytes, _MM_HINT_T1);
    else
        _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
#else
    if constexpr (MR == 1)
        __builtin_prefetch(static_cast<const char*>(p) + kStreamPrefetchBytes, 0, 2);
    else
        __builtin_prefetch(static_cast<const char*>(p) + kPrefetchBytes);
#endif
}

#ifdef STRATA_AVX2
// A panel's 16 outputs are two 8-lane registers (lo, hi); with 16 registers a pass of rows runs in chunks
// of kAvx2Rows: 4 x 2 sums, the panel's two halves and a broadcast.
constexpr int kAvx2Rows = 4;

// acc[i0 + i][o] = sum_k x_pass[k][i0 + i] * panel[k][o] for the R rows from i0 of a pass of MR; each
// output's sum in k order, as the AVX-512 path sums it (the same bits).
template <int MR, int R>
void panel_rows_f32_avx2(const float* x_pass, const float* panel, int64_t k, float (*acc)[kPanel], int i0) {
    __m256 lo[R], hi[R];
    for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k; ++kk) {
        prefetch<MR>(panel + kk * kPanel);
        __m256 w_lo = _mm256_loadu_ps(panel + kk * kPanel), w_hi = _mm256_loadu_ps(panel + kk * kPanel + 8);
        // In registers: left alone, GCC folds the loads into every FMA, R times each, and the loop waits on
        // loads (13 per 8 FMAs). Two threads on a Zen 3, the small shape's projections: 64 rows 80 -> 110
        // GFLOPS, 32 rows 77 -> 97, alternating in one process.
        asm("" : "+x"(w_lo), "+x"(w_hi));
        for (int i = 0; i < R; ++i) {
            const __m256 xb = _mm256_set1_ps(x_pass[kk * MR + i0 + i]);
            lo[i] = _mm256_fmadd_ps(xb, w_lo, lo[i]);
            hi[i] = _mm256_fmadd_ps(xb, w_hi, hi[i]);
        }
    }
    for (int i = 0; i < R; ++i) {
        _mm256_storeu_ps(acc[i0 + i], lo[i]);
        _mm256_storeu_ps(acc[i0 + i] + 8, hi[i]);
    }
}

// As panel_rows_f32_avx2 on a bfloat16 panel ([k_pairs][16][2]) and float32 x pairs ([k_pairs][MR][2]):
// each pair's even element, then its odd one, as the AVX-512 path without AVX512_BF16 sums them.
template <int MR, int R>
void panel_rows_bf16_avx2(const float* x_pass, const uint16_t* panel, int64_t k_pairs, float (*acc)[kPanel], int i0) {
    const __m256i high_half = _mm256_set1_epi32(int32_t(0xffff0000u));
    __m256 lo[R], hi[R];
    for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
    for (int64_t kp = 0; kp < k_pairs; ++kp) {
        prefetch<MR>(panel + kp * 2 * kPanel);
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + kp * 2 * kPanel));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + kp * 2 * kPanel + kPanel));
        const __m256 lo_even = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
        const __m256 lo_odd = _mm256_castsi256_ps(_mm256_and_si256(w0, high_half));
        const __m256 hi_even = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
        const __m256 hi_odd = _mm256_castsi256_ps(_mm256_and_si256(w1, high_half));
        for (int i = 0; i < R; ++i) {
            const __m256 x_even = _mm256_set1_ps(x_pass[(kp * MR + i0 + i) * 2]);
            const __m256 x_odd = _mm256_set1_ps(x_pass[(kp * MR + i0 + i) * 2 + 1]);
            lo[i] = _mm256_fmadd_ps(x_odd, lo_odd, _mm256_fmadd_ps(x_even, lo_even, lo[i]));
            hi[i] = _mm256_fmadd_ps(x_odd, hi_odd, _mm256_fmadd_ps(x_even, hi_even, hi[i]));
        }
    }
    for (int i = 0; i < R; ++i) {
        _mm256_storeu_ps(acc[i0 + i], lo[i]);
        _mm256_storeu_ps(acc[i0 + i] + 8, hi[i]);
    }
}
#endif

// acc[i][o] = sum_k x_pass[k][i] * panel[k][o]; x_pass: [k][MR]. Used only without AVX-512, where
// panel_group_f32 falls back to it panel by panel; with AVX-512 panel_group_f32 runs every panel itself
// (one row included), each output summed in the same order.
template <int MR>
void panel_f32(const float* x_pass, const float* panel, int64_t k, float (*acc)[kPanel]) {
#if defined(STRATA_AVX2)
    if constexpr (MR == 1) {  // as the AVX-512 path: kChains sums, each in two halves
        __m256 lo[kChains], hi[kChains];
        for (int c = 0; c < kChains; ++c) lo[c] = hi[c] = _mm256_setzero_ps();
        auto step = [&](int64_t kk, int c) {
            prefetch<MR>(panel + kk * kPanel);
            const __m256 xb = _mm256_set1_ps(x_pass[kk]);
            lo[c] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(panel + kk * kPanel), lo[c]);
            hi[c] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(panel + kk * kPanel + 8), hi[c]);
        };
        int64_t kk = 0;
        for (; kk + kChains <= k; kk += kChains)
            for (int c = 0; c < kChains; ++c) step(kk + c, c);
        for (; kk < k; ++kk) step(kk, 0);
        _mm256_storeu_ps(acc[0], _mm256_add_ps(_mm256_add_ps(lo[0], lo[1]), _mm256_add_ps(lo[2], lo[3])));
        _mm256_storeu_ps(acc[0] + 8, _mm256_add_ps(_mm256_add_ps(hi[0], hi[1]), _mm256_add_ps(hi[2], hi[3])));
        return;
    }
    panel_rows_f32_avx2<MR, std::min(MR, kAvx2Rows)>(x_pass, panel, k, acc, 0);
    if constexpr (MR > kAvx2Rows) panel_rows_f32_avx2<MR, MR - kAvx2Rows>(x_pass, panel, k, acc, kAvx2Rows);
#else
    for (int i = 0; i < MR; ++i) std::fill(acc[i], acc[i] + kPanel, 0.0f);
    for (int64_t kk = 0; kk < k; ++kk) {
        prefetch<MR>(panel + kk * kPanel);
        for (int i = 0; i < MR; ++i) {
            float xv = x_pass[kk * MR + i];
            for (int o = 0; o < kPanel; ++o) acc[i][o] += xv * panel[kk * kPanel + o];
        }
    }
#endif
}

#ifdef __AVX512F__
// `lines` 64-byte lines from `at` requested into L2 evenly over a loop of `steps` steps, one per call of
// step() when its turn comes.
struct SpreadPrefetch {
    const char* at;
    int64_t lines, every, countdown;
    SpreadPrefetch(const char* at, int64_t lines, int64_t steps)
        : at(at), lines(lines), every(lines > 0 ? std::max<int64_t>(1, steps / lines) : steps + 1), countdown(every) {}
    void step() {
        if (--countdown == 0 && lines > 0) {
            _mm_prefetch(at, _MM_HINT_T1);
            at += 64;
            --lines;
            countdown = every;
        }
    }
};
#endif

// As panel_f32 for NP adjacent panels at once (each `panel_elems` after the one before), panel j's sums
// in acc[j * kRowsPerPass + i]: each broadcast of x feeds NP FMAs and NP * MR independent sums hide the
// FMA latency (8 rows x 3 panels: 11 loads per 24 FMAs, where one panel took 9 per 8). Each output's sum
// runs in the same order as panel_f32's, so the results are the same bits.
// One row is bound by the weight read, not the arithmetic: there the NP panels are NP streams of weight
// in flight at once, each with panel_f32<1>'s kChains sums (the same bits again), where one panel at a
// time was one stream, and one core reads a single stream far below its share of the bandwidth (on the
// 2-vCPU Xeon, a sum over 104 MB: 10-15 GB/s, 15-27 with three streams). The small shape's float32
// batch-1 decode step at a context of 256, the two kernels alternating in one process (12-18 rounds of
// 300 steps): two threads 2.71-3.09 -> 2.55-2.70 ms, one thread 4.66-5.96 -> 4.42-5.67 ms; the same
// tokens. bfloat16 gained nothing so (two threads 1.50-1.65 ms before, 1.47-1.84 with three streams):
// it keeps one panel at a time (run_panels_bf16).
// `ahead`: `ahead_lines` 64-byte lines that the thread reads next, requested into L2 evenly over the
// k loop, so that their trip from memory overlaps this arithmetic (run_panels_f32).
template <int MR, int NP>
void panel_group_f32(const float* x_pass, const float* panel, int64_t panel_elems, int64_t k, float (*acc)[kPanel],
                     const char* ahead = nullptr, int64_t ahead_lines = 0) {
#ifdef __AVX512F__
    if constexpr (MR == 1) {  // NP weight streams in flight, each panel's kChains sums as panel_f32<1>'s (AVX2)
        __m512 sum[NP][kChains];
        for (int j = 0; j < NP; ++j)
            for (int c = 0; c < kChains; ++c) sum[j][c] = _mm512_setzero_ps();
        SpreadPrefetch next(ahead, ahead_lines, k / kChains);
        int64_t kk = 0;
        for (; kk + kChains <= k; kk += kChains) {
            next.step();
            for (int c = 0; c < kChains; ++c) {
                const __m512 xb = _mm512_set1_ps(x_pass[kk + c]);
                for (int j = 0; j < NP; ++j) {
                    const float* w = panel + j * panel_elems + (kk + c) * kPanel;
                    prefetch<MR>(w);
                    sum[j][c] = _mm512_fmadd_ps(xb, _mm512_loadu_ps(w), sum[j][c]);
                }
            }
        }
        for (; kk < k; ++kk) {
            const __m512 xb = _mm512_set1_ps(x_pass[kk]);
            for (int j = 0; j < NP; ++j)
                sum[j][0] = _mm512_fmadd_ps(xb, _mm512_loadu_ps(panel + j * panel_elems + kk * kPanel), sum[j][0]);
        }
        for (int j = 0; j < NP; ++j)
            _mm512_storeu_ps(acc[j * kRowsPerPass],
                             _mm512_add_ps(_mm512_add_ps(sum[j][0], sum[j][1]), _mm512_add_ps(sum[j][2], sum[j][3])));
        return;
    }
    if constexpr (MR > 1) {
        __m512 sum[NP][MR];
        for (int j = 0; j < NP; ++j)
            for (int i = 0; i < MR; ++i) sum[j][i] = _mm512_setzero_ps();
        SpreadPrefetch next(ahead, ahead_lines, k);
        for (int64_t kk = 0; kk < k; ++kk) {
            next.step();
            __m512 w[NP];
            for (int j = 0; j < NP; ++j) {
                prefetch<MR>(panel + j * panel_elems + kk * kPanel);
                w[j] = _mm512_loadu_ps(panel + j * panel_elems + kk * kPanel);
            }
            for (int i = 0; i < MR; ++i) {
                const __m512 xb = _mm512_set1_ps(x_pass[kk * MR + i]);
                for (int j = 0; j < NP; ++j) sum[j][i] = _mm512_fmadd_ps(xb, w[j], sum[j][i]);
            }
        }
        for (int j = 0; j < NP; ++j)
            for (int i = 0; i < MR; ++i) _mm512_storeu_ps(acc[j * kRowsPerPass + i], sum[j][i]);
        return;
    }
#endif
    for (int j = 0; j < NP; ++j)  // no AVX-512
        panel_f32<MR>(x_pass, panel + j * panel_elems, k, acc + j * kRowsPerPass);
}

// The bfloat16 elements of x, as the kernel reads them: bf16 where the CPU multiplies bf16 pairs
// natively, float32 elsewhere.
#ifdef __AVX512BF16__
using XElement = uint16_t;
inline XElement x_element(uint16_t h) { return h; }
#else
using XElement = float;
inline XElement x_element(uint16_t h) { return bf16_to_f32(h); }
#endif

// acc[i][o] = sum_k x[i][k] * W[o][k]; x_pass: [K_pairs][MR][2], the panel: [K_pairs][16][2]
template <int MR>
void panel_bf16(const XElement* x_pass, const uint16_t* panel, int64_t k_pairs, float (*acc)[kPanel]) {
#if defined(__AVX512BF16__)
    if constexpr (MR == 1) {  // one row: kChains independent sums, not one chain of dpbf16 latencies
        __m512 sum[kChains];
        for (int c = 0; c < kChains; ++c) sum[c] = _mm512_setzero_ps();
        auto step = [&](int64_t kp, __m512& into) {
            prefetch<MR>(panel + kp * 2 * kPanel);
            int32_t pair;
            std::memcpy(&pair, x_pass + kp * 2, 4);
            into = _mm512_dpbf16_ps(into, (__m512bh)_mm512_set1_epi32(pair),
                                    (__m512bh)_mm512_loadu_si512(panel + kp * 2 * kPanel));
        };
        int64_t kp = 0;
        for (; kp + kChains <= k_pairs; kp += kChains)
            for (int c = 0; c < kChains; ++c) step(kp + c, sum[c]);
        for (; kp < k_pairs; ++kp) step(kp, sum[0]);
        _mm512_storeu_ps(acc[0], _mm512_add_ps(_mm512_add_ps(sum[0], sum[1]), _mm512_add_ps(sum[2], sum[3])));
        return;
    }
    __m512 sum[MR];
    for (int i = 0; i < MR; ++i) sum[i] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < k_pairs; ++kp) {
        prefetch<MR>(panel + kp * 2 * kPanel);
        __m512bh w = (__m512bh)_mm512_loadu_si512(panel + kp * 2 * kPanel);
        for (int i = 0; i < MR; ++i) {
            int32_t pair;
            std::memcpy(&pair, x_pass + (kp * MR + i) * 2, 4);
            sum[i] = _mm512_dpbf16_ps(sum[i], (__m512bh)_mm512_set1_epi32(pair), w);
        }
    }
    for (int i = 0; i < MR; ++i) _mm512_storeu_ps(acc[i], sum[i]);
#elif defined(__AVX512F__)
    __m512 sum[MR];
    for (int i = 0; i < MR; ++i) sum[i] = _mm512_setzero_ps();
    const __m512i high_half = _mm512_set1_epi32(int32_t(0xffff0000u));
    for (int64_t kp = 0; kp < k_pairs; ++kp) {
        prefetch<MR>(panel + kp * 2 * kPanel);
        __m512i w = _mm512_loadu_si512(panel + kp * 2 * kPanel);
        __m512 w_even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        __m512 w_odd = _mm512_castsi512_ps(_mm512_and_si512(w, high_half));
        for (int i = 0; i < MR; ++i) {
            sum[i] = _mm512_fmadd_ps(_mm512_set1_ps(x_pass[(kp * MR + i) * 2]), w_even, sum[i]);
            sum[i] = _mm512_fmadd_ps(_mm512_set1_ps(x_pass[(kp * MR + i) * 2 + 1]), w_odd, sum[i]);
        }
    }
    for (int i = 0; i < MR; ++i) _mm512_storeu_ps(acc[i], sum[i]);
#elif defined(STRATA_AVX2)
    panel_rows_bf16_avx2<MR, std::min(MR, kAvx2Rows)>(x_pass, panel, k_pairs, acc, 0);
    if constexpr (MR > kAvx2Rows) panel_rows_bf16_avx2<MR, MR - kAvx2Rows>(x_pass, panel, k_pairs, acc, kAvx2Rows);
#else
    for (int i = 0; i < MR; ++i) std::fill(acc[i], acc[i] + kPanel, 0.0f);
    for (int64_t kp = 0; kp < k_pairs; ++kp) {
        const uint16_t* w = panel + kp * 2 * kPanel;
        prefetch<MR>(w);
        for (int i = 0; i < MR; ++i) {
            float x_even = x_pass[(kp * MR + i) * 2], x_odd = x_pass[(kp * MR + i) * 2 + 1];
            for (int o = 0; o < kPanel; ++o)
                acc[i][o] += x_even * bf16_to_f32(w[2 * o]) + x_odd * bf16_to_f32(w[2 * o + 1]);
        }
    }
#endif
}

// As panel_bf16 for NP adjacent panels at once, as panel_group_f32 does for float32: each broadcast x
// pair feeds NP dpbf16s instead of one (one panel at a time, the broadcasts bound the loop: 64 rows of
// the small shape ran at ~250 GFLOP/s on a 2-core Zen 4 where float32's groups ran at ~168). Each
// output's sum runs in panel_bf16's order: the same bits.
template <int MR, int NP>
void panel_group_bf16(const XElement* x_pass, const uint16_t* panel, int64_t panel_elems, int64_t k_pairs,
                      float (*acc)[kPanel], const char* ahead = nullptr, int64_t ahead_lines = 0) {
#if defined(__AVX512BF16__)
    if constexpr (MR > 1) {
        __m512 sum[NP][MR];
        for (int j = 0; j < NP; ++j)
            for (int i = 0; i < MR; ++i) sum[j][i] = _mm512_setzero_ps();
        SpreadPrefetch next(ahead, ahead_lines, k_pairs);
        for (int64_t kp = 0; kp < k_pairs; ++kp) {
            next.step();
            __m512bh w[NP];
            for (int j = 0; j < NP; ++j) {
                prefetch<MR>(panel + j * panel_elems + kp * 2 * kPanel);
                w[j] = (__m512bh)_mm512_loadu_si512(panel + j * panel_elems + kp * 2 * kPanel);
            }
            for (int i = 0; i < MR; ++i) {
                int32_t pair;
                std::memcpy(&pair, x_pass + (kp * MR + i) * 2, 4);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                for (int j = 0; j < NP; ++j) sum[j][i] = _mm512_dpbf16_ps(sum[j][i], xb, w[j]);
            }
        }
        for (int j = 0; j < NP; ++j)
            for (int i = 0; i < MR; ++i) _mm512_storeu_ps(acc[j * kRowsPerPass + i], sum[j][i]);
        return;
    }
#endif
    (void)ahead, (void)ahead_lines;
    for (int j = 0; j < NP; ++j) panel_bf16<MR>(x_pass, panel + j * panel_elems, k_pairs, acc + j * kRowsPerPass);
}

// ---- int8 weights (weight-only quantization) ----
//
// With `--quantization int8` (or a checkpoint's own int8 rows) a projection keeps its weight as int8 in
// bfloat16's blocked layout ([panels][K pairs][16][2], each weight its integer q, -128..127) beside a
// float32 scale per output: y[o] = scale[o] * sum_k x[k] q[o][k], the sums' scale applied by the caller. A
// few rows read half the bytes of bfloat16's, and turning each weight into bfloat16 (three conversions per
// 32 weights) would cost more than the read: measured on the 2-vCPU Xeon, one row over a
// Qwen2.5-0.5B-shaped model's projections, 15.5 GB/s of int8 against 22.7 of bfloat16, 1.36x bfloat16's
// speed where the bytes allow 2x. So the weights stay integers, widened to int16 (one instruction per 32),
// and x comes to them as int16 too: each block of 32 elements of a row scaled by a power of two that puts
// its largest magnitude just under 2^15. A bfloat16 value has 8 significant bits, so every element within
// 2^7 of its block's largest converts exactly, and a smaller one is rounded at 2^-15 of that largest
// (below the bfloat16 rounding of the output). A block's products sum exactly in int32
// (_mm512_dpwssd_epi32), and the block's sum times its scale joins the float32 total. The same
// projections: 1.73-1.81x bfloat16's.
//
// Past one pass of rows (kAmxMinRowsI8), on AMX, run_panels_amx turns each panel into bfloat16 once for
// all the rows instead (i8_to_bf16), exactly.

constexpr int64_t kXBlockPairs = 16;                   // K pairs of x per scale (32 elements)
constexpr int64_t kXBlockWords = 2 * kXBlockPairs + 2;  // int16 per row of a block: its pairs, its float scale

// x for panel_i8, pass by pass as the other kernels' x, each pass of `rows` rows cut into blocks of
// kXBlockPairs K pairs: [block][K pair][row][2] int16, then the block's [row] float32 scales. A row's
// share of a pass: blocks * kXBlockWords int16 (x_i8_row_stride).
inline int64_t x_i8_row_stride(int64_t k) { return (k + 2 * kXBlockPairs - 1) / (2 * kXBlockPairs) * kXBlockWords; }

// Packs pass `pass_index` of bfloat16 x [m, k] (rows x_stride apart) for panel_i8 (see above).
inline void pack_x_i8_pass(int16_t* packed, const uint16_t* x, int64_t m, int64_t x_stride, int64_t k,
                           int64_t pass_index) {
    const int64_t r0 = pass_index * kRowsPerPass, rows = std::min<int64_t>(kRowsPerPass, m - r0);
    const int64_t block_elems = 2 * kXBlockPairs, blocks = x_i8_row_stride(k) / kXBlockWords;
    int16_t* pass = packed + r0 * x_i8_row_stride(k);
    for (int64_t b = 0; b < blocks; ++b) {
        int16_t* block = pass + b * kXBlockWords * rows;
        float* scales = reinterpret_cast<float*>(block + block_elems * rows);
        const int64_t first = b * block_elems, count = std::min(block_elems, k - first);
        for (int64_t i = 0; i < rows; ++i) {
            const uint16_t* from = x + (r0 + i) * x_stride + first;
#ifdef STRATA_AVX512
            // the block as two vectors of 16 float32 (zeros past k), and its largest biased exponent
            const __mmask32 valid = count >= 32 ? __mmask32(~0u) : __mmask32((1u << count) - 1);
            const __m512i bits = _mm512_maskz_loadu_epi16(valid, from);
            const __m512i exponents = _mm512_and_si512(bits, _mm512_set1_epi16(0x7f80));
            const __m512i widest = _mm512_max_epu16(_mm512_unpacklo_epi16(exponents, _mm512_setzero_si512()),
                                                    _mm512_unpackhi_epi16(exponents, _mm512_setzero_si512()));
            const int largest = _mm512_reduce_max_epi32(widest) >> 7;
#else
            int largest = 0;  // the block's largest biased exponent
            for (int64_t j = 0; j < count; ++j) largest = std::max(largest, (from[j] >> 7) & 0xff);
#endif
            // x * 2^shift has its largest magnitude under 2^15 (a biased exponent E: under 2^(E - 126)).
            // A block of magnitudes under 2^-113 (or subnormal) counts as zeros; one holding an inf or a
            // NaN gets a NaN scale, which its outputs then show.
            const int shift = 141 - largest;
            const bool zeros = largest < 14, special = largest == 0xff;
            scales[i] = special ? NAN : zeros ? 0.0f : std::ldexp(1.0f, -shift);
            if (zeros || special) {
                for (int64_t j = 0; j < kXBlockPairs; ++j) std::memset(block + (j * rows + i) * 2, 0, 4);
                continue;
            }
            const float up = std::ldexp(1.0f, shift);
#ifdef STRATA_AVX512
            // as int16, rounded to nearest even (exact within 2^7 of the largest)
            alignas(64) int16_t row[2 * kXBlockPairs];
            const __m512 factor = _mm512_set1_ps(up);
            for (int half = 0; half < 2; ++half) {
                const __m256i h = half ? _mm512_extracti64x4_epi64(bits, 1) : _mm512_castsi512_si256(bits);
                const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                _mm256_store_si256(reinterpret_cast<__m256i*>(row + 16 * half),
                                   _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v, factor))));
            }
            if (rows == 1) {
                std::memcpy(block, row, sizeof(row));
                continue;
            }
            for (int64_t j = 0; j < kXBlockPairs; ++j) std::memcpy(block + (j * rows + i) * 2, row + 2 * j, 4);
#else
            for (int64_t j = 0; j < block_elems; ++j)
                block[((j / 2) * rows + i) * 2 + j % 2] =
                    j < count ? int16_t(std::nearbyint(bf16_to_f32(from[j]) * up)) : int16_t(0);
#endif
        }
    }
}

// acc[i][o] = sum_k x[i][k] * q[o][k] over an int8 panel, x from pack_x_i8_pass (each block's int32
// sums times its scale).
template <int MR>
void panel_i8(const int16_t* x_pass, const int8_t* panel, int64_t k_pairs, float (*acc)[kPanel]) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    constexpr int chains = MR == 1 ? kChains : 1;  // one row: independent sums, not one chain of latencies
    __m512 total[MR];
    for (int i = 0; i < MR; ++i) total[i] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < k_pairs; b0 += kXBlockPairs) {
        const int16_t* block = x_pass + b0 / kXBlockPairs * kXBlockWords * MR;
        const float* scales = reinterpret_cast<const float*>(block + 2 * kXBlockPairs * MR);
        const int64_t pairs = std::min(kXBlockPairs, k_pairs - b0);
        __m512i sum[chains][MR];
        for (int c = 0; c < chains; ++c)
            for (int i = 0; i < MR; ++i) sum[c][i] = _mm512_setzero_si512();
        for (int64_t j = 0; j < pairs; ++j) {
            const int8_t* w8 = panel + (b0 + j) * 2 * kPanel;
            prefetch<MR>(w8);
            const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w8)));
            for (int i = 0; i < MR; ++i) {
                int32_t pair;
                std::memcpy(&pair, block + (j * MR + i) * 2, 4);
                sum[j % chains][i] = _mm512_dpwssd_epi32(sum[j % chains][i], _mm512_set1_epi32(pair), w);
            }
        }
        for (int i = 0; i < MR; ++i) {
            __m512i block_sum = sum[0][i];
            for (int c = 1; c < chains; ++c) block_sum = _mm512_add_epi32(block_sum, sum[c][i]);
            total[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block_sum), _mm512_set1_ps(scales[i]), total[i]);
        }
    }
    for (int i = 0; i < MR; ++i) _mm512_storeu_ps(acc[i], total[i]);
#else
    for (int i = 0; i < MR; ++i) std::fill(acc[i], acc[i] + kPanel, 0.0f);
    for (int64_t b0 = 0; b0 < k_pairs; b0 += kXBlockPairs) {
        const int16_t* block = x_pass + b0 / kXBlockPairs * kXBlockWords * MR;
        const float* scales = reinterpret_cast<const float*>(block + 2 * kXBlockPairs * MR);
        const int64_t pairs = std::min(kXBlockPairs, k_pairs - b0);
        int32_t sum[MR][kPanel] = {};
        for (int64_t j = 0; j < pairs; ++j) {
            const int8_t* w = panel + (b0 + j) * 2 * kPanel;
            prefetch<MR>(w);
            for (int i = 0; i < MR; ++i) {
                const int32_t x_even = block[(j * MR + i) * 2], x_odd = block[(j * MR + i) * 2 + 1];
                for (int o = 0; o < kPanel; ++o) sum[i][o] += x_even * w[2 * o] + x_odd * w[2 * o + 1];
            }
        }
        for (int i = 0; i < MR; ++i)
            for (int o = 0; o < kPanel; ++o) acc[i][o] += float(sum[i][o]) * scales[i];
    }
#endif
}

#if defined(__AVX512BF16__)
// `count` int8 weights (a multiple of 32) as bfloat16, into `to`, for the AMX tiles (every CPU with them
// has AVX512_BF16). Each 32, a panel's K pair of 16 outputs x 2, keeps its order. The weights stream
// from memory: each line is asked for a few KB ahead, into L2 (see prefetch).
inline void i8_to_bf16(const int8_t* from, int64_t count, uint16_t* to) {
    for (int64_t i = 0; i < count; i += 32) {
        if (i % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(from + i) + kStreamPrefetchBytes, _MM_HINT_T1);
        const __m128i* w = reinterpret_cast<const __m128i*>(from + i);
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(w)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(w + 1)));
        _mm512_storeu_si512(to + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}
#endif

// Runs `panel_kernel<MR>` for a pass of `rows` (1..kRowsPerPass) rows.
template <template <int> class PanelKernel, typename... Args>
void dispatch_rows(int rows, Args... args) {
    switch (rows) {
        case 1: PanelKernel<1>::run(args...); break;
        case 2: PanelKernel<2>::run(args...); break;
        case 3: PanelKernel<3>::run(args...); break;
        case 4: PanelKernel<4>::run(args...); break;
        case 5: PanelKernel<5>::run(args...); break;
        case 6: PanelKernel<6>::run(args...); break;
        case 7: PanelKernel<7>::run(args...); break;
        default: PanelKernel<8>::run(args...); break;
    }
}

template <int NP>
struct PanelGroupF32 {
    template <int MR>
    struct Rows {
        static void run(const float* x_pass, const float* panel, int64_t panel_elems, int64_t k, float (*acc)[kPanel],
                        const char* ahead, int64_t ahead_lines) {
            panel_group_f32<MR, NP>(x_pass, panel, panel_elems, k, acc, ahead, ahead_lines);
        }
    };
};

template <int MR>
struct PanelBF16 {
    static void run(const XElement* x_pass, const uint16_t* panel, int64_t k_pairs, float (*acc)[kPanel]) {
        panel_bf16<MR>(x_pass, panel, k_pairs, acc);
    }
};

template <int NP>
struct PanelGroupBF16 {
    template <int MR>
    struct Rows {
        static void run(const XElement* x_pass, const uint16_t* panel, int64_t panel_elems, int64_t k_pairs,
                        float (*acc)[kPanel], const char* ahead, int64_t ahead_lines) {
            panel_group_bf16<MR, NP>(x_pass, panel, panel_elems, k_pairs, acc, ahead, ahead_lines);
        }
    };
};

template <int MR>
struct PanelI8 {
    static void run(const int16_t* x_pass, const int8_t* panel, int64_t k_pairs, float (*acc)[kPanel]) {
        panel_i8<MR>(x_pass, panel, k_pairs, acc);
    }
};

inline int64_t passes_of(int64_t m) { return (m + kRowsPerPass - 1) / kRowsPerPass; }

#ifdef __AVX512F__
// out[s * 8 + i] = the s-th 32-bit word of row i, for 8 rows (`row_bytes` apart from `rows`) and their
// first `steps` words (a multiple of 16): 16 words of the 8 rows at a time, transposed in registers.
inline void transpose_rows8(uint32_t* out, const void* rows, int64_t row_bytes, int64_t steps) {
    const char* base = static_cast<const char*>(rows);
    const __m512i first_lanes = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);  // lanes 0, 1 of a, then of b
    const __m512i last_lanes = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);  // lanes 2, 3
    for (int64_t s0 = 0; s0 < steps; s0 += 16) {
        __m512i r[8], t[8], u[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm512_loadu_si512(base + i * row_bytes + s0 * 4);
        for (int i = 0; i < 4; ++i) {  // rows 2i and 2i + 1 interleaved word by word, within each 128-bit lane
            t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        for (int h = 0; h < 2; ++h)  // u[4h + c], lane L: word 4L + c of rows 4h .. 4h + 3
            for (int c = 0; c < 2; ++c) {
                u[4 * h + 2 * c] = _mm512_unpacklo_epi64(t[4 * h + c], t[4 * h + 2 + c]);
                u[4 * h + 2 * c + 1] = _mm512_unpackhi_epi64(t[4 * h + c], t[4 * h + 2 + c]);
            }
        for (int c = 0; c < 4; ++c) {  // word 4L + c of the 8 rows: lane L of u[c], then of u[4 + c]
            const __m512i lanes01 = _mm512_permutex2var_epi64(u[c], first_lanes, u[4 + c]);
            const __m512i lanes23 = _mm512_permutex2var_epi64(u[c], last_lanes, u[4 + c]);
            uint32_t* o = out + (s0 + c) * 8;
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_castsi512_si256(lanes01));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32), _mm512_extracti64x4_epi64(lanes01, 1));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 64), _mm512_castsi512_si256(lanes23));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 96), _mm512_extracti64x4_epi64(lanes23, 1));
        }
    }
}
#endif

// x [m, k] (row stride x_stride) packed for the panel kernels: pass p holds rows p*R .. p*R + rows - 1
// (R = kRowsPerPass) as [k_steps][rows][group], `group` consecutive elements of K per step (1 for
// float32, a pair for bfloat16), zero-padded past k.
// `packed` holds m * k_steps * group elements. pack_x_pass packs pass `pass_index` alone (the passes of
// the decode step's projections are packed by its threads together). Where the elements stay as they
// are (XT == From, whose `convert` is then the identity) and a step is a 32-bit word, a whole pass is
// transposed in registers (transpose_rows8): element by element, the packing took ~13% of a 64-row
// bfloat16 projection of the small shape (512 x 512 and 512 x 1376, one thread of a Zen 4; 191-194 ->
// 216-220 GFLOP/s, two threads 340-346 -> 374-375).
template <typename XT, typename From, typename Convert>
void pack_x_pass(XT* packed, const From* x, int64_t m, int64_t x_stride, int64_t k, int64_t k_steps, int group,
                 Convert convert, int64_t pass_index) {
    const int64_t r0 = pass_index * kRowsPerPass;
    const int64_t rows = std::min<int64_t>(kRowsPerPass, m - r0);
    XT* pass = packed + r0 * k_steps * group;
#ifdef __AVX512F__
    if constexpr (std::is_same_v<XT, From>) {
        if (rows == kRowsPerPass && int64_t(sizeof(XT)) * group == 4) {  // float32, or bfloat16 pairs kept
            const int64_t words = k / group / 16 * 16;  // whole K steps of every row, 16 at a time
            transpose_rows8(reinterpret_cast<uint32_t*>(pass), x + r0 * x_stride, x_stride * int64_t(sizeof(XT)), words);
            for (int64_t i = 0; i < rows; ++i)
                for (int64_t kk = words * group; kk < k_steps * group; ++kk)
                    pass[((kk / group) * rows + i) * group + kk % group] =
                        kk < k ? convert(x[(r0 + i) * x_stride + kk]) : convert(From(0));
            return;
        }
    }
#endif
    std::fill(pass, pass + rows * k_steps * group, convert(From(0)));
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t kk = 0; kk < k; ++kk)
            pass[((kk / group) * rows + i) * group + kk % group] = convert(x[(r0 + i) * x_stride + kk]);
}

// pack_x_pass for every pass of x into `packed` (m * k_steps * group elements, every one written), as one
// phase of `split`, shared by the threads of the enclosing parallel region.
template <typename XT, typename From, typename Convert, typename Split>
void pack_x(XT* packed, const From* x, int64_t m, int64_t x_stride, int64_t k, int64_t k_steps, int group,
            Convert convert, Split& split) {
    split.items(passes_of(m), 1, [&](int64_t p) { pack_x_pass(packed, x, m, x_stride, k, k_steps, group, convert, p); });
}

// Whether the threads pack x together, in their region: from a few passes up. Fewer are packed before it
// by the caller alone, since a phase costs the threads more than a pass or two takes. Over the small
// shape's four projections (bfloat16, two threads of a Zen 4, both builds called in turn in one
// process), packing in the region into an unzeroed buffer, with the row blocks of run_panel_groups, ran
// 1.02x the GFLOP/s of packing before it into a zeroed one at 128 rows and 1.04-1.05x from 256 to 2048
// rows (the row blocks alone 1.025x; float32 0.98-1.01x). Packed in the region at 1 and 8 rows too, it
// ran 0.94x and 0.99x: hence the threshold.
inline bool packs_x_together(int64_t m) { return passes_of(m) >= 3; }

// For every panel (split over the threads of the enclosing parallel region by `split`, work_split.h;
// serial outside one) and every pass of rows: accumulate, then hand each row's accumulators and the
// panel's first output column to `store(row, first_out, acc_row, num_outs)`. Threads take runs of
// kPanelsPerGrab panels as they come free rather than a fixed share: when another process takes one
// thread's core for a while, the others do its panels.
template <template <int> class PanelKernel, typename XT, typename WT, typename Store, typename Split>
void run_panels(const XT* x_packed, int64_t m, int64_t x_pass_stride, const WT* blocked, int64_t panel_elems,
                int64_t k_steps, int64_t n, Store store, Split& split) {
    const int64_t num_panels = (n + kPanel - 1) / kPanel;
    // (int8 panels are half as long as bfloat16's: twice as many make a run as long)
    split.items(num_panels, sizeof(WT) == 1 ? 2 * kPanelsPerGrab : kPanelsPerGrab, [&](int64_t p) {
        alignas(64) float acc[kRowsPerPass][kPanel];
        const int64_t first_out = p * kPanel;
        const int num_outs = int(std::min<int64_t>(kPanel, n - first_out));
        for (int64_t r0 = 0; r0 < m; r0 += kRowsPerPass) {
            const int rows = int(std::min<int64_t>(kRowsPerPass, m - r0));
            dispatch_rows<PanelKernel>(rows, x_packed + r0 * x_pass_stride, blocked + p * panel_elems, k_steps, acc);
            for (int i = 0; i < rows; ++i) store(r0 + i, first_out, acc[i], num_outs);
        }
    });
}

// run_panels for float32, kGroupPanels panels at a time (panel_group_f32; the last group takes what is
// left).
// While a group computes, the group the thread takes next (ProgressSplit::items_ahead) streams into L2:
// otherwise each group's first pass of rows waits on memory and the other passes leave it idle. Over
// the small shape's 32 float32 matrices, two threads, 9-64 rows: 10-15% more GFLOP/s, the same bits
// (64 rows 224-252 -> 247-266, 16 rows 198-205 -> 228-235, alternating in one process). Three panels
// (24 sums in registers) where there were two (16): 64 rows over the small shape's five projection
// shapes 313-317 -> 329-348 GFLOP/s (oneDNN's prepacked weights 332-351 in the same runs), 24 rows
// 292-294 -> 303-328; a 64-row float32 decode step of the small shape 14.0 -> 13.5-13.7 ms at a context
// of 16, 31.4-31.7 -> 29.2-30.3 ms at 400.
//
// Beyond kPassesPerRowBlock passes, an item is a group against a block of that many passes, the items
// of a block in turn, so that the block's rows stay in L2 while the groups stream past them: otherwise
// every group reads all of x again from L3 (from 256 rows, bfloat16: 1.025x the GFLOP/s).
//
// run_panel_groups is that loop for either dtype: PanelGroup<NP>::Rows<MR> the group kernel, `k` the
// kernels' K steps (elements for float32, pairs for bfloat16).
template <template <int> class PanelGroup, typename XT, typename WT, typename Store, typename Split>
void run_panel_groups(const XT* x_packed, int64_t m, int64_t x_pass_stride, const WT* blocked, int64_t panel_elems,
                      int64_t k, int64_t n, Store store, Split& split) {
    const int64_t num_panels = (n + kPanel - 1) / kPanel;
    const int64_t num_groups = (num_panels + kGroupPanels - 1) / kGroupPanels;
    const int64_t passes = passes_of(m);
    const int64_t block_passes = std::max<int64_t>(1, std::min(passes, kPassesPerRowBlock));  // 1 for no rows
    const int64_t row_blocks = (passes + block_passes - 1) / block_passes;
    // Item i: the group i % num_groups against the row block i / num_groups.
    split.items_ahead(row_blocks * num_groups, 1, [&](int64_t item, int64_t next_item) {
        alignas(64) float acc[kGroupPanels * kRowsPerPass][kPanel];
        const int64_t group = item % num_groups, next_group = next_item >= 0 ? next_item % num_groups : -1;
        const int64_t first_pass = item / num_groups * block_passes;
        const int64_t last_pass = std::min(passes, first_pass + block_passes);
        const int64_t first_panel = kGroupPanels * group;
        const int panels = int(std::min<int64_t>(kGroupPanels, num_panels - first_panel));
        const WT* panel = blocked + first_panel * panel_elems;
        // The group this thread takes next streams into L2 while this one computes, a share per pass.
        const int64_t next_first = kGroupPanels * next_group;
        const int64_t next_panels = next_group >= 0 ? std::min<int64_t>(kGroupPanels, num_panels - next_first) : 0;
        const int64_t next_lines = next_panels * panel_elems * int64_t(sizeof(WT)) / 64;
        const char* next = next_group >= 0 ? reinterpret_cast<const char*>(blocked + next_first * panel_elems) : nullptr;
        const int64_t item_passes = last_pass - first_pass;
        for (int64_t pass = first_pass; pass < last_pass; ++pass) {
            const int64_t r0 = pass * kRowsPerPass, nth = pass - first_pass;
            const int rows = int(std::min<int64_t>(kRowsPerPass, m - r0));
            const XT* x_pass = x_packed + r0 * x_pass_stride;
            const char* ahead = next + next_lines * nth / item_passes * 64;
            const int64_t lines = next_lines * (nth + 1) / item_passes - next_lines * nth / item_passes;
            if (panels == 3)
                dispatch_rows<PanelGroup<3>::template Rows>(rows, x_pass, panel, panel_elems, k, acc, ahead, lines);
            else if (panels == 2)
                dispatch_rows<PanelGroup<2>::template Rows>(rows, x_pass, panel, panel_elems, k, acc, ahead, lines);
            else
                dispatch_rows<PanelGroup<1>::template Rows>(rows, x_pass, panel, panel_elems, k, acc, ahead, lines);
            for (int j = 0; j < panels; ++j) {
                const int64_t first_out = (first_panel + j) * kPanel;
                const int num_outs = int(std::min<int64_t>(kPanel, n - first_out));
                for (int i = 0; i < rows; ++i) store(r0 + i, first_out, acc[j * kRowsPerPass + i], num_outs);
            }
        }
    });
}

template <typename Store, typename Split>
void run_panels_f32(const float* x_packed, int64_t m, int64_t x_pass_stride, const float* blocked,
                    int64_t panel_elems, int64_t k, int64_t n, Store store, Split& split) {
    run_panel_groups<PanelGroupF32>(x_packed, m, x_pass_stride, blocked, panel_elems, k, n, store, split);
}

// bfloat16 in groups of panels from two rows up where the CPU multiplies bf16 pairs (panel_group_bf16);
// elsewhere, and for one row (see panel_group_f32), one panel at a time (the AVX-512F and AVX2 paths
// convert each pair to float32).
template <typename Store, typename Split>
void run_panels_bf16(const XElement* x_packed, int64_t m, int64_t x_pass_stride, const uint16_t* blocked,
                     int64_t panel_elems, int64_t k_pairs, int64_t n, Store store, Split& split) {
#if defined(__AVX512BF16__)
    if (m > 1) {
        run_panel_groups<PanelGroupBF16>(x_packed, m, x_pass_stride, blocked, panel_elems, k_pairs, n, store, split);
        return;
    }
#endif
    run_panels<PanelBF16>(x_packed, m, x_pass_stride, blocked, panel_elems, k_pairs, n, store, split);
}

// ---- bfloat16 on AMX tiles ----
//
// From a few rows up, a bfloat16 projection is bound by arithmetic, not by its weight read: at 64 rows
// _mm512_dpbf16_ps runs no faster than float32 FMAs on a core with two FMA units. Where the CPU has AMX
// (and Linux grants the process its tile state), the rows go through the matrix unit instead, which
// multiplies a 16 x 32 tile of x by a 32 x 16 tile of W in one instruction. The blocked weight needs no
// other layout: 16 consecutive K pairs of a panel, [16][16][2], are exactly the B operand of TDPBF16PS
// (K pairs as rows, each row 16 outputs x 2). x is read as it lies, 16 rows x 32 elements per A tile.
//
// Tiles: 0-3 accumulate (float32) up to four tiles of 16 rows against one panel, so the panel's weight
// streams in once for 64 rows; 4 holds the panel's K chunk; 5 and 6 take turns holding x.

constexpr int64_t kTileRows = 16;       // rows of x per A and C tile
constexpr int64_t kTileKPairs = 16;     // K pairs per tile: 32 bfloat16, one 64-byte row
constexpr int kMaxRowTiles = 4;         // C tiles held at once
constexpr int64_t kAmxMinRows = 5;      // fewer rows stream the weight as fast on _mm512_dpbf16_ps
// int8 weights up to one pass of rows (8) run panel_i8, which widens each weight once for the pass: over
// a Qwen2.5-0.5B-shaped model's projections (2-vCPU Xeon), 5 and 8 rows 1.60x and 1.49x bfloat16's speed
// there against 1.08x and 1.24x on the tiles; from 12 rows (two passes) the tiles are as fast or faster.
constexpr int64_t kAmxMinRowsI8 = kRowsPerPass + 1;
// Panels a thread takes at a time on AMX: twice run_panels' 4, fewer claims and longer runs of weight in
// a row. Over the small shape's 33 bfloat16 matrices (55 MB, two threads, alternating in one session):
// 32 rows 1.86-1.96 -> 1.70-1.77 ms, 64 rows 3.05 -> 2.89-2.93 ms, 8 rows unchanged (1.55-1.64 ms).
constexpr int kAmxPanelsPerGrab = 8;
constexpr int64_t kI8BlockTiles = 32;  // row tiles of x per pass over an int8 run (run_panels_amx)

#ifdef STRATA_AMX
constexpr int64_t kAmxPrefetchBytes = 2048;  // two tiles of the panel ahead

// acc[t * 16 + i][o] = sum_k a[t][i][k] W[o][k] for RowTiles tiles of 16 rows (a[t]: 16 rows, each
// 2 * k_pairs bfloat16, stride a_stride[t] bytes) against one blocked panel of k_pairs pairs.
template <int RowTiles>
void panel_amx(const uint16_t* const* a, const int64_t* a_stride, const uint16_t* panel, int64_t k_pairs,
               float (*acc)[kPanel]) {
    _tile_zero(0);
    if constexpr (RowTiles > 1) _tile_zero(1);
    if constexpr (RowTiles > 2) _tile_zero(2);
    if constexpr (RowTiles > 3) _tile_zero(3);
    for (int64_t kp = 0; kp < k_pairs; kp += kTileKPairs) {
        // The weight streams from memory (read once for all the rows): ask for it a few tiles ahead,
        // past the panel's end into the next one of the run the thread takes.
        const char* ahead = reinterpret_cast<const char*>(panel + kp * 2 * kPanel) + kAmxPrefetchBytes;
        for (int line = 0; line < 16; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
        _tile_loadd(4, panel + kp * 2 * kPanel, 64);
        _tile_loadd(5, a[0] + kp * 2, a_stride[0]);
        if constexpr (RowTiles > 1) _tile_loadd(6, a[1] + kp * 2, a_stride[1]);
        _tile_dpbf16ps(0, 5, 4);
        if constexpr (RowTiles > 1) _tile_dpbf16ps(1, 6, 4);
        if constexpr (RowTiles > 2) {
            _tile_loadd(5, a[2] + kp * 2, a_stride[2]);
            if constexpr (RowTiles > 3) _tile_loadd(6, a[3] + kp * 2, a_stride[3]);
            _tile_dpbf16ps(2, 5, 4);
            if constexpr (RowTiles > 3) _tile_dpbf16ps(3, 6, 4);
        }
    }
    _tile_stored(0, acc[0], 64);
    if constexpr (RowTiles > 1) _tile_stored(1, acc[kTileRows], 64);
    if constexpr (RowTiles > 2) _tile_stored(2, acc[2 * kTileRows], 64);
    if constexpr (RowTiles > 3) _tile_stored(3, acc[3 * kTileRows], 64);
}

// Past 64 rows, two row tiles against two panels at a time (tiles 0-3 accumulate, 4-5 hold x, 6-7 the
// panels): each tile loaded feeds two products, where panel_amx's four row tiles take five loads for four.
// acc[(p * RowTiles + t) * 16 + i][o]: panel p's outputs of row i of tile t.
template <int RowTiles, int Panels>
void panels_amx(const uint16_t* const* a, const int64_t* a_stride, const uint16_t* const* panel, int64_t k_pairs,
                float (*acc)[kPanel]) {
    _tile_zero(0);
    if constexpr (Panels > 1) _tile_zero(1);
    if constexpr (RowTiles > 1) _tile_zero(2);
    if constexpr (RowTiles > 1 && Panels > 1) _tile_zero(3);
    for (int64_t kp = 0; kp < k_pairs; kp += kTileKPairs) {
        _tile_loadd(6, panel[0] + kp * 2 * kPanel, 64);
        if constexpr (Panels > 1) _tile_loadd(7, panel[1] + kp * 2 * kPanel, 64);
        _tile_loadd(4, a[0] + kp * 2, a_stride[0]);
        if constexpr (RowTiles > 1) _tile_loadd(5, a[1] + kp * 2, a_stride[1]);
        _tile_dpbf16ps(0, 4, 6);
        if constexpr (Panels > 1) _tile_dpbf16ps(1, 4, 7);
        if constexpr (RowTiles > 1) _tile_dpbf16ps(2, 5, 6);
        if constexpr (RowTiles > 1 && Panels > 1) _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, acc[0], 64);
    if constexpr (Panels > 1) _tile_stored(1, acc[RowTiles * kTileRows], 64);
    if constexpr (RowTiles > 1) _tile_stored(2, acc[kTileRows], 64);
    if constexpr (RowTiles > 1 && Panels > 1) _tile_stored(3, acc[3 * kTileRows], 64);
}
#endif

// Whether run_panels_amx serves m rows of x against a K of k: AMX here and granted, enough rows (at least
// `min_rows`: kAmxMinRows for bfloat16 weights, kAmxMinRowsI8 for int8), and K in whole tiles (every
// hidden and intermediate size of the Llama family is a multiple of 32).
inline bool amx_serves(int64_t m, int64_t k, int64_t min_rows = kAmxMinRows) {
#ifdef STRATA_AMX
    return m >= min_rows && k % (2 * kTileKPairs) == 0 && amx_granted();
#else
    (void)m, (void)k, (void)min_rows;
    return false;
#endif
}

// As run_panels for bfloat16, on AMX (only where amx_serves): x [m, 2 * k_pairs] as it lies, rows
// x_stride elements apart. `scratch` holds 16 * 2 * k_pairs elements: the last, partial tile of rows,
// zero-padded, since a tile load reads 16 rows. The weight is bfloat16 (WT uint16_t) or int8 (the
// int8 kernels' layout and sums: each pair of panels turned into bfloat16 once, into a buffer of the
// thread's, then every row against it).
template <typename WT, typename Store, typename Split>
void run_panels_amx(const uint16_t* x, int64_t m, int64_t x_stride, const WT* blocked, int64_t panel_elems,
                    int64_t k_pairs, int64_t n, uint16_t* scratch, Store store, Split& split) {
#ifdef STRATA_AMX
    const int64_t k = 2 * k_pairs, full_tiles = m / kTileRows, tail_rows = m % kTileRows;
    const int64_t row_tiles = full_tiles + (tail_rows > 0);
    if (tail_rows) {
        split.once([&] {
            std::fill(scratch, scratch + kTileRows * k, uint16_t(0));
            for (int64_t i = 0; i < tail_rows; ++i)
                std::memcpy(scratch + i * k, x + (full_tiles * kTileRows + i) * x_stride, k * sizeof(uint16_t));
        });
    }
    auto tile_rows = [&](int64_t t) -> const uint16_t* {
        return t < full_tiles ? x + t * kTileRows * x_stride : scratch;
    };
    auto tile_stride = [&](int64_t t) -> int64_t { return (t < full_tiles ? x_stride : k) * int64_t(sizeof(uint16_t)); };
    const int64_t num_panels = (n + kPanel - 1) / kPanel;
    const int64_t num_runs = (num_panels + kAmxPanelsPerGrab - 1) / kAmxPanelsPerGrab;
    bool configured = false;
    // A work item is a run of panels, against every row: a group of row tiles at a time through each
    // panel of the run (or pair of panels), so that the run's weight (128 KB at a K of 512) stays in
    // cache while the rows go by, and each group's rows of x are read once per run. (Panels outermost
    // read all of x once per panel: at 2,048 rows, 2 MB per panel from beyond L2, and the small shape's
    // projections ran 3x slower than oneDNN's.) Up to 64 rows, four row tiles against one panel
    // (panel_amx: the weight streams in once for all the rows); past that, two by two (panels_amx).
    // int8 weights take panels outermost instead within blocks of rows, each pair turned into bfloat16
    // once per block (up to 64 rows, one group of row tiles, the same order).
    const bool by_pairs = row_tiles > kMaxRowTiles;
    const int64_t group_tiles = by_pairs ? 2 : kMaxRowTiles, group_panels = by_pairs ? 2 : 1;
    split.items(num_runs, 1, [&](int64_t run) {
        if (!configured) configure_tiles(), configured = true;
        alignas(64) float acc[kMaxRowTiles * kTileRows][kPanel];
        const int64_t last_panel = std::min(num_panels, (run + 1) * kAmxPanelsPerGrab);
        // The row tiles from t0 against `panels` panels from p (their bfloat16 at `panel`), and their rows stored.
        auto rows_against = [&](int64_t t0, int64_t p, const uint16_t* const* panel, int panels) {
            const int tiles = int(std::min<int64_t>(group_tiles, row_tiles - t0));
            const uint16_t* a[kMaxRowTiles];
            int64_t a_stride[kMaxRowTiles];
            for (int t = 0; t < tiles; ++t) a[t] = tile_rows(t0 + t), a_stride[t] = tile_stride(t0 + t);
            const int64_t rows = std::min<int64_t>(tiles * kTileRows, m - t0 * kTileRows);
            switch (by_pairs ? 4 + 2 * tiles + panels : tiles) {  // acc: panel q's rows from q * tiles * 16
                case 1: panel_amx<1>(a, a_stride, panel[0], k_pairs, acc); break;
                case 2: panel_amx<2>(a, a_stride, panel[0], k_pairs, acc); break;
                case 3: panel_amx<3>(a, a_stride, panel[0], k_pairs, acc); break;
                case 4: panel_amx<4>(a, a_stride, panel[0], k_pairs, acc); break;
                case 7: panels_amx<1, 1>(a, a_stride, panel, k_pairs, acc); break;
                case 8: panels_amx<1, 2>(a, a_stride, panel, k_pairs, acc); break;
                case 9: panels_amx<2, 1>(a, a_stride, panel, k_pairs, acc); break;
                default: panels_amx<2, 2>(a, a_stride, panel, k_pairs, acc); break;
            }
            for (int q = 0; q < panels; ++q) {
                const int64_t first_out = (p + q) * kPanel;
                const int num_outs = int(std::min<int64_t>(kPanel, n - first_out));
                for (int64_t i = 0; i < rows; ++i)
                    store(t0 * kTileRows + i, first_out, acc[q * tiles * kTileRows + i], num_outs);
            }
        };
        if constexpr (std::is_same_v<WT, int8_t>) {
            // x in blocks of kI8BlockTiles row tiles (512 rows: 1 MB at a K of 1,024, held in L2 while the
            // run's panels go by), each panel pair turned into bfloat16 once per block
            thread_local std::vector<uint16_t> converted;
            converted.resize(size_t(2 * panel_elems));
            for (int64_t first_tile = 0; first_tile < row_tiles; first_tile += kI8BlockTiles) {
                const int64_t end_tile = std::min(row_tiles, first_tile + kI8BlockTiles);
                for (int64_t p = run * kAmxPanelsPerGrab; p < last_panel; p += group_panels) {
                    const int panels = int(std::min<int64_t>(group_panels, last_panel - p));
                    i8_to_bf16(blocked + p * panel_elems, panels * panel_elems, converted.data());
                    const uint16_t* panel[2] = {converted.data(), converted.data() + (panels - 1) * panel_elems};
                    for (int64_t t0 = first_tile; t0 < end_tile; t0 += group_tiles) rows_against(t0, p, panel, panels);
                }
            }
        } else {
            for (int64_t t0 = 0; t0 < row_tiles; t0 += group_tiles)
                for (int64_t p = run * kAmxPanelsPerGrab; p < last_panel; p += group_panels) {
                    const int panels = int(std::min<int64_t>(group_panels, last_panel - p));
                    const uint16_t* panel[2] = {blocked + p * panel_elems, blocked + (p + panels - 1) * panel_elems};
                    rows_against(t0, p, panel, panels);
                }
        }
    });
    if (configured) _tile_release();
#else
    (void)x, (void)m, (void)x_stride, (void)blocked, (void)panel_elems, (void)k_pairs, (void)n, (void)scratch,
        (void)store, (void)split;
#endif
}

}  // namespace
