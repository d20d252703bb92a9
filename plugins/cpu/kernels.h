// CPU kernels of the generic decoder. Activations are float32; weight matrices are
// float32, bfloat16 or float16 and are widened to float32 inside the inner loops (never
// materialized). Every kernel computes each output row with the same operations in the
// same order whatever else is in the batch (batch invariance).
#pragma once

#include <cstdint>

#include "thread_pool.h"

namespace precast {

enum class WeightDtype { kF32, kBF16, kF16 };

struct WeightView {
  const void* data = nullptr;
  WeightDtype dtype = WeightDtype::kF32;
  int rows = 0;  // output features
  int cols = 0;  // input features
};

// y[r, o] = sum_i x[r, i] * w[o, i] (+ bias[o]) for r < num_rows; x is [num_rows, w.cols].
void linear(ThreadPool& pool, const float* x, int num_rows, const WeightView& w, const float* bias, float* y);

// y = x / sqrt(mean(x^2) + eps) * weight, per row of `dim` values.
void rms_norm(const float* x, const float* weight, int num_rows, int dim, float eps, float* y);

// One embedding row (any weight dtype) widened into `out`.
void embedding_row(const WeightView& table, int32_t token, float* out);

// out[i] = silu(gate_up[i]) * gate_up[inter + i] per row; gate_up is [num_rows, 2 * inter].
void silu_and_mul(const float* gate_up, int num_rows, int inter, float* out);

// Rotary embedding in place on `num_heads` heads of `head_dim` starting at `x` (HF's
// rotate-half layout): pair (j, j + head_dim / 2) rotated by position * inv_freq[j],
// then multiplied by `scale` (yarn's attention factor, 1 otherwise).
void rope(float* x, int num_heads, int head_dim, int position, const float* inv_freq, float scale);

}  // namespace precast
