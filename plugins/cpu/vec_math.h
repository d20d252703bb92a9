// Vector math and memory helpers shared by the CPU kernels.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels.h"

namespace precast {

// The first n of 16 lanes (none for n <= 0, all for n >= 16): masks for a vector's valid tail.
inline __mmask16 first_lanes(int n) {
  return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// 16 bf16 values (int4 group scales and offsets) widened to float32: exact, a shift.
inline __m512 widen_bf16x16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Weights streamed once from DRAM (a decode step) leave the loop waiting on memory with the
// hardware prefetcher alone: it keeps too few lines in flight. Called once per 64-byte line read
// at `line`: one prefetch into L1 `ahead` bytes on and one into L2 four times as far. The
// distances were tuned on a Xeon with AMX (Qwen2.5 1.5B batch-1 decode, fp8 +20%, bf16 +12%):
// 4 KB for quantized weights, which are widened on the way, 8 KB for bf16, read twice as fast.
constexpr int kPrefetchQuantized = 4096;
constexpr int kPrefetchBf16 = 8192;
inline void prefetch_stream(const void* line, int ahead) {
  _mm_prefetch(static_cast<const char*>(line) + ahead, _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(line) + 4 * ahead, _MM_HINT_T1);
}

// Writes `num_rows` rows of a panel's kPanel outputs, tmp[r][kPanel], to y (rows of out_rows floats, the panel's
// first output at column p * kPanel): y = tmp x scale (x row_scales[r] where given) + bias, only the panel's
// valid outputs (the last panel of a layer may be partial).
inline void write_panel_rows(const float* tmp, int num_rows, float* y, int64_t out_rows, int64_t p, float scale,
                             const float* row_scales, const float* bias) {
  const int valid = int(std::min<int64_t>(kPanel, out_rows - p * kPanel));
  for (int r = 0; r < num_rows; ++r) {
    float* yr = y + r * out_rows + p * kPanel;
    const __m512 s = _mm512_set1_ps(row_scales ? scale * row_scales[r] : scale);
    for (int v = 0; v < 4 && valid > 16 * v; ++v) {
      const __mmask16 mask = first_lanes(valid - 16 * v);
      const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + p * kPanel + 16 * v) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(yr + 16 * v, mask, _mm512_fmadd_ps(_mm512_loadu_ps(tmp + r * kPanel + 16 * v), s, b));
    }
  }
}

// exp for 16 lanes: x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite split of ln2), e^r by
// Cephes' degree-7 polynomial, then scaled by 2^n. About 1 ulp; a glibc call per score
// cost more than the rest of attention together.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// p[i] = exp(s[i] - max) * value_scale / sum over the row's keys [first, last], 0 elsewhere
// in [0, width). Lane i % 16 accumulates the sum whatever the row's range (zeros add exactly).
inline void softmax_row(float* s, int width, int first, int last, float value_scale) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  auto valid = [&](int i) {
    const __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32(i));
    return __mmask16(_mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(first)) &
                     _mm512_cmple_epi32_mask(idx, _mm512_set1_epi32(last)));
  };
  for (int i = first & ~15; i <= last; i += 16)
    mx = _mm512_mask_max_ps(mx, valid(i), mx, _mm512_maskz_loadu_ps(valid(i), s + i));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int i = 0; i < width; i += 16) {
    const __mmask16 v = valid(i);
    const __m512 e = _mm512_maskz_mov_ps(v, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(v, s + i), m)));
    _mm512_storeu_ps(s + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 inv = _mm512_set1_ps(value_scale / _mm512_reduce_add_ps(sum));
  for (int i = first & ~15; i <= last; i += 16) _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), inv));
}

}  // namespace precast
#endif
