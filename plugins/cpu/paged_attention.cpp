#include "paged_attention.h"

#include "quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace precast {
namespace {

inline float dot(const float* a, const float* b, int n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float acc[8] = {0};
  for (int i = 0; i < n; ++i) acc[i % 8] += a[i] * b[i];
  float s = 0;
  for (float x : acc) s += x;
  return s;
}

inline void axpy(float a, const float* x, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

// The E4M3 cache read as value / 256 (quantize.h); attention folds the 256 into its scales.
inline float dot(const float* a, const uint8_t* b, int n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), e4m3x16_div256(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float s = 0;
  for (int i = 0; i < n; ++i) s += a[i] * e4m3_div256(b[i]);
  return s;
}

inline void axpy(float a, const uint8_t* x, float* y, int n) {
  int i = 0;
#if defined(__AVX512F__)
  const __m512 av = _mm512_set1_ps(a);
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, e4m3x16_div256(x + i), _mm512_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += a * e4m3_div256(x[i]);
}

#if defined(__AVX512F__)
// exp for 16 lanes: x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite split of ln2), e^r by
// Cephes' degree-7 polynomial, then scaled by 2^n. About 1 ulp; a glibc call per score
// cost more than the rest of attention together.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
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
#endif

// scores[i] = exp(scores[i] - mx); returns their sum.
inline float exp_shifted(float* scores, int n, float mx) {
  int i = 0;
  float sum = 0.0f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  const __m512 m = _mm512_set1_ps(mx);
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + i), m));
    _mm512_storeu_ps(scores + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (i < n) {
    const __mmask16 mask = __mmask16((1u << (n - i)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, scores + i), m));
    _mm512_mask_storeu_ps(scores + i, mask, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(mask, e));
    i = n;
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) sum += (scores[i] = std::exp(scores[i] - mx));
  return sum;
}

}  // namespace

void write_kv(const PagedKvLayer& cache, const int* block_table, int position, const float* k, const float* v) {
  const int block = block_table[position / cache.tokens_per_block];
  const int row = position % cache.tokens_per_block;
  const int D = cache.head_dim;
  for (int g = 0; g < cache.num_kv_heads; ++g) {
    const float* kg = k + int64_t(g) * D;
    const float* vg = v + int64_t(g) * D;
    if (!cache.fp8) {
      std::memcpy(cache.k_at<float>(block, g, row), kg, sizeof(float) * D);
      std::memcpy(cache.v_at<float>(block, g, row), vg, sizeof(float) * D);
      continue;
    }
    uint8_t* kq = cache.k_at<uint8_t>(block, g, row);
    uint8_t* vq = cache.v_at<uint8_t>(block, g, row);
    for (int i = 0; i < D; ++i) {
      kq[i] = e4m3_bits(round_to_e4m3(kg[i] / cache.k_scale));
      vq[i] = e4m3_bits(round_to_e4m3(vg[i] / cache.v_scale));
    }
  }
}

namespace {

// T: the cache element (float, or uint8_t E4M3 read as value / 256 and rescaled here).
template <class T>
void attention_items(const PagedKvLayer& cache, const std::vector<AttentionSequence>& seqs, const std::vector<int>& token_seq,
                     const float* q, int64_t q_stride, int num_heads, int window, float scale, float* out, int64_t begin,
                     int64_t end) {
  const int D = cache.head_dim, B = cache.tokens_per_block;
  const int group = num_heads / cache.num_kv_heads;
  const int64_t num_items = int64_t(token_seq.size()) * num_heads;
  constexpr bool kFp8 = std::is_same_v<T, uint8_t>;
  const float score_scale = kFp8 ? scale * cache.k_scale * 256.0f : scale;
  const float value_scale = kFp8 ? cache.v_scale * 256.0f : 1.0f;
  std::vector<float> scores;
  for (int64_t k = begin; k < end; ++k) {
    const int64_t item = (k % 2 == 0) ? k / 2 : num_items - 1 - k / 2;
    const int t_global = int(item / num_heads), h = int(item % num_heads), g = h / group;
    const AttentionSequence& seq = seqs[token_seq[t_global]];
    const int pos = seq.context_len + (t_global - seq.token_offset);
    const int lo = window > 0 ? std::max(0, pos - window + 1) : 0;
    const float* qh = q + int64_t(t_global) * q_stride + int64_t(h) * D;
    scores.resize(pos - lo + 1);
    // Walk the positions block by block: one table lookup per block, no division per key.
    float mx = -INFINITY;
    for (int j0 = lo; j0 <= pos;) {
      const int row0 = j0 % B, n = std::min(B - row0, pos - j0 + 1);
      const T* k = cache.k_at<T>(seq.block_table[j0 / B], g, row0);
      for (int r = 0; r < n; ++r, k += D) {
        const float sc = dot(qh, k, D) * score_scale;
        scores[j0 - lo + r] = sc;
        mx = std::max(mx, sc);
      }
      j0 += n;
    }
    const float inv = value_scale / exp_shifted(scores.data(), int(scores.size()), mx);
    float* oh = out + int64_t(t_global) * num_heads * D + int64_t(h) * D;
    std::fill(oh, oh + D, 0.0f);
    for (int j0 = lo; j0 <= pos;) {
      const int row0 = j0 % B, n = std::min(B - row0, pos - j0 + 1);
      const T* v = cache.v_at<T>(seq.block_table[j0 / B], g, row0);
      for (int r = 0; r < n; ++r, v += D) axpy(scores[j0 - lo + r] * inv, v, oh, D);
      j0 += n;
    }
  }
}

}  // namespace

void paged_attention(ThreadPool& pool, const PagedKvLayer& cache, const std::vector<AttentionSequence>& seqs,
                     const float* q, int64_t q_stride, int num_heads, int window, float scale, float* out) {
  // Work items are (query token, head) pairs, each computed start to finish by one thread.
  // Causal attention makes late tokens dearer than early ones, so items are dealt in
  // zigzag order (first, last, second, second-to-last, ...): contiguous thread ranges
  // then get similar amounts of work.
  std::vector<int> token_seq;
  for (int s = 0; s < int(seqs.size()); ++s) token_seq.insert(token_seq.end(), seqs[s].num_tokens, s);
  const int64_t num_items = int64_t(token_seq.size()) * num_heads;
  pool.parallel_for(num_items, [&](int64_t begin, int64_t end) {
    if (cache.fp8) attention_items<uint8_t>(cache, seqs, token_seq, q, q_stride, num_heads, window, scale, out, begin, end);
    else attention_items<float>(cache, seqs, token_seq, q, q_stride, num_heads, window, scale, out, begin, end);
  });
}

}  // namespace precast
