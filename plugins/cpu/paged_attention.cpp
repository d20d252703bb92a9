#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels.h"
#include "quantize.h"
#include "vec_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PRECAST_ATTN_AVX512 1
#endif

namespace precast {
namespace {

constexpr int kLanes = 16;
constexpr int kTileRows = 12;  // query rows per tile (the GQA group x enough tokens to share each K/V load)
constexpr int kQkRows = 6;     // query rows per QK pass: 6 rows x 2 key vectors = 12 accumulators
constexpr int kPvRows = 4;     // query rows per PV pass: 4 rows x 4 output vectors = 16 accumulators
constexpr int kPvSlab = 64;    // head_dim elements per PV pass
// The row loops below carry `#pragma GCC unroll`: without it GCC keeps the accumulator arrays
// in memory and stores every accumulator after each FMA (measured: attention ran 2x slower).

// One query row of a tile: a (token, head) pair and the key positions [lo, pos] it attends to.
struct QueryRow {
  const float* q;
  float* out;
  int lo;
  int pos;
};

// Keys [j, j + n) of the sequence, n <= 16, at columns [col, col + n) of one cache block.
struct KeyChunk {
  int j;
  int block;
  int col;
  int n;
};

#ifdef PRECAST_ATTN_AVX512
// 16 (masked) cache elements as float32; E4M3 as value / 256 (quantize.h), masked-off lanes 0.
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint8_t* p, __mmask16 m) { return e4m3x16_div256(_mm_maskz_loadu_epi8(m, p)); }

// scores[r][j - base] = scale * sum_d q_r[d] k_j[d] for the keys of one or two chunks.
// q_t holds the rows' queries transposed, [head_dim][NR]: one base pointer, so the 2 x NR
// accumulators stay in registers.
template <class T, int NR>
void qk_pass(const PagedKvLayer& c, int g, const float* q_t, const KeyChunk* ch, int num_chunks, int base, float scale,
             float* scores, int64_t stride) {
  const int B = c.tokens_per_block;
  const KeyChunk& c0 = ch[0];
  const KeyChunk& c1 = ch[num_chunks - 1];
  const T* k0 = c.k_tile<T>(c0.block, g) + c0.col;
  const T* k1 = c.k_tile<T>(c1.block, g) + c1.col;
  const __mmask16 m0 = first_lanes(c0.n), m1 = first_lanes(c1.n);
  __m512 a0[NR], a1[NR];
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int d = 0; d < c.head_dim; ++d) {
    const __m512 ka = load16(k0 + int64_t(d) * B, m0);
    const __m512 kb = load16(k1 + int64_t(d) * B, m1);
    const float* qd = q_t + d * NR;
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) {
      const __m512 qb = _mm512_set1_ps(qd[r]);
      a0[r] = _mm512_fmadd_ps(qb, ka, a0[r]);
      a1[r] = _mm512_fmadd_ps(qb, kb, a1[r]);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r) {
    _mm512_mask_storeu_ps(scores + r * stride + (c0.j - base), m0, _mm512_mul_ps(a0[r], s));
    if (num_chunks > 1) _mm512_mask_storeu_ps(scores + r * stride + (c1.j - base), m1, _mm512_mul_ps(a1[r], s));
  }
}

// out_r[d0 .. d0 + 64) = sum_j p_r[j] v_j[d0 .. d0 + 64), keys in order. p_t holds the rows'
// probabilities transposed, [key - base][NR].
template <class T, int NR>
void pv_pass(const PagedKvLayer& c, int g, const QueryRow* rows, const std::vector<KeyChunk>& chunks, int base,
             const float* p_t, int d0) {
  const int D = c.head_dim;
  const __mmask16 m0 = first_lanes(D - d0), m1 = first_lanes(D - d0 - 16), m2 = first_lanes(D - d0 - 32),
                  m3 = first_lanes(D - d0 - 48);
  __m512 a0[NR], a1[NR], a2[NR], a3[NR];
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r) a0[r] = a1[r] = a2[r] = a3[r] = _mm512_setzero_ps();
  for (const KeyChunk& ch : chunks) {
    const T* vrow = c.v_tile<T>(ch.block, g) + int64_t(ch.col) * D + d0;
    const float* p = p_t + int64_t(ch.j - base) * NR;
    for (int k = 0, n = ch.n; k < n; ++k, vrow += D, p += NR) {
      const __m512 w0 = load16(vrow, m0), w1 = load16(vrow + 16, m1), w2 = load16(vrow + 32, m2),
                   w3 = load16(vrow + 48, m3);
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) {
        const __m512 pb = _mm512_set1_ps(p[r]);
        a0[r] = _mm512_fmadd_ps(pb, w0, a0[r]);
        a1[r] = _mm512_fmadd_ps(pb, w1, a1[r]);
        a2[r] = _mm512_fmadd_ps(pb, w2, a2[r]);
        a3[r] = _mm512_fmadd_ps(pb, w3, a3[r]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r) {
    float* o = rows[r].out + d0;
    _mm512_mask_storeu_ps(o, m0, a0[r]);
    _mm512_mask_storeu_ps(o + 16, m1, a1[r]);
    _mm512_mask_storeu_ps(o + 32, m2, a2[r]);
    _mm512_mask_storeu_ps(o + 48, m3, a3[r]);
  }
}

template <class T, int NR = kQkRows>
void qk_rows(int nr, const PagedKvLayer& c, int g, const float* q_t, const KeyChunk* ch, int n, int base, float scale,
             float* scores, int64_t stride) {
  if constexpr (NR > 1) {
    if (nr < NR) return qk_rows<T, NR - 1>(nr, c, g, q_t, ch, n, base, scale, scores, stride);
  }
  qk_pass<T, NR>(c, g, q_t, ch, n, base, scale, scores, stride);
}

template <class T, int NR = kPvRows>
void pv_rows(int nr, const PagedKvLayer& c, int g, const QueryRow* rows, const std::vector<KeyChunk>& chunks, int base,
             const float* p_t, int d0) {
  if constexpr (NR > 1) {
    if (nr < NR) return pv_rows<T, NR - 1>(nr, c, g, rows, chunks, base, p_t, d0);
  }
  pv_pass<T, NR>(c, g, rows, chunks, base, p_t, d0);
}
#else
inline float load1(const float* p) { return *p; }
inline float load1(const uint8_t* p) { return e4m3_div256(*p); }
#endif

// One tile: the query rows of one sequence and kv head, scores for keys [base, end).
template <class T>
void attention_tile(const PagedKvLayer& c, int g, const int* block_table, const std::vector<QueryRow>& rows,
                    float scale, float softcap, std::vector<KeyChunk>& chunks, AlignedVector<float>& scores,
                    AlignedVector<float>& staged) {
  const int B = c.tokens_per_block, D = c.head_dim, R = int(rows.size());
  constexpr bool kFp8 = std::is_same_v<T, uint8_t>;
  const float score_scale = kFp8 ? scale * c.k_scale * 256.0f : scale;
  const float value_scale = kFp8 ? c.v_scale * 256.0f : 1.0f;
  int lo = rows[0].lo, end = rows[0].pos + 1;
  for (const QueryRow& r : rows) lo = std::min(lo, r.lo), end = std::max(end, r.pos + 1);
  const int base = lo & ~(kLanes - 1);
  const int width = (end - base + kLanes - 1) / kLanes * kLanes;
  chunks.clear();
  for (int j = base; j < end;) {
    const int col = j % B, n = std::min({kLanes, B - col, end - j});
    chunks.push_back({j, block_table[j / B], col, n});
    j += n;
  }
  scores.resize(size_t(R) *
                width);  // no zero fill: every entry read is written first (QK, then softmax over the width)
#ifdef PRECAST_ATTN_AVX512
  for (int r0 = 0; r0 < R; r0 += kQkRows) {
    const int nr = std::min(kQkRows, R - r0);
    staged.resize(size_t(D) * nr);
    for (int d = 0; d < D; ++d)
      for (int r = 0; r < nr; ++r) staged[size_t(d) * nr + r] = rows[r0 + r].q[d];
    for (size_t ci = 0; ci < chunks.size(); ci += 2)
      qk_rows<T>(nr, c, g, staged.data(), chunks.data() + ci, int(std::min<size_t>(2, chunks.size() - ci)), base,
                 score_scale, scores.data() + size_t(r0) * width, width);
  }
  for (int r = 0; r < R; ++r) {
    float* s = scores.data() + size_t(r) * width;
    if (softcap > 0) soft_cap(s + (rows[r].lo - base), rows[r].pos - rows[r].lo + 1, softcap);
    softmax_row(s, width, rows[r].lo - base, rows[r].pos - base, value_scale);
  }
  for (int r0 = 0; r0 < R; r0 += kPvRows) {
    const int nr = std::min(kPvRows, R - r0);
    staged.resize(size_t(width) * nr);
    for (int j = 0; j < width; ++j)
      for (int r = 0; r < nr; ++r) staged[size_t(j) * nr + r] = scores[size_t(r0 + r) * width + j];
    for (int d0 = 0; d0 < D; d0 += kPvSlab) pv_rows<T>(nr, c, g, rows.data() + r0, chunks, base, staged.data(), d0);
  }
#else
  for (int r = 0; r < R; ++r) {
    float* s = scores.data() + size_t(r) * width;
    const int first = rows[r].lo - base, last = rows[r].pos - base;
    float mx = -INFINITY;
    for (const KeyChunk& ch : chunks)
      for (int k = 0; k < ch.n; ++k) {
        const int i = ch.j - base + k;
        if (i < first || i > last) continue;
        const T* kt = c.k_tile<T>(ch.block, g) + ch.col + k;
        float acc = 0.0f;
        for (int d = 0; d < D; ++d) acc = std::fma(rows[r].q[d], load1(kt + int64_t(d) * B), acc);
        s[i] = acc * score_scale;
        if (softcap > 0) soft_cap(s + i, 1, softcap);
        mx = std::max(mx, s[i]);
      }
    float lane_sum[kLanes] = {0};
    for (int i = first; i <= last; ++i) lane_sum[i % kLanes] += (s[i] = std::exp(s[i] - mx));
    float sum = 0.0f;
    for (float x : lane_sum) sum += x;
    for (int i = first; i <= last; ++i) s[i] *= value_scale / sum;
    std::fill(rows[r].out, rows[r].out + D, 0.0f);
    for (const KeyChunk& ch : chunks)
      for (int k = 0; k < ch.n; ++k) {
        const int i = ch.j - base + k;
        if (i < first || i > last) continue;
        const T* v = c.v_tile<T>(ch.block, g) + int64_t(ch.col + k) * D;
        for (int d = 0; d < D; ++d) rows[r].out[d] = std::fma(s[i], load1(v + d), rows[r].out[d]);
      }
  }
#endif
}

}  // namespace

int kv_element_bytes(KvElement element) {
  return element == KvElement::kFloat32 ? 4 : element == KvElement::kBf16 ? 2 : 1;
}

void write_kv(const PagedKvLayer& cache, const int* block_table, int position, const float* k, const float* v) {
  if (cache.element == KvElement::kBf16) return write_kv_bf16(cache, block_table, position, k, v);
  const int block = block_table[position / cache.tokens_per_block];
  const int col = position % cache.tokens_per_block;
  const int D = cache.head_dim, B = cache.tokens_per_block;
  for (int g = 0; g < cache.num_kv_heads; ++g) {
    const float* kg = k + int64_t(g) * D;
    const float* vg = v + int64_t(g) * D;
    if (cache.element == KvElement::kFloat32) {
      float* kt = cache.k_tile<float>(block, g) + col;
      for (int d = 0; d < D; ++d) kt[int64_t(d) * B] = kg[d];
      std::memcpy(cache.v_tile<float>(block, g) + int64_t(col) * D, vg, sizeof(float) * D);
      continue;
    }
    uint8_t* kt = cache.k_tile<uint8_t>(block, g) + col;
    uint8_t* vq = cache.v_tile<uint8_t>(block, g) + int64_t(col) * D;
    for (int d = 0; d < D; ++d) {
      kt[int64_t(d) * B] = e4m3_bits(round_to_e4m3(kg[d] / cache.k_scale));
      vq[d] = e4m3_bits(round_to_e4m3(vg[d] / cache.v_scale));
    }
  }
}

void paged_attention(ThreadPool& pool, const PagedKvLayer& cache, const std::vector<AttentionSequence>& seqs,
                     const float* q, int64_t q_stride, int num_heads, int window, float scale, float softcap,
                     float* out) {
  if (cache.element == KvElement::kBf16)
    return paged_attention_bf16(pool, cache, seqs, q, q_stride, num_heads, window, scale, softcap, out);
  // Work items are tiles: a few query tokens of one sequence times the heads sharing one kv
  // head (GQA), so each K/V element loaded serves every row of the tile. Causal attention
  // makes late tokens dearer than early ones; tiles are listed by token and dealt in zigzag
  // order (first, last, second, second-to-last, ...), so contiguous thread ranges get
  // similar amounts of work.
  struct Tile {
    int seq, kv_head, t0, num_tokens;
  };
  const int group = num_heads / cache.num_kv_heads, D = cache.head_dim;
  const int tokens_per_tile = std::max(1, kTileRows / group);
  std::vector<Tile> tiles;
  for (int s = 0; s < int(seqs.size()); ++s)
    for (int t0 = 0; t0 < seqs[s].num_tokens; t0 += tokens_per_tile)
      for (int g = 0; g < cache.num_kv_heads; ++g)
        tiles.push_back({s, g, t0, std::min(tokens_per_tile, seqs[s].num_tokens - t0)});
  const int64_t n = int64_t(tiles.size());
  pool.parallel_for(n, [&](int64_t begin, int64_t end) {
    std::vector<QueryRow> rows;
    std::vector<KeyChunk> chunks;
    AlignedVector<float> scores, staged;
    for (int64_t k = begin; k < end; ++k) {
      const Tile& tile = tiles[(k % 2 == 0) ? k / 2 : n - 1 - k / 2];
      const AttentionSequence& seq = seqs[tile.seq];
      rows.clear();
      for (int t = tile.t0; t < tile.t0 + tile.num_tokens; ++t) {
        const int64_t row = seq.token_offset + t;
        const int pos = seq.context_len + t, lo = window > 0 ? std::max(0, pos - window + 1) : 0;
        for (int h = tile.kv_head * group; h < (tile.kv_head + 1) * group; ++h)
          rows.push_back({q + row * q_stride + int64_t(h) * D, out + (row * num_heads + h) * D, lo, pos});
      }
      if (cache.element == KvElement::kE4M3)
        attention_tile<uint8_t>(cache, tile.kv_head, seq.block_table, rows, scale, softcap, chunks, scores, staged);
      else
        attention_tile<float>(cache, tile.kv_head, seq.block_table, rows, scale, softcap, chunks, scores, staged);
    }
  });
}

}  // namespace precast
