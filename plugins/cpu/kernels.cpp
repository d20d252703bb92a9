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
inline __m512 load16(const void* base, int64_t i, __mmask16 mask) {
  if constexpr (DT == WeightDtype::kF32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(base) + i);
  } else {
    __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(base) + i);
    if constexpr (DT == WeightDtype::kBF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
  }
}

// NR input rows x NO weight rows: each dot product is a chain of 16-wide FMAs over the
// input dimension followed by one horizontal sum, identical for every tile shape.
template <WeightDtype DT, int NR, int NO>
inline void tile(const float* x, int64_t x_stride, const void* w, int64_t o0, int cols, const float* bias, float* y,
                 int64_t y_stride) {
  __m512 acc[NR][NO];
  for (int r = 0; r < NR; ++r)
    for (int o = 0; o < NO; ++o) acc[r][o] = _mm512_setzero_ps();
  for (int i = 0; i < cols; i += 16) {
    const __mmask16 mask = cols - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (cols - i)) - 1);
    __m512 wv[NO];
    for (int o = 0; o < NO; ++o) wv[o] = load16<DT>(w, (o0 + o) * int64_t(cols) + i, mask);
    for (int r = 0; r < NR; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + r * x_stride + i);
      for (int o = 0; o < NO; ++o) acc[r][o] = _mm512_fmadd_ps(xv, wv[o], acc[r][o]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int o = 0; o < NO; ++o) y[r * y_stride + o0 + o] = _mm512_reduce_add_ps(acc[r][o]) + (bias ? bias[o0 + o] : 0.0f);
}

template <WeightDtype DT, int NR>
inline void tile_rows(const float* x, int64_t x_stride, const void* w, int64_t o0, int no, int cols, const float* bias,
                      float* y, int64_t y_stride) {
  switch (no) {
    case 4: tile<DT, NR, 4>(x, x_stride, w, o0, cols, bias, y, y_stride); break;
    case 3: tile<DT, NR, 3>(x, x_stride, w, o0, cols, bias, y, y_stride); break;
    case 2: tile<DT, NR, 2>(x, x_stride, w, o0, cols, bias, y, y_stride); break;
    default: tile<DT, NR, 1>(x, x_stride, w, o0, cols, bias, y, y_stride); break;
  }
}
#endif

// Output rows [o_begin, o_end) for all input rows. Weight rows are taken in blocks small
// enough to stay in L2 while every input row passes over them, so a long prefill reads
// each weight from memory once.
template <WeightDtype DT>
void linear_range(const float* x, int num_rows, const WeightView& w, const float* bias, float* y, int64_t o_begin,
                  int64_t o_end) {
  const int cols = w.cols;
  const int64_t y_stride = w.rows;
#ifdef PRECAST_AVX512
  const int64_t block = std::max<int64_t>(4, (int64_t(256) * 1024 / (int64_t(cols) * (DT == WeightDtype::kF32 ? 4 : 2))) & ~int64_t(3));
  for (int64_t b0 = o_begin; b0 < o_end; b0 += block) {
    const int64_t b1 = std::min(o_end, b0 + block);
    for (int r = 0; r < num_rows; r += 4) {
      const int nr = std::min(4, num_rows - r);
      const float* xr = x + int64_t(r) * cols;
      float* yr = y + int64_t(r) * y_stride;
      for (int64_t o = b0; o < b1; o += 4) {
        const int no = int(std::min<int64_t>(4, b1 - o));
        switch (nr) {
          case 4: tile_rows<DT, 4>(xr, cols, w.data, o, no, cols, bias, yr, y_stride); break;
          case 3: tile_rows<DT, 3>(xr, cols, w.data, o, no, cols, bias, yr, y_stride); break;
          case 2: tile_rows<DT, 2>(xr, cols, w.data, o, no, cols, bias, yr, y_stride); break;
          default: tile_rows<DT, 1>(xr, cols, w.data, o, no, cols, bias, yr, y_stride); break;
        }
      }
    }
  }
#else
  for (int r = 0; r < num_rows; ++r) {
    for (int64_t o = o_begin; o < o_end; ++o) {
      float acc[16] = {0};
      for (int i = 0; i < cols; ++i) acc[i % 16] += x[int64_t(r) * cols + i] * load_scalar<DT>(w.data, o * cols + i);
      float sum = 0;
      for (float a : acc) sum += a;
      y[r * y_stride + o] = sum + (bias ? bias[o] : 0.0f);
    }
  }
#endif
}

}  // namespace

void linear(ThreadPool& pool, const float* x, int num_rows, const WeightView& w, const float* bias, float* y) {
  // Split output features across threads in multiples of 4 (whole tiles).
  const int64_t quads = (int64_t(w.rows) + 3) / 4;
  pool.parallel_for(quads, [&](int64_t q0, int64_t q1) {
    const int64_t o0 = q0 * 4, o1 = std::min<int64_t>(w.rows, q1 * 4);
    switch (w.dtype) {
      case WeightDtype::kF32: linear_range<WeightDtype::kF32>(x, num_rows, w, bias, y, o0, o1); break;
      case WeightDtype::kBF16: linear_range<WeightDtype::kBF16>(x, num_rows, w, bias, y, o0, o1); break;
      case WeightDtype::kF16: linear_range<WeightDtype::kF16>(x, num_rows, w, bias, y, o0, o1); break;
    }
  });
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

void embedding_row(const WeightView& table, int32_t token, float* out) {
  const int64_t base = int64_t(token) * table.cols;
  for (int i = 0; i < table.cols; ++i) {
    switch (table.dtype) {
      case WeightDtype::kF32: out[i] = load_scalar<WeightDtype::kF32>(table.data, base + i); break;
      case WeightDtype::kBF16: out[i] = load_scalar<WeightDtype::kBF16>(table.data, base + i); break;
      case WeightDtype::kF16: out[i] = load_scalar<WeightDtype::kF16>(table.data, base + i); break;
    }
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
