#include "quantize.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "bf16.h"

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

namespace {
// e4m3(clip(x / scale)), times `out_scale` (scale: dequantized; 1: the codes' values).
void quantize_fp8(const float* x, int64_t n, float scale, float out_scale, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(scale), o = _mm512_set1_ps(out_scale);
  for (; i + 16 <= n; i += 16) {
    const __m512 q = round_to_grid16(clamp16(_mm512_div_ps(_mm512_loadu_ps(x + i), s), kFp8Max), 3, -6);
    _mm512_storeu_ps(out + i, _mm512_mul_ps(q, o));
  }
#endif
  for (; i < n; ++i) out[i] = round_to_e4m3(x[i] / scale) * out_scale;
}

// Per block: e2m1(clip(x / (block_scale * global))) * block_scale, times global when `dequantize`.
void quantize_nvfp4(const float* x, int num_rows, int cols, float global_scale, bool dequantize, float* out) {
  const float denom = kFp4Max * global_scale;
  for (int64_t b = 0; b < int64_t(num_rows) * (cols / kNvfp4Block); ++b) {
    const float* xb = x + b * kNvfp4Block;
    float* ob = out + b * kNvfp4Block;
    float amax = 0.0f;
    for (int j = 0; j < kNvfp4Block; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float block_scale = round_to_e4m3(amax / denom);
    const float effective = block_scale * global_scale;
    const float safe = effective > 0.0f ? effective : 1.0f;
    const float out_scale = dequantize ? effective : block_scale;
#if defined(__AVX512F__)
    const __m512 q = round_to_grid16(clamp16(_mm512_div_ps(_mm512_loadu_ps(xb), _mm512_set1_ps(safe)), kFp4Max), 1, 0);
    _mm512_storeu_ps(ob, _mm512_mul_ps(q, _mm512_set1_ps(out_scale)));
#else
    for (int j = 0; j < kNvfp4Block; ++j) ob[j] = round_to_e2m1(xb[j] / safe) * out_scale;
#endif
  }
}
}  // namespace

void fake_quant_fp8(const float* x, int64_t n, float scale, float* out) { quantize_fp8(x, n, scale, scale, out); }

void fp8_codes(const float* x, int64_t n, float scale, float* out) { quantize_fp8(x, n, scale, 1.0f, out); }

void fp8_dynamic_scales(const float* x, int num_rows, int cols, float* scales) {
  for (int r = 0; r < num_rows; ++r) {
    const float* row = x + int64_t(r) * cols;
    int i = 0;
    float amax = 0.0f;
#if defined(__AVX512F__)
    __m512 m = _mm512_setzero_ps();
    for (; i + 16 <= cols; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(row + i)));
    amax = _mm512_reduce_max_ps(m);
#endif
    for (; i < cols; ++i) amax = std::max(amax, std::fabs(row[i]));
    scales[r] = amax > 0.0f ? amax / kFp8Max : 1.0f;
  }
}

void fake_quant_nvfp4(const float* x, int num_rows, int cols, float global_scale, float* out) {
  quantize_nvfp4(x, num_rows, cols, global_scale, true, out);
}

void nvfp4_codes(const float* x, int num_rows, int cols, float global_scale, float* out) {
  quantize_nvfp4(x, num_rows, cols, global_scale, false, out);
}

// No fused multiply-adds here: the round trip must match numpy's separately rounded q * scale + offset bit for bit.
__attribute__((optimize("fp-contract=off"))) void int4_round_trip_scaled(const float* w, const float* s,
                                                                         int64_t row_begin, int64_t row_end, int cols,
                                                                         int group_size, bool asymmetric, float* out) {
  std::vector<float> v(static_cast<size_t>(group_size));
  for (int64_t r = row_begin; r < row_end; ++r) {
    const float* row = w + r * cols;
    float* dst = out + r * cols;
    for (int g = 0; g < cols; g += group_size) {
      float amax = 0.0f, low = INFINITY, high = -INFINITY;
      for (int j = 0; j < group_size; ++j) {
        v[size_t(j)] = row[g + j] * s[g + j];
        amax = std::max(amax, std::fabs(v[size_t(j)]));
        low = std::min(low, v[size_t(j)]);
        high = std::max(high, v[size_t(j)]);
      }
      // bf16 values, as quantize_int4 stores them (the kernels hold scales and offsets in bf16)
      const float unrounded = asymmetric ? (high - low) / 15.0f : amax / 7.0f;
      const float scale = bf16_round(unrounded);
      const float offset = asymmetric ? bf16_round(low + 8.0f * unrounded) : 0.0f;
      const float safe = scale > 0.0f ? scale : 1.0f;
      for (int j = 0; j < group_size; ++j) {
        const float centred = asymmetric ? v[size_t(j)] - offset : v[size_t(j)];
        const float q = std::clamp(std::nearbyint(centred / safe), -8.0f, 7.0f);  // half to even, as np.rint
        const float value = asymmetric ? q * scale + offset : q * scale;
        dst[g + j] = value / s[g + j];
      }
    }
  }
}

namespace {
// Codes of a group for `scale` (as quantize_int4: rint(w / scale) clamped to [-8, 7]) and the weighted squared error of
// their dequantization; with `refit`, the scale first moves to the one that minimises that error for these codes
// (weighted least squares: sum(a w q) / sum(a q^2)) and the codes are taken again for it. `scale` returns the scale
// used, rounded to bf16 as quantize_int4 stores it.
float int4_group_error(const float* w, const float* a, int n, float& scale, bool refit) {
  scale = bf16_round(scale);
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    const __m512 lo = _mm512_set1_ps(-8.0f), hi = _mm512_set1_ps(7.0f);
    auto codes = [&](int j, __m512 s) {
      const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(w + j), s), _MM_FROUND_TO_NEAREST_INT);
      return _mm512_min_ps(_mm512_max_ps(q, lo), hi);
    };
    if (refit) {
      const __m512 s = _mm512_set1_ps(scale);
      __m512 wq = _mm512_setzero_ps(), qq = _mm512_setzero_ps();
      for (int j = 0; j < n; j += 16) {
        const __m512 q = codes(j, s), aq = _mm512_mul_ps(_mm512_loadu_ps(a + j), q);
        wq = _mm512_fmadd_ps(aq, _mm512_loadu_ps(w + j), wq);
        qq = _mm512_fmadd_ps(aq, q, qq);
      }
      const float sum_wq = _mm512_reduce_add_ps(wq), sum_qq = _mm512_reduce_add_ps(qq);
      if (!(sum_qq > 0.0f) || !(sum_wq > 0.0f)) return INFINITY;
      scale = bf16_round(sum_wq / sum_qq);
    }
    const __m512 s = _mm512_set1_ps(scale);
    __m512 err = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 16) {
      const __m512 d = _mm512_fnmadd_ps(codes(j, s), s, _mm512_loadu_ps(w + j));
      err = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(a + j), d), d, err);
    }
    return _mm512_reduce_add_ps(err);
  }
#endif
  if (refit) {
    float wq = 0.0f, qq = 0.0f;
    for (int j = 0; j < n; ++j) {
      const float q = std::clamp(std::nearbyint(w[j] / scale), -8.0f, 7.0f);
      wq += a[j] * w[j] * q;
      qq += a[j] * q * q;
    }
    if (!(qq > 0.0f) || !(wq > 0.0f)) return INFINITY;  // no weight on any nonzero code: keep the plain scale
    scale = bf16_round(wq / qq);
  }
  float err = 0.0f;
  for (int j = 0; j < n; ++j) {
    const float d = w[j] - std::clamp(std::nearbyint(w[j] / scale), -8.0f, 7.0f) * scale;
    err += a[j] * d * d;
  }
  return err;
}
}  // namespace

namespace {
// max |x| of values in [low, high] (+0 for a group of zeros of either sign).
inline float max_abs(float low, float high) { return std::fabs(std::max(high, -low)); }

// visit(group g of row r, its importance, the group's min and max, r * groups + g: where its results go) for rows
// [row_begin, row_end) of a [rows, cols] weight in groups of group_size columns: the loop the scale searches share.
template <typename Visit>
void for_each_group(const float* w, const float* importance, int64_t row_begin, int64_t row_end, int cols,
                    int group_size, Visit&& visit) {
  const int groups = cols / group_size;
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int g = 0; g < groups; ++g) {
      const float* wg = w + r * cols + int64_t(g) * group_size;
      float low = INFINITY, high = -INFINITY;
      for (int j = 0; j < group_size; ++j) low = std::min(low, wg[j]), high = std::max(high, wg[j]);
      visit(wg, importance + int64_t(g) * group_size, low, high, r * groups + g);
    }
  }
}
}  // namespace

void int4_search_scales(const float* w, const float* importance, int64_t row_begin, int64_t row_end, int cols,
                        int group_size, float* scales) {
  for_each_group(w, importance, row_begin, row_end, cols, group_size,
                 [&](const float* wg, const float* ag, float low, float high, int64_t at) {
                   const float amax = max_abs(low, high);
                   float best = amax / 7.0f;
                   if (best > 0.0f) {
                     float best_err = int4_group_error(wg, ag, group_size, best, false);
                     for (int k = 1; k <= kInt4ScaleCandidates; ++k) {
                       // from the plain scale down to half of it in equal steps, each refit
                       float scale = amax / 7.0f * (1.0f - 0.5f * float(k) / float(kInt4ScaleCandidates));
                       const float err = int4_group_error(wg, ag, group_size, scale, true);
                       if (err < best_err) best_err = err, best = scale;
                     }
                   }
                   scales[at] = best;
                 });
}

namespace {
#if defined(__AVX512F__)
// 16 asymmetric codes clamp(rint((x - offset) / scale), -8, 7).
inline __m512 asym_codes16(__m512 x, __m512 scale, __m512 offset) {
  const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_sub_ps(x, offset), scale), _MM_FROUND_TO_NEAREST_INT);
  return _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(-8.0f)), _mm512_set1_ps(7.0f));
}
#endif

// Asymmetric codes clamp(rint((w - offset) / scale), -8, 7) of a group and the weighted squared error of their
// dequantization scale q + offset; with `refit`, (scale, offset) first move to the weighted least-squares fit for these
// codes and the codes are taken again for it. Returns INFINITY where the fit is degenerate (one code, no weight).
// Scale and offset are rounded to bf16 first, as quantize_int4 stores them.
float int4_group_error_asym(const float* w, const float* a, int n, float& scale, float& offset, bool refit) {
  scale = bf16_round(scale), offset = bf16_round(offset);
  auto code = [](float x, float s, float m) { return std::clamp(std::nearbyint((x - m) / s), -8.0f, 7.0f); };
  if (refit) {
    // Normal equations of min sum a (w - s q - m)^2: [Sqq Sq; Sq S1] [s; m] = [Swq; Sw].
    double s1 = 0, sq = 0, sqq = 0, sw = 0, swq = 0;
#if defined(__AVX512F__)
    if (n % 16 == 0) {
      const __m512 vs = _mm512_set1_ps(scale), vm = _mm512_set1_ps(offset);
      __m512 a1 = _mm512_setzero_ps(), aq = _mm512_setzero_ps(), aqq = _mm512_setzero_ps(), aw = _mm512_setzero_ps(),
             awq = _mm512_setzero_ps();
      for (int j = 0; j < n; j += 16) {
        const __m512 x = _mm512_loadu_ps(w + j), wt = _mm512_loadu_ps(a + j), q = asym_codes16(x, vs, vm);
        const __m512 wq = _mm512_mul_ps(wt, q);
        a1 = _mm512_add_ps(a1, wt);
        aq = _mm512_add_ps(aq, wq);
        aqq = _mm512_fmadd_ps(wq, q, aqq);
        aw = _mm512_fmadd_ps(wt, x, aw);
        awq = _mm512_fmadd_ps(wq, x, awq);
      }
      s1 = _mm512_reduce_add_ps(a1), sq = _mm512_reduce_add_ps(aq), sqq = _mm512_reduce_add_ps(aqq);
      sw = _mm512_reduce_add_ps(aw), swq = _mm512_reduce_add_ps(awq);
    } else
#endif
    {
      for (int j = 0; j < n; ++j) {
        const double q = code(w[j], scale, offset);
        s1 += a[j], sq += a[j] * q, sqq += a[j] * q * q, sw += a[j] * w[j], swq += a[j] * q * w[j];
      }
    }
    const double det = sqq * s1 - sq * sq;
    if (!(det > 1e-12 * sqq * s1)) return INFINITY;
    const double s = (s1 * swq - sq * sw) / det, m = (sqq * sw - sq * swq) / det;
    if (!(s > 0) || !std::isfinite(m)) return INFINITY;
    scale = bf16_round(float(s)), offset = bf16_round(float(m));
  }
  float err = 0.0f;
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    const __m512 vs = _mm512_set1_ps(scale), vm = _mm512_set1_ps(offset);
    __m512 acc = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 16) {
      const __m512 x = _mm512_loadu_ps(w + j);
      const __m512 d = _mm512_sub_ps(x, _mm512_fmadd_ps(asym_codes16(x, vs, vm), vs, vm));
      acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(a + j), d), d, acc);
    }
    return _mm512_reduce_add_ps(acc);
  }
#endif
  for (int j = 0; j < n; ++j) {
    const float d = w[j] - (code(w[j], scale, offset) * scale + offset);
    err += a[j] * d * d;
  }
  return err;
}
}  // namespace

void int4_search_scales_offsets(const float* w, const float* importance, int64_t row_begin, int64_t row_end, int cols,
                                int group_size, float* scales, float* offsets) {
  for_each_group(w, importance, row_begin, row_end, cols, group_size,
                 [&](const float* wg, const float* ag, float low, float high, int64_t at) {
                   // The plain pair, as precast.engine.formats.quantize_int4 makes it.
                   float best_scale = (high - low) / 15.0f, best_offset = low + 8.0f * best_scale;
                   if (best_scale > 0.0f) {
                     float s = best_scale, m = best_offset;
                     float best_err = int4_group_error_asym(wg, ag, group_size, s, m, false);
                     best_scale = s, best_offset = m;  // as evaluated: bf16 values
                     for (int k = 0; k <= kInt4AsymSteps; ++k) {
                       const float step = best_scale * (1.0f - 0.5f * float(k) / float(kInt4AsymSteps));
                       // the grid's code -8 at the min, code 7 at the max, or its middle (code -0.5) at the middle
                       const float anchored[3] = {low + 8.0f * step, high - 7.0f * step,
                                                  0.5f * (low + high) + 0.5f * step};
                       for (float start : anchored) {
                         s = step, m = start;
                         const float err = int4_group_error_asym(wg, ag, group_size, s, m, true);
                         if (err < best_err) best_err = err, best_scale = s, best_offset = m;
                       }
                     }
                   }
                   scales[at] = best_scale;
                   offsets[at] = best_offset;
                 });
}

void nvfp4_search_block_scales(const float* w, const float* importance, float global_scale, int64_t row_begin,
                               int64_t row_end, int cols, float* block_scales) {
  // The error of one block scale, as quantize_nvfp4 rounds: e2m1(clip(w / effective)), effective = scale * global.
  auto error = [&](const float* wb, const float* ab, float scale) {
    const float effective = scale * global_scale;
#if defined(__AVX512F__)
    const __m512 x = _mm512_loadu_ps(wb), e = _mm512_set1_ps(effective);
    const __m512 q = round_to_grid16(clamp16(_mm512_div_ps(x, e), kFp4Max), 1, 0);
    const __m512 d = _mm512_fnmadd_ps(q, e, x);
    return _mm512_reduce_add_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(ab), d), d));
#else
    float err = 0.0f;
    for (int j = 0; j < kNvfp4Block; ++j) {
      const float d = wb[j] - round_to_e2m1(wb[j] / effective) * effective;
      err += ab[j] * d * d;
    }
    return err;
#endif
  };
  for_each_group(w, importance, row_begin, row_end, cols, kNvfp4Block,
                 [&](const float* wb, const float* ab, float low, float high, int64_t at) {
                   const float plain = round_to_e4m3(max_abs(low, high) / (kFp4Max * global_scale));
                   float best = plain;
                   if (plain > 0.0f) {
                     float best_err = error(wb, ab, plain);
                     const int code = e4m3_bits(plain);  // positive E4M3 codes are ordered like their values
                     for (int c = std::max(1, code - kNvfp4ScaleStepsDown); c <= std::min(0x7e, code + 1); ++c) {
                       if (c == code) continue;
                       const float scale = e4m3_to_float(uint8_t(c));
                       const float err = error(wb, ab, scale);
                       if (err < best_err) best_err = err, best = scale;
                     }
                   }
                   block_scales[at] = best;
                 });
}

}  // namespace precast
