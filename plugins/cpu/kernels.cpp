#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PRECAST_AVX512 1
#endif

namespace precast {
namespace {

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <WeightDtype DT>
inline float load_scalar(const void* base, int64_t i) {
  if constexpr (DT == WeightDtype::kF32) return static_cast<const float*>(base)[i];
  if constexpr (DT == WeightDtype::kBF16) return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  return f16_to_float(static_cast<const uint16_t*>(base)[i]);
}

#ifdef PRECAST_AVX512
template <WeightDtype DT>
inline __m512 load16(const void* base, int64_t i) {
  if constexpr (DT == WeightDtype::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
    if constexpr (DT == WeightDtype::kBF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
  }
}

// NR input rows x one 64-output panel: 4 x NR accumulators, one broadcast FMA per input
// element and output vector.
template <WeightDtype DT, int NR>
inline void panel_kernel(const float* x, int64_t x_stride, const void* panel, int cols, int valid, const float* bias,
                         float* y, int64_t y_stride) {
  __m512 acc[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int i = 0; i < cols; ++i) {
    const int64_t off = int64_t(i) * kPanel;
    const __m512 w0 = load16<DT>(panel, off), w1 = load16<DT>(panel, off + 16);
    const __m512 w2 = load16<DT>(panel, off + 32), w3 = load16<DT>(panel, off + 48);
    for (int r = 0; r < NR; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * x_stride + i]);
      acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xb, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(xb, w3, acc[r][3]);
    }
  }
  for (int v = 0; v < 4; ++v) {
    const int n = std::min(16, valid - v * 16);
    if (n <= 0) break;
    const __mmask16 mask = n == 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + v * 16) : _mm512_setzero_ps();
    for (int r = 0; r < NR; ++r) _mm512_mask_storeu_ps(y + r * y_stride + v * 16, mask, _mm512_add_ps(acc[r][v], b));
  }
}
#endif

// Panels [p_begin, p_end) for all input rows.
template <WeightDtype DT>
void linear_panels(const float* x, int num_rows, const PackedMatrix& w, const float* bias, float* y, int64_t p_begin,
                   int64_t p_end) {
  const int cols = w.cols;
  for (int64_t p = p_begin; p < p_end; ++p) {
    const int valid = int(std::min<int64_t>(kPanel, w.rows - p * kPanel));
    const uint8_t* panel = w.data.data() + size_t(p) * kPanel * cols * w.element_size();
    const float* b = bias ? bias + p * kPanel : nullptr;
#ifdef PRECAST_AVX512
    constexpr int R = 6;  // 24 accumulators + 4 weight vectors fit the 32 registers
    for (int r = 0; r < num_rows; r += R) {
      const float* xr = x + int64_t(r) * cols;
      float* yr = y + int64_t(r) * w.rows + p * kPanel;
      switch (std::min(R, num_rows - r)) {
        case 6: panel_kernel<DT, 6>(xr, cols, panel, cols, valid, b, yr, w.rows); break;
        case 5: panel_kernel<DT, 5>(xr, cols, panel, cols, valid, b, yr, w.rows); break;
        case 4: panel_kernel<DT, 4>(xr, cols, panel, cols, valid, b, yr, w.rows); break;
        case 3: panel_kernel<DT, 3>(xr, cols, panel, cols, valid, b, yr, w.rows); break;
        case 2: panel_kernel<DT, 2>(xr, cols, panel, cols, valid, b, yr, w.rows); break;
        default: panel_kernel<DT, 1>(xr, cols, panel, cols, valid, b, yr, w.rows); break;
      }
    }
#else
    for (int r = 0; r < num_rows; ++r) {
      float acc[kPanel] = {0};
      for (int i = 0; i < cols; ++i) {
        const float xi = x[int64_t(r) * cols + i];
        for (int j = 0; j < kPanel; ++j) acc[j] += xi * load_scalar<DT>(panel, int64_t(i) * kPanel + j);
      }
      for (int j = 0; j < valid; ++j) y[int64_t(r) * w.rows + p * kPanel + j] = acc[j] + (b ? b[j] : 0.0f);
    }
#endif
  }
}

}  // namespace

PackedMatrix PackedMatrix::pack(const void* row_major, WeightDtype dtype, int rows, int cols) {
  PackedMatrix m;
  m.dtype = dtype;
  m.rows = rows;
  m.cols = cols;
  const size_t es = m.element_size();
  const int64_t panels = (int64_t(rows) + kPanel - 1) / kPanel;
  m.data.assign(size_t(panels) * kPanel * cols * es, 0);
  const uint8_t* src = static_cast<const uint8_t*>(row_major);
  for (int64_t o = 0; o < rows; ++o) {
    const int64_t p = o / kPanel, j = o % kPanel;
    for (int64_t i = 0; i < cols; ++i)
      std::memcpy(m.data.data() + ((p * cols + i) * kPanel + j) * es, src + (o * cols + i) * es, es);
  }
  return m;
}

void linear(ThreadPool& pool, const float* x, int num_rows, const PackedMatrix& w, const float* bias, float* y) {
  const int64_t panels = (int64_t(w.rows) + kPanel - 1) / kPanel;
  pool.parallel_for(panels, [&](int64_t p0, int64_t p1) {
    switch (w.dtype) {
      case WeightDtype::kF32: linear_panels<WeightDtype::kF32>(x, num_rows, w, bias, y, p0, p1); break;
      case WeightDtype::kBF16: linear_panels<WeightDtype::kBF16>(x, num_rows, w, bias, y, p0, p1); break;
      case WeightDtype::kF16: linear_panels<WeightDtype::kF16>(x, num_rows, w, bias, y, p0, p1); break;
    }
  });
}

void matrix_row(const PackedMatrix& w, int row, float* out) {
  const int64_t p = row / kPanel, j = row % kPanel;
  const int64_t base = p * w.cols * kPanel + j;
  for (int i = 0; i < w.cols; ++i) {
    const int64_t idx = base + int64_t(i) * kPanel;
    switch (w.dtype) {
      case WeightDtype::kF32: out[i] = load_scalar<WeightDtype::kF32>(w.data.data(), idx); break;
      case WeightDtype::kBF16: out[i] = load_scalar<WeightDtype::kBF16>(w.data.data(), idx); break;
      case WeightDtype::kF16: out[i] = load_scalar<WeightDtype::kF16>(w.data.data(), idx); break;
    }
  }
}

void rms_norm(const float* x, const float* weight, int num_rows, int dim, float eps, float* y) {
  for (int r = 0; r < num_rows; ++r) {
    const float* xr = x + int64_t(r) * dim;
    float* yr = y + int64_t(r) * dim;
    float acc[16] = {0};
    for (int i = 0; i < dim; ++i) acc[i % 16] += xr[i] * xr[i];
    float sum = 0;
    for (float a : acc) sum += a;
    const float inv = 1.0f / std::sqrt(sum / float(dim) + eps);
    for (int i = 0; i < dim; ++i) yr[i] = weight[i] * (xr[i] * inv);
  }
}

void silu_and_mul(const float* gate_up, int num_rows, int inter, float* out) {
  for (int r = 0; r < num_rows; ++r) {
    const float* g = gate_up + int64_t(r) * 2 * inter;
    const float* u = g + inter;
    float* o = out + int64_t(r) * inter;
    for (int i = 0; i < inter; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}

void rope(float* x, int num_heads, int head_dim, int position, const float* inv_freq, float scale) {
  const int half = head_dim / 2;
  for (int j = 0; j < half; ++j) {
    // The angle in float32, as reference implementations compute it.
    const float angle = float(position) * inv_freq[j];
    const float c = std::cos(angle) * scale, s = std::sin(angle) * scale;
    for (int h = 0; h < num_heads; ++h) {
      float* xh = x + int64_t(h) * head_dim;
      const float a = xh[j], b = xh[j + half];
      xh[j] = a * c - b * s;
      xh[j + half] = b * c + a * s;
    }
  }
}

}  // namespace precast
