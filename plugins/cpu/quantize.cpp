#include "quantize.h"

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace precast {
namespace {

// Round x to a grid whose step is 2^(e - mantissa_bits), e = max(floor(log2|x|), min_exp):
// the spacing of a binary float with `mantissa_bits` explicit bits and smallest normal
// exponent `min_exp` (below it, the subnormal step). Scaling by powers of two is exact,
// so the only rounding is nearbyint's (round to nearest even).
inline float round_to_grid(float x, int mantissa_bits, int min_exp) {
  if (x == 0.0f || !std::isfinite(x)) return x;
  const int e = std::max(std::ilogb(x), min_exp);
  return std::ldexp(std::nearbyint(std::ldexp(x, mantissa_bits - e)), e - mantissa_bits);
}

#if defined(__AVX512F__)
inline __m512 round_to_grid16(__m512 x, int mantissa_bits, int min_exp) {
  // getexp(0) is -inf; the max turns it into min_exp and 0 stays 0.
  const __m512 e = _mm512_max_ps(_mm512_getexp_ps(x), _mm512_set1_ps(float(min_exp)));
  const __m512 m = _mm512_set1_ps(float(mantissa_bits));
  const __m512 scaled = _mm512_scalef_ps(x, _mm512_sub_ps(m, e));
  const __m512 rounded = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(rounded, _mm512_sub_ps(e, m));
}
inline __m512 clamp16(__m512 x, float lim) {
  return _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-lim)), _mm512_set1_ps(lim));
}
#endif

}  // namespace

float round_to_e4m3(float x) { return round_to_grid(std::clamp(x, -kFp8Max, kFp8Max), 3, -6); }
float round_to_e2m1(float x) { return round_to_grid(std::clamp(x, -kFp4Max, kFp4Max), 1, 0); }

uint8_t e4m3_bits(float v) {
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const float a = std::fabs(v);
  if (a == 0.0f) return sign;
  const int e = std::ilogb(a);
  if (e < -6) return sign | uint8_t(std::lrint(std::ldexp(a, 9)));  // subnormal: multiples of 2^-9
  const int mantissa = int(std::lrint(std::ldexp(a, 3 - e))) - 8;
  return sign | uint8_t((e + 7) << 3) | uint8_t(mantissa);
}

void fake_quant_fp8(const float* x, int64_t n, float scale, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(scale);
  for (; i + 16 <= n; i += 16) {
    const __m512 q = round_to_grid16(clamp16(_mm512_div_ps(_mm512_loadu_ps(x + i), s), kFp8Max), 3, -6);
    _mm512_storeu_ps(out + i, _mm512_mul_ps(q, s));
  }
#endif
  for (; i < n; ++i) out[i] = round_to_e4m3(x[i] / scale) * scale;
}

void fake_quant_nvfp4(const float* x, int num_rows, int cols, float global_scale, float* out) {
  const float denom = kFp4Max * global_scale;
  for (int64_t b = 0; b < int64_t(num_rows) * (cols / kNvfp4Block); ++b) {
    const float* xb = x + b * kNvfp4Block;
    float* ob = out + b * kNvfp4Block;
    float amax = 0.0f;
    for (int j = 0; j < kNvfp4Block; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float effective = round_to_e4m3(amax / denom) * global_scale;
    const float safe = effective > 0.0f ? effective : 1.0f;
#if defined(__AVX512F__)
    const __m512 q = round_to_grid16(clamp16(_mm512_div_ps(_mm512_loadu_ps(xb), _mm512_set1_ps(safe)), kFp4Max), 1, 0);
    _mm512_storeu_ps(ob, _mm512_mul_ps(q, _mm512_set1_ps(effective)));
#else
    for (int j = 0; j < kNvfp4Block; ++j) ob[j] = round_to_e2m1(xb[j] / safe) * effective;
#endif
  }
}

void int4_round_trip_scaled(const float* w, const float* s, int64_t row_begin, int64_t row_end, int cols,
                            int group_size, float* out) {
  std::vector<float> v(static_cast<size_t>(group_size));
  for (int64_t r = row_begin; r < row_end; ++r) {
    const float* row = w + r * cols;
    float* dst = out + r * cols;
    for (int g = 0; g < cols; g += group_size) {
      float amax = 0.0f;
      for (int j = 0; j < group_size; ++j) {
        v[size_t(j)] = row[g + j] * s[g + j];
        amax = std::max(amax, std::fabs(v[size_t(j)]));
      }
      const float scale = amax / 7.0f;
      const float safe = scale > 0.0f ? scale : 1.0f;
      for (int j = 0; j < group_size; ++j) {
        const float q = std::clamp(std::nearbyint(v[size_t(j)] / safe), -8.0f, 7.0f);  // half to even, as np.rint
        dst[g + j] = q * scale / s[g + j];
      }
    }
  }
}

}  // namespace precast
