// CPU kernels of the generic decoder. Activations are float32; weight matrices are
// float32, bfloat16 or float16 and are widened to float32 inside the inner loops (never
// materialized). Every kernel computes each output row with the same operations in the
// same order whatever else is in the batch (batch invariance).
#pragma once

#include <cstdint>
#include <vector>

#include "thread_pool.h"

namespace precast {

enum class WeightDtype { kF32, kBF16, kF16 };

// A weight matrix [rows = output features, cols = input features] repacked for the
// kernels: panels of kPanel output rows, each stored input-major,
//
//   panel p: for i in 0..cols: W[p*kPanel + 0][i], W[p*kPanel + 1][i], ..., W[p*kPanel + kPanel-1][i]
//
// (rows past the end are zero). A linear layer then streams each panel once, front to
// back, accumulating kPanel outputs per input element with no horizontal sums, and
// every output is one chain of FMAs in input order whatever the batch (batch invariance).
constexpr int kPanel = 64;

struct PackedMatrix {
  std::vector<uint8_t> data;
  WeightDtype dtype = WeightDtype::kF32;
  int rows = 0;
  int cols = 0;
  static PackedMatrix pack(const void* row_major, WeightDtype dtype, int rows, int cols);
  size_t element_size() const { return dtype == WeightDtype::kF32 ? 4 : 2; }
};

// y[r, o] = sum_i x[r, i] * w[o, i] (+ bias[o]) for r < num_rows; x is [num_rows, w.cols].
void linear(ThreadPool& pool, const float* x, int num_rows, const PackedMatrix& w, const float* bias, float* y);

// Row `row` of the matrix (an embedding lookup), widened to float32 into `out`.
void matrix_row(const PackedMatrix& w, int row, float* out);

// y = x / sqrt(mean(x^2) + eps) * weight, per row of `dim` values.
void rms_norm(const float* x, const float* weight, int num_rows, int dim, float eps, float* y);

// out[i] = silu(gate_up[i]) * gate_up[inter + i] per row; gate_up is [num_rows, 2 * inter].
void silu_and_mul(const float* gate_up, int num_rows, int inter, float* out);

// Rotary embedding in place on `num_heads` heads of `head_dim` starting at `x` (HF's
// rotate-half layout): pair (j, j + head_dim / 2) rotated by position * inv_freq[j],
// then multiplied by `scale` (yarn's attention factor, 1 otherwise).
void rope(float* x, int num_heads, int head_dim, int position, const float* inv_freq, float scale);

}  // namespace precast
