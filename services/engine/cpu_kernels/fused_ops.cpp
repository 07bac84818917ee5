// The row operations of the torch forward (prefill steps, eager decode) on the CPU: each one native
// pass over the rows on OpenMP's threads, where torch runs several ops with float32 temporaries between
// them (models/layers.py, models/rope.py). The same row functions as the decode step (row_ops.h), so
// both paths round alike.

#include <omp.h>

#include "row_ops.h"

namespace {

// Items a thread takes at a time: about 8 turns per thread.
int64_t grab(int64_t items) { return std::max<int64_t>(1, items / (8 * omp_get_max_threads())); }

template <typename T>
void add_rms_norm(const T* x, T* residual, const T* weight, int64_t rows, int64_t n, float eps, T* out) {
  OmpSplit split;
#pragma omp parallel
  split.items(rows, grab(rows), [&](int64_t r) {
    const T* normed = x + r * n;
    if (residual != nullptr) {
      add_row(residual + r * n, normed, n);
      normed = residual + r * n;
    }
    rms_norm_row(normed, weight, n, eps, out + r * n);
  });
}

template <typename T>
void silu_mul_rows(const T* gate_up, int64_t rows, int64_t inter, T* out) {
  OmpSplit split;
#pragma omp parallel
  split.items(rows, grab(rows), [&](int64_t r) {
    const T* row = gate_up + r * 2 * inter;
    silu_mul(row, row + inter, out + r * inter, inter);
  });
}

template <typename T>
void rotary_rows(T* x, int64_t rows, int64_t heads, int64_t dim, int64_t row_stride, const T* cos, const T* sin) {
  OmpSplit split;
#pragma omp parallel
  split.items(rows * heads, grab(rows * heads), [&](int64_t item) {
    const int64_t r = item / heads, h = item % heads;
    rotate_head(x + r * row_stride + h * dim, cos + r * dim, sin + r * dim, dim);
  });
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16, for every tensor. Rows are contiguous and `n` (or 2 * `inter`) long.

// residual += x (when residual is not null), then out = norm(residual, or x) * weight.
void strata_add_rms_norm(int32_t dtype, const void* x, void* residual, const void* weight, int64_t rows, int64_t n,
                         float eps, void* out) {
  if (dtype == kFloat32)
    add_rms_norm(static_cast<const float*>(x), static_cast<float*>(residual), static_cast<const float*>(weight),
                 rows, n, eps, static_cast<float*>(out));
  else
    add_rms_norm(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(residual),
                 static_cast<const uint16_t*>(weight), rows, n, eps, static_cast<uint16_t*>(out));
}

// out[r] = silu(gate_up[r, :inter]) * gate_up[r, inter:].
void strata_silu_mul(int32_t dtype, const void* gate_up, int64_t rows, int64_t inter, void* out) {
  if (dtype == kFloat32)
    silu_mul_rows(static_cast<const float*>(gate_up), rows, inter, static_cast<float*>(out));
  else
    silu_mul_rows(static_cast<const uint16_t*>(gate_up), rows, inter, static_cast<uint16_t*>(out));
}

// Rotates the first `heads` heads of each row of x (row r at x + r * row_stride) in place with row r
// of cos and sin ([rows, dim], the second half of sin negated: models/rope.py).
void strata_rotary(int32_t dtype, void* x, int64_t rows, int64_t heads, int64_t dim, int64_t row_stride,
                   const void* cos, const void* sin) {
  if (dtype == kFloat32)
    rotary_rows(static_cast<float*>(x), rows, heads, dim, row_stride, static_cast<const float*>(cos),
                static_cast<const float*>(sin));
  else
    rotary_rows(static_cast<uint16_t*>(x), rows, heads, dim, row_stride, static_cast<const uint16_t*>(cos),
                static_cast<const uint16_t*>(sin));
}

}  // extern "C"
