// y[M, N] = x[M, K] W^T (+ b) for a few rows M, float32 and bfloat16, accumulated in float32.
//
// W comes blocked once at load time (see linear.py): panels of 16 output rows, interleaved along K so
// that one 64-byte load feeds all 16 outputs of a panel:
//   float32:  [panels, K, 16]
//   bfloat16: [panels, K_pairs, 16, 2] (K padded to even with zeros): pairs for _mm512_dpbf16_ps.
// Each thread streams through a contiguous run of panels, holding up to kRowsPerPass rows of x against
// one panel in registers, so M rows cost one pass over the weights (more rows re-read the panel from
// cache, not from memory).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 16;
constexpr int kRowsPerPass = 8;
constexpr int kPrefetchBytes = 1024;  // ahead of the current 64-byte line of the panel stream

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

inline void prefetch(const void* p) {
#ifdef __AVX512F__
    _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
#else
    __builtin_prefetch(static_cast<const char*>(p) + kPrefetchBytes);
#endif
}

// acc[i][o] = sum_k x_rows[i][k] * panel[k][o]
template <int MR>
void panel_f32(const float* const* x_rows, const float* panel, int64_t k, float (*acc)[kPanel]) {
#ifdef __AVX512F__
    __m512 sum[MR];
    for (int i = 0; i < MR; ++i) sum[i] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; ++kk) {
        prefetch(panel + kk * kPanel);
        __m512 w = _mm512_loadu_ps(panel + kk * kPanel);
        for (int i = 0; i < MR; ++i) sum[i] = _mm512_fmadd_ps(_mm512_set1_ps(x_rows[i][kk]), w, sum[i]);
    }
    for (int i = 0; i < MR; ++i) _mm512_storeu_ps(acc[i], sum[i]);
#else
    for (int i = 0; i < MR; ++i) std::fill(acc[i], acc[i] + kPanel, 0.0f);
    for (int64_t kk = 0; kk < k; ++kk) {
        prefetch(panel + kk * kPanel);
        for (int i = 0; i < MR; ++i) {
            float xv = x_rows[i][kk];
            for (int o = 0; o < kPanel; ++o) acc[i][o] += xv * panel[kk * kPanel + o];
        }
    }
#endif
}

// The bfloat16 rows of x, as the kernel reads them: padded to K_pairs * 2 with zeros, as bf16 pairs
// where the CPU multiplies bf16 pairs natively, as float32 elsewhere.
#ifdef __AVX512BF16__
using XRow = uint16_t;
inline XRow x_element(uint16_t h) { return h; }
#else
using XRow = float;
inline XRow x_element(uint16_t h) { return bf16_to_f32(h); }
#endif

// acc[i][o] = sum_k x_rows[i][k] * W[o][k], the panel as [K_pairs][16][2] bf16
template <int MR>
void panel_bf16(const XRow* const* x_rows, const uint16_t* panel, int64_t k_pairs, float (*acc)[kPanel]) {
#if defined(__AVX512BF16__)
    __m512 sum[MR];
    for (int i = 0; i < MR; ++i) sum[i] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < k_pairs; ++kp) {
        prefetch(panel + kp * 2 * kPanel);
        __m512bh w = (__m512bh)_mm512_loadu_si512(panel + kp * 2 * kPanel);
        for (int i = 0; i < MR; ++i) {
            int32_t pair;
            std::memcpy(&pair, x_rows[i] + 2 * kp, 4);
            sum[i] = _mm512_dpbf16_ps(sum[i], (__m512bh)_mm512_set1_epi32(pair), w);
        }
    }
    for (int i = 0; i < MR; ++i) _mm512_storeu_ps(acc[i], sum[i]);
#elif defined(__AVX512F__)
    __m512 sum[MR];
    for (int i = 0; i < MR; ++i) sum[i] = _mm512_setzero_ps();
    const __m512i high_half = _mm512_set1_epi32(int32_t(0xffff0000u));
    for (int64_t kp = 0; kp < k_pairs; ++kp) {
        prefetch(panel + kp * 2 * kPanel);
        __m512i w = _mm512_loadu_si512(panel + kp * 2 * kPanel);
        __m512 w_even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        __m512 w_odd = _mm512_castsi512_ps(_mm512_and_si512(w, high_half));
        for (int i = 0; i < MR; ++i) {
            sum[i] = _mm512_fmadd_ps(_mm512_set1_ps(x_rows[i][2 * kp]), w_even, sum[i]);
            sum[i] = _mm512_fmadd_ps(_mm512_set1_ps(x_rows[i][2 * kp + 1]), w_odd, sum[i]);
        }
    }
    for (int i = 0; i < MR; ++i) _mm512_storeu_ps(acc[i], sum[i]);
#else
    for (int i = 0; i < MR; ++i) std::fill(acc[i], acc[i] + kPanel, 0.0f);
    for (int64_t kp = 0; kp < k_pairs; ++kp) {
        const uint16_t* w = panel + kp * 2 * kPanel;
        prefetch(w);
        for (int i = 0; i < MR; ++i) {
            float x_even = x_rows[i][2 * kp], x_odd = x_rows[i][2 * kp + 1];
            for (int o = 0; o < kPanel; ++o)
                acc[i][o] += x_even * bf16_to_f32(w[2 * o]) + x_odd * bf16_to_f32(w[2 * o + 1]);
        }
    }
#endif
}

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

template <int MR>
struct PanelF32 {
    static void run(const float* const* x_rows, const float* panel, int64_t k, float (*acc)[kPanel]) {
        panel_f32<MR>(x_rows, panel, k, acc);
    }
};

template <int MR>
struct PanelBF16 {
    static void run(const XRow* const* x_rows, const uint16_t* panel, int64_t k_pairs, float (*acc)[kPanel]) {
        panel_bf16<MR>(x_rows, panel, k_pairs, acc);
    }
};

// For every panel (split over the threads) and every pass of rows: accumulate, then hand each row's
// accumulators and the panel's first output column to `store(row, first_out, acc_row, num_outs)`.
template <template <int> class PanelKernel, typename XT, typename WT, typename Store>
void run_panels(const XT* const* x_rows, int64_t m, const WT* blocked, int64_t panel_elems, int64_t k_steps,
                int64_t n, Store store) {
    const int64_t num_panels = (n + kPanel - 1) / kPanel;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < num_panels; ++p) {
        alignas(64) float acc[kRowsPerPass][kPanel];
        const int64_t first_out = p * kPanel;
        const int num_outs = int(std::min<int64_t>(kPanel, n - first_out));
        for (int64_t r0 = 0; r0 < m; r0 += kRowsPerPass) {
            const int rows = int(std::min<int64_t>(kRowsPerPass, m - r0));
            dispatch_rows<PanelKernel>(rows, x_rows + r0, blocked + p * panel_elems, k_steps, acc);
            for (int i = 0; i < rows; ++i) store(r0 + i, first_out, acc[i], num_outs);
        }
    }
}

}  // namespace

extern "C" {

// x: [m, k] with row stride x_stride; blocked: [ceil(n / 16), k, 16]; bias: [n] or null;
// y: [m, n] with row stride y_stride.
void linear_f32(const float* x, int64_t m, int64_t x_stride, const float* blocked, const float* bias,
                int64_t n, int64_t k, float* y, int64_t y_stride) {
    std::vector<const float*> x_rows(m);
    for (int64_t i = 0; i < m; ++i) x_rows[i] = x + i * x_stride;
    auto store = [=](int64_t row, int64_t first_out, const float* acc, int num_outs) {
        float* out = y + row * y_stride + first_out;
        for (int o = 0; o < num_outs; ++o) out[o] = acc[o] + (bias ? bias[first_out + o] : 0.0f);
    };
    run_panels<PanelF32>(x_rows.data(), m, blocked, k * kPanel, k, n, store);
}

// As linear_f32 with bfloat16 x, bias and y (as uint16 bits); blocked: [ceil(n / 16), ceil(k / 2), 16, 2].
void linear_bf16(const uint16_t* x, int64_t m, int64_t x_stride, const uint16_t* blocked, const uint16_t* bias,
                 int64_t n, int64_t k, uint16_t* y, int64_t y_stride) {
    const int64_t k_pairs = (k + 1) / 2;
    std::vector<XRow> x_padded(m * 2 * k_pairs, x_element(0));
    std::vector<const XRow*> x_rows(m);
    for (int64_t i = 0; i < m; ++i) {
        XRow* row = x_padded.data() + i * 2 * k_pairs;
        for (int64_t kk = 0; kk < k; ++kk) row[kk] = x_element(x[i * x_stride + kk]);
        x_rows[i] = row;
    }
    auto store = [=](int64_t row, int64_t first_out, const float* acc, int num_outs) {
        uint16_t* out = y + row * y_stride + first_out;
        for (int o = 0; o < num_outs; ++o)
            out[o] = f32_to_bf16(acc[o] + (bias ? bf16_to_f32(bias[first_out + o]) : 0.0f));
    };
    run_panels<PanelBF16>(x_rows.data(), m, blocked, k_pairs * 2 * kPanel, k_pairs, n, store);
}

}  // extern "C"
