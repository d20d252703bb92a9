// Paged attention over a bf16 KV cache (KvElement::kBf16, paged_attention.h) on the CPU's bf16
// dot-product units: AMX tiles where this process multiplies on them, else AVX512-BF16
// (dot_unit(), bf16_gemm.h). An engine whose layers multiply in bf16 keeps its cache in bf16, as
// HF's bf16 models do: half the bytes of a float32 cache, and QK and PV on the units that multiply
// its weights (float32 FMA attention was a third of a 2048-token prefill of a 1.5B model).
//
// A tile is up to 16 query rows of one sequence and kv head (the GQA group x a few tokens). Its keys
// run from `base`, the first row's window start rounded down to a multiple of 32, to the last row's
// position, in steps of 32 keys that each lie in one cache block. Per tile:
//   QK: scores[row][key] = q . k over head_dim in order (q rounded to bf16): head_dim / 32 TDPBF16PS
//       per 16 keys, or head_dim / 2 VDPBF16PS; then * scale and soft-capping in float32;
//   softmax in float32 over each row's own keys (vec_math.h); probabilities rounded to bf16, exactly
//   0 outside the row's range;
//   PV: out[row] = sum over steps of p . v: one TDPBF16PS per step and 16 outputs, or 16 VDPBF16PS
//       over key pairs.
// Invariance: a row's scores and outputs are fixed sequences of instructions over its own q and p
// and the cache, from an aligned key position, adding exact zeros for keys outside its range; the
// rows beside it in the tile and the tile's key range change nothing (AMX rows are independent).
// So decode steps, prefill chunks and batches give bit-identical rows (tests/runtime/test_executor.py).
// The last step's V is copied with zeros past the last written key: cache memory there is
// uninitialised, and 0 x NaN would be NaN.
#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "bf16_gemm.h"
#include "kernels.h"
#include "paged_attention.h"
#include "vec_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PRECAST_ATTN_BF16 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PRECAST_ATTN_AMX 1
#endif
#endif

namespace precast {

bool bf16_kv_supported(int tokens_per_block, int head_dim) {
#ifdef PRECAST_ATTN_BF16
  return dot_unit() != DotUnit::kFloat32 && tokens_per_block % 32 == 0 && head_dim % 32 == 0;
#else
  (void)tokens_per_block, (void)head_dim;
  return false;
#endif
}

#ifdef PRECAST_ATTN_BF16
namespace {

constexpr int kStep = 32;     // keys per step: one AMX A-tile row of probabilities
constexpr int kMaxRows = 16;  // query rows per tile: an AMX tile's rows
constexpr int kQkRows = 6;    // VDPBF16PS: rows per QK pass, 6 rows x 2 key vectors = 12 accumulators
constexpr int kPvRows = 4;    // VDPBF16PS: rows per PV pass, 4 rows x 4 output vectors = 16 accumulators

// Element offsets inside a tile (layouts in paged_attention.h): element d of token col's K, and of its V.
inline int64_t k_at(int tokens_per_block, int d, int col) {
  return int64_t(d / 2) * 2 * tokens_per_block + 2 * col + (d & 1);
}
inline int64_t v_at(int head_dim, int col, int d) { return int64_t(col / 2) * 2 * head_dim + 2 * d + (col & 1); }

struct Tile {
  int seq, kv_head, t0, num_tokens, h0, num_heads;
};

struct Row {
  const float* q;
  float* out;
  int lo, pos;
};

// One thread's buffers, reused from tile to tile.
struct Scratch {
  AlignedVector<uint16_t> q;       // [16][head_dim] bf16, rows past the tile's zero
  AlignedVector<float> scores;     // [16][width]
  AlignedVector<uint16_t> p;       // [16][width] bf16, rows past the tile's zero
  AlignedVector<uint16_t> v_tail;  // the last step's V pairs, zeros past the last key
  AlignedVector<float> out;        // [16][head_dim]
};

// Where a tile's steps read: step s covers keys [base + 32 s, base + 32 s + 32) of one block.
struct Steps {
  const PagedKvLayer* c;
  int kv_head, base, end, count;
  const int* block_table;
  const uint16_t* k(int s) const {
    const int j = base + kStep * s;
    return c->k_tile<uint16_t>(block_table[j / c->tokens_per_block], kv_head) + 2 * (j % c->tokens_per_block);
  }
  const uint16_t* last_v = nullptr;  // the last step's V when it reaches past `end` (pad_last_step)
  // V pairs of step s: the cache itself, or the padded copy of the last step.
  const uint16_t* v(int s) const {
    const int j = base + kStep * s;
    if (s == count - 1 && last_v) return last_v;
    return c->v_tile<uint16_t>(block_table[j / c->tokens_per_block], kv_head) +
           int64_t(j % c->tokens_per_block) * c->head_dim;
  }
  // If the last step reaches past `end`, copies its V into `tail` with zeros there, once per tile.
  void pad_last_step(AlignedVector<uint16_t>& tail) {
    const int n = end - (base + kStep * (count - 1)), D = c->head_dim;
    last_v = nullptr;
    if (n >= kStep) return;
    const uint16_t* src = v(count - 1);
    tail.assign(size_t(kStep) * D, 0);
    std::memcpy(tail.data(), src, sizeof(uint16_t) * 2 * D * (n / 2));
    if (n % 2)
      for (int d = 0; d < D; ++d) tail[v_at(D, n - 1, d)] = src[v_at(D, n - 1, d)];
    last_v = tail.data();
  }
};

#ifdef PRECAST_ATTN_AMX
// Tile registers (configure_amx_tiles(16)): 0-3 C, 4 A, 5-6 B. C += A x (B loaded from `b`); the
// intrinsics take register numbers as literals, hence a macro.
#define PRECAST_AMX_DOT(c, b_tile, b, b_stride) \
  do {                                          \
    _tile_loadd(b_tile, b, b_stride);           \
    _tile_dpbf16ps(c, 4, b_tile);               \
  } while (0)

void amx_scores(const Steps& st, const uint16_t* q, float* scores, int width) {
  const int D = st.c->head_dim, B = st.c->tokens_per_block;
  for (int s = 0; s < st.count; ++s) {
    const uint16_t* k = st.k(s);
    _tile_zero(0);
    _tile_zero(1);
    for (int d0 = 0; d0 < D; d0 += 32) {
      _tile_loadd(4, q + d0, D * 2);
      PRECAST_AMX_DOT(0, 5, k + k_at(B, d0, 0), 4 * B);
      PRECAST_AMX_DOT(1, 6, k + k_at(B, d0, 16), 4 * B);
    }
    _tile_stored(0, scores + kStep * s, width * 4);
    _tile_stored(1, scores + kStep * s + 16, width * 4);
  }
}

void amx_values(const Steps& st, const uint16_t* p, int width, float* out) {
  const int D = st.c->head_dim;
  for (int d0 = 0; d0 < D; d0 += 64) {
    const bool four = d0 + 64 <= D;  // head_dim is a multiple of 32: 4 or 2 output tiles
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int s = 0; s < st.count; ++s) {
      const uint16_t* v = st.v(s) + 2 * d0;
      _tile_loadd(4, p + kStep * s, width * 2);
      PRECAST_AMX_DOT(0, 5, v, 4 * D);
      PRECAST_AMX_DOT(1, 6, v + 32, 4 * D);
      if (four) {
        PRECAST_AMX_DOT(2, 5, v + 64, 4 * D);
        PRECAST_AMX_DOT(3, 6, v + 96, 4 * D);
      }
    }
    _tile_stored(0, out + d0, D * 4);
    _tile_stored(1, out + d0 + 16, D * 4);
    if (four) {
      _tile_stored(2, out + d0 + 32, D * 4);
      _tile_stored(3, out + d0 + 48, D * 4);
    }
  }
}
#endif

inline __m512bh bf16_pairs(__m512i x) { return reinterpret_cast<__m512bh>(x); }

// VDPBF16PS: scores of NR rows for each step, 2 x 16 keys at a time.
template <int NR>
void dot_scores(const Steps& st, const uint16_t* q, float* scores, int width) {
  const int D = st.c->head_dim, B = st.c->tokens_per_block;
  const uint32_t* q_pairs = reinterpret_cast<const uint32_t*>(q);
  for (int s = 0; s < st.count; ++s) {
    const uint16_t* k = st.k(s);
    __m512 a0[NR], a1[NR];
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 2) {
      const __m512bh ka = bf16_pairs(_mm512_loadu_si512(k + k_at(B, d, 0)));
      const __m512bh kb = bf16_pairs(_mm512_loadu_si512(k + k_at(B, d, 16)));
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) {
        const __m512bh qp = bf16_pairs(_mm512_set1_epi32(int(q_pairs[r * (D / 2) + d / 2])));
        a0[r] = _mm512_dpbf16_ps(a0[r], ka, qp);
        a1[r] = _mm512_dpbf16_ps(a1[r], kb, qp);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) {
      _mm512_storeu_ps(scores + int64_t(r) * width + kStep * s, a0[r]);
      _mm512_storeu_ps(scores + int64_t(r) * width + kStep * s + 16, a1[r]);
    }
  }
}

// VDPBF16PS: out[NR rows][d0 .. d0 + 16 NV) over the steps' key pairs in order.
template <int NR, int NV>
void dot_values(const Steps& st, const uint16_t* p, int width, int d0, float* out) {
  const int D = st.c->head_dim;
  const uint32_t* p_pairs = reinterpret_cast<const uint32_t*>(p);
  __m512 acc[NR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int s = 0; s < st.count; ++s) {
    const uint16_t* vs = st.v(s) + 2 * d0;
    for (int kp = 0; kp < kStep / 2; ++kp, vs += 2 * D) {
      __m512bh w[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) w[v] = bf16_pairs(_mm512_loadu_si512(vs + 32 * v));
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) {
        const __m512bh pp = bf16_pairs(_mm512_set1_epi32(int(p_pairs[r * (width / 2) + (kStep / 2) * s + kp])));
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], w[v], pp);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + int64_t(r) * D + d0 + 16 * v, acc[r][v]);
}

template <int NR = kQkRows>
void dot_scores_rows(int nr, const Steps& st, const uint16_t* q, float* scores, int width) {
  if constexpr (NR > 1) {
    if (nr < NR) return dot_scores_rows<NR - 1>(nr, st, q, scores, width);
  }
  dot_scores<NR>(st, q, scores, width);
}

template <int NR = kPvRows>
void dot_values_rows(int nr, const Steps& st, const uint16_t* p, int width, int d0, float* out) {
  if constexpr (NR > 1) {
    if (nr < NR) return dot_values_rows<NR - 1>(nr, st, p, width, d0, out);
  }
  if (d0 + 64 <= st.c->head_dim)
    dot_values<NR, 4>(st, p, width, d0, out);
  else
    dot_values<NR, 2>(st, p, width, d0, out);
}

void attention_tile(bool amx, Steps& st, const Row* rows, int num_rows, float scale, float softcap, Scratch& w) {
  const int D = st.c->head_dim, width = st.count * kStep;
  w.q.resize(size_t(kMaxRows) * D);
  w.scores.resize(size_t(kMaxRows) * width);
  w.p.resize(size_t(kMaxRows) * width);
  w.out.resize(size_t(kMaxRows) * D);
  for (int r = 0; r < num_rows; ++r) round_to_bf16(rows[r].q, D, w.q.data() + size_t(r) * D);
  // AMX tiles read all kMaxRows rows: rows past num_rows must be zeros (finite). AVX-512 reads num_rows rows only.
  if (amx) std::fill(w.q.begin() + size_t(num_rows) * D, w.q.end(), uint16_t(0));
#ifdef PRECAST_ATTN_AMX
  if (amx) amx_scores(st, w.q.data(), w.scores.data(), width);
#endif
  if (!amx)
    for (int r0 = 0; r0 < num_rows; r0 += kQkRows)
      dot_scores_rows(std::min(kQkRows, num_rows - r0), st, w.q.data() + size_t(r0) * D,
                      w.scores.data() + size_t(r0) * width, width);
  for (int r = 0; r < num_rows; ++r) {
    float* s = w.scores.data() + size_t(r) * width;
    const int first = rows[r].lo - st.base, last = rows[r].pos - st.base;
    for (int i = first; i <= last; ++i) s[i] *= scale;
    if (softcap > 0) soft_cap(s + first, last - first + 1, softcap);
    softmax_row(s, width, first, last, 1.0f);
    round_to_bf16(s, width, w.p.data() + size_t(r) * width);
  }
  if (amx) std::fill(w.p.begin() + size_t(num_rows) * width, w.p.end(), uint16_t(0));
  st.pad_last_step(w.v_tail);
#ifdef PRECAST_ATTN_AMX
  if (amx) amx_values(st, w.p.data(), width, w.out.data());
#endif
  if (!amx)
    for (int r0 = 0; r0 < num_rows; r0 += kPvRows)
      for (int d0 = 0; d0 < D; d0 += 64)
        dot_values_rows(std::min(kPvRows, num_rows - r0), st, w.p.data() + size_t(r0) * width, width, d0,
                        w.out.data() + size_t(r0) * D);
  for (int r = 0; r < num_rows; ++r) std::memcpy(rows[r].out, w.out.data() + size_t(r) * D, sizeof(float) * D);
}

}  // namespace

void write_kv_bf16(const PagedKvLayer& cache, const int* block_table, int position, const float* k, const float* v) {
  const int B = cache.tokens_per_block, D = cache.head_dim;
  const int block = block_table[position / B], col = position % B;
  thread_local AlignedVector<uint16_t> rounded;
  rounded.resize(size_t(2) * D);
  for (int g = 0; g < cache.num_kv_heads; ++g) {
    round_to_bf16(k + int64_t(g) * D, D, rounded.data());
    round_to_bf16(v + int64_t(g) * D, D, rounded.data() + D);
    uint16_t* kt = cache.k_tile<uint16_t>(block, g);
    uint16_t* vt = cache.v_tile<uint16_t>(block, g);
    for (int d = 0; d < D; ++d) {
      kt[k_at(B, d, col)] = rounded[d];
      vt[v_at(D, col, d)] = rounded[D + d];
    }
  }
}

void paged_attention_bf16(ThreadPool& pool, const PagedKvLayer& cache, const std::vector<AttentionSequence>& seqs,
                          const float* q, int64_t q_stride, int num_heads, int window, float scale, float softcap,
                          float* out) {
  // Tiles and their zigzag order as in paged_attention (paged_attention.cpp); a GQA group wider
  // than a tile is split by heads.
  const int group = num_heads / cache.num_kv_heads, D = cache.head_dim;
  const int heads_per_tile = std::min(group, kMaxRows), tokens_per_tile = kMaxRows / heads_per_tile;
  std::vector<Tile> tiles;
  for (int s = 0; s < int(seqs.size()); ++s)
    for (int t0 = 0; t0 < seqs[s].num_tokens; t0 += tokens_per_tile)
      for (int g = 0; g < cache.num_kv_heads; ++g)
        for (int h0 = g * group; h0 < (g + 1) * group; h0 += heads_per_tile)
          tiles.push_back({s, g, t0, std::min(tokens_per_tile, seqs[s].num_tokens - t0), h0,
                           std::min(heads_per_tile, (g + 1) * group - h0)});
  const int64_t n = int64_t(tiles.size());
#ifdef PRECAST_ATTN_AMX
  const bool amx = dot_unit() == DotUnit::kAmx;
#else
  const bool amx = false;
#endif
  pool.parallel_for(n, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    Row rows[kMaxRows];
#ifdef PRECAST_ATTN_AMX
    if (amx) configure_amx_tiles(kMaxRows);
#endif
    for (int64_t k = begin; k < end; ++k) {
      const Tile& tile = tiles[(k % 2 == 0) ? k / 2 : n - 1 - k / 2];
      const AttentionSequence& seq = seqs[tile.seq];
      int num_rows = 0, lo = 1 << 30, last = 0;
      for (int t = tile.t0; t < tile.t0 + tile.num_tokens; ++t) {
        const int64_t row = seq.token_offset + t;
        const int pos = seq.context_len + t, first = window > 0 ? std::max(0, pos - window + 1) : 0;
        for (int h = tile.h0; h < tile.h0 + tile.num_heads; ++h)
          rows[num_rows++] = {q + row * q_stride + int64_t(h) * D, out + (row * num_heads + h) * D, first, pos};
        lo = std::min(lo, first), last = std::max(last, pos);
      }
      const int base = lo / kStep * kStep;
      Steps steps{&cache, tile.kv_head, base, last + 1, (last + 1 - base + kStep - 1) / kStep, seq.block_table};
      attention_tile(amx, steps, rows, num_rows, scale, softcap, scratch);
    }
#ifdef PRECAST_ATTN_AMX
    if (amx) _tile_release();
#endif
  });
}
#else
void write_kv_bf16(const PagedKvLayer&, const int*, int, const float*, const float*) {
  throw std::invalid_argument("this build of precast has no bf16 KV cache");
}
void paged_attention_bf16(ThreadPool&, const PagedKvLayer&, const std::vector<AttentionSequence>&, const float*,
                          int64_t, int, int, float, float, float*) {
  throw std::invalid_argument("this build of precast has no bf16 KV cache");
}
#endif

}  // namespace precast
