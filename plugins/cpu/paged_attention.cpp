#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

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

}  // namespace

void write_kv(const PagedKvLayer& cache, const int* block_table, int position, const float* k, const float* v) {
  const int block = block_table[position / cache.tokens_per_block];
  const int row = position % cache.tokens_per_block;
  const size_t bytes = sizeof(float) * cache.head_dim;
  for (int g = 0; g < cache.num_kv_heads; ++g) {
    std::memcpy(cache.k_at(block, g, row), k + int64_t(g) * cache.head_dim, bytes);
    std::memcpy(cache.v_at(block, g, row), v + int64_t(g) * cache.head_dim, bytes);
  }
}

void paged_attention(ThreadPool& pool, const PagedKvLayer& cache, const std::vector<AttentionSequence>& seqs,
                     const float* q, int64_t q_stride, int num_heads, int window, float scale, float* out) {
  // Work items are (query token, head) pairs, each computed start to finish by one thread.
  std::vector<int> token_seq;
  for (int s = 0; s < int(seqs.size()); ++s) token_seq.insert(token_seq.end(), seqs[s].num_tokens, s);
  const int D = cache.head_dim, B = cache.tokens_per_block;
  const int group = num_heads / cache.num_kv_heads;
  pool.parallel_for(int64_t(token_seq.size()) * num_heads, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int t_global = int(item / num_heads), h = int(item % num_heads), g = h / group;
      const AttentionSequence& seq = seqs[token_seq[t_global]];
      const int t = t_global - seq.token_offset;
      const int pos = seq.context_len + t;
      const int lo = window > 0 ? std::max(0, pos - window + 1) : 0;
      const float* qh = q + int64_t(t_global) * q_stride + int64_t(h) * D;
      scores.resize(pos - lo + 1);
      float mx = -INFINITY;
      for (int j = lo; j <= pos; ++j) {
        const float s = dot(qh, cache.k_at(seq.block_table[j / B], g, j % B), D) * scale;
        scores[j - lo] = s;
        mx = std::max(mx, s);
      }
      float sum = 0.0f;
      for (float& s : scores) sum += (s = std::exp(s - mx));
      float* oh = out + int64_t(t_global) * num_heads * D + int64_t(h) * D;
      std::fill(oh, oh + D, 0.0f);
      const float inv = 1.0f / sum;
      for (int j = lo; j <= pos; ++j) axpy(scores[j - lo] * inv, cache.v_at(seq.block_table[j / B], g, j % B), oh, D);
    }
  });
}

}  // namespace precast
