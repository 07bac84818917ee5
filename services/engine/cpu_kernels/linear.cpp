// y[M, N] = x[M, K] W^T (+ b) for a few rows M, float32 and bfloat16, accumulated in float32.
//
// W comes blocked once at load time (see linear.py): panels of 16 output rows, interleaved along K so
// that one 64-byte load feeds all 16 outputs of a panel:
//   float32:  [panels, K, 16]
//   bfloat16: [panels, K_pairs, 16, 2] (K padded to even with zeros): pairs for _mm512_dpbf16_ps.
// x is first packed (once per call, by the threads together from a few passes up) in passes of
// kRowsPerPass rows interleaved along K, so the inner loop broadcasts each row's element from one
// pointer. Each thread streams through a contiguous run of panels, holding a pass of rows against one
// panel in registers: M rows cost one pass over the weights (more rows re-read the panel from cache,
// not from memory). The threads share the panels as the decode step's do (ProgressSplit, work_split.h).
// bfloat16 from kAmxMinRows rows runs on AMX tiles where the CPU and the OS allow (linear_panels.h).
// int8 weights (weight-only quantization) take bfloat16's layout and x, with a scale per output.

#include <memory>

#include "linear_panels.h"

namespace {

// linear_bf16's and linear_bf16_i8's AMX path (where amx_serves): x as it lies, in one parallel region.
template <typename WT, typename Store>
void linear_on_amx(const uint16_t* x, int64_t m, int64_t x_stride, const WT* blocked, int64_t n, int64_t k,
                   Store store) {
    const int64_t k_pairs = (k + 1) / 2;
    std::vector<uint16_t> scratch(m % kTileRows ? kTileRows * k : 0);
    PhaseCounters counters(2);  // the tail tile's copy, the panels
#pragma omp parallel
    {
        ProgressSplit split(counters);
        run_panels_amx(x, m, x_stride, blocked, k_pairs * 2 * kPanel, k_pairs, n, scratch.data(), store, split);
    }
}

}  // namespace

extern "C" {

// x: [m, k] with row stride x_stride; blocked: [ceil(n / 16), k, 16]; bias: [n] or null;
// y: [m, n] with row stride y_stride.
void linear_f32(const float* x, int64_t m, int64_t x_stride, const float* blocked, const float* bias,
                int64_t n, int64_t k, float* y, int64_t y_stride) {
    const std::unique_ptr<float[]> x_packed(new float[m * k]);  // every element written by the packing
    auto identity = [](float v) { return v; };
    const bool together = packs_x_together(m);
    for (int64_t p = 0; !together && p < passes_of(m); ++p)
        pack_x_pass(x_packed.get(), x, m, x_stride, k, k, 1, identity, p);
    auto store = [=](int64_t row, int64_t first_out, const float* acc, int num_outs) {
        float* out = y + row * y_stride + first_out;
        for (int o = 0; o < num_outs; ++o) out[o] = acc[o] + (bias ? bias[first_out + o] : 0.0f);
    };
    PhaseCounters counters(2);  // the packing of x (unless done above), the panels
#pragma omp parallel
    {
        ProgressSplit split(counters);
        if (together) pack_x(x_packed.get(), x, m, x_stride, k, k, 1, identity, split);
        run_panels_f32(x_packed.get(), m, k, blocked, k * kPanel, k, n, store, split);
    }
}

// As linear_f32 with bfloat16 x, bias and y (as uint16 bits); blocked: [ceil(n / 16), ceil(k / 2), 16, 2].
void linear_bf16(const uint16_t* x, int64_t m, int64_t x_stride, const uint16_t* blocked, const uint16_t* bias,
                 int64_t n, int64_t k, uint16_t* y, int64_t y_stride) {
    const int64_t k_pairs = (k + 1) / 2;
    auto store = [=](int64_t row, int64_t first_out, const float* acc, int num_outs) {
        uint16_t* out = y + row * y_stride + first_out;
        for (int o = 0; o < num_outs; ++o)
            out[o] = f32_to_bf16(acc[o] + (bias ? bf16_to_f32(bias[first_out + o]) : 0.0f));
    };
    if (amx_serves(m, k)) {
        linear_on_amx(x, m, x_stride, blocked, n, k, store);
        return;
    }
    const std::unique_ptr<XElement[]> x_packed(new XElement[m * k_pairs * 2]);  // every element written by the packing
    const bool together = packs_x_together(m);
    for (int64_t p = 0; !together && p < passes_of(m); ++p)
        pack_x_pass(x_packed.get(), x, m, x_stride, k, k_pairs, 2, x_element, p);
    PhaseCounters counters(2);  // the packing of x (unless done above), the panels
#pragma omp parallel
    {
        ProgressSplit split(counters);
        if (together) pack_x(x_packed.get(), x, m, x_stride, k, k_pairs, 2, x_element, split);
        run_panels_bf16(x_packed.get(), m, 2 * k_pairs, blocked, k_pairs * 2 * kPanel, k_pairs, n, store, split);
    }
}

// As linear_bf16 on an int8 weight in the same blocked layout ([ceil(n / 16), ceil(k / 2), 16, 2]) with a
// float32 scale per output (scales: [n]): y = x (scales * Q)^T + b, the sums scaled before the bias.
void linear_bf16_i8(const uint16_t* x, int64_t m, int64_t x_stride, const int8_t* blocked, const float* scales,
                    const uint16_t* bias, int64_t n, int64_t k, uint16_t* y, int64_t y_stride) {
    const int64_t k_pairs = (k + 1) / 2;
    auto store = [=](int64_t row, int64_t first_out, const float* acc, int num_outs) {
        uint16_t* out = y + row * y_stride + first_out;
        for (int o = 0; o < num_outs; ++o)
            out[o] = f32_to_bf16(acc[o] * scales[first_out + o] + (bias ? bf16_to_f32(bias[first_out + o]) : 0.0f));
    };
    if (amx_serves(m, k, kAmxMinRowsI8)) {
        linear_on_amx(x, m, x_stride, blocked, n, k, store);
        return;
    }
    const int64_t row_stride = x_i8_row_stride(k);
    const std::unique_ptr<int16_t[]> x_packed(new int16_t[m * row_stride]);  // every element written by the packing
    const bool together = packs_x_together(m);
    for (int64_t p = 0; !together && p < passes_of(m); ++p) pack_x_i8_pass(x_packed.get(), x, m, x_stride, k, p);
    PhaseCounters counters(2);  // the packing of x (unless done above), the panels
#pragma omp parallel
    {
        ProgressSplit split(counters);
        if (together)
            split.items(passes_of(m), 1, [&](int64_t p) { pack_x_i8_pass(x_packed.get(), x, m, x_stride, k, p); });
        run_panels<PanelI8>(x_packed.get(), m, row_stride, blocked, k_pairs * 2 * kPanel, k_pairs, n, store, split);
    }
}

// Whether bfloat16 with m rows and K = k runs on AMX tiles here (1) or on the AVX-512 kernel (0).
int32_t linear_bf16_uses_amx(int64_t m, int64_t k) { return amx_serves(m, k); }

// The same for int8 weights.
int32_t linear_bf16_i8_uses_amx(int64_t m, int64_t k) { return amx_serves(m, k, kAmxMinRowsI8); }

}  // extern "C"
