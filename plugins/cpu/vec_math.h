// Vector math and memory helpers shared by the CPU kernels.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace precast {

// The first n of 16 lanes (none for n <= 0, all for n >= 16): masks for a vector's valid tail.
inline __mmask16 first_lanes(int n) {
  return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
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

}  // namespace precast
#endif
