#include "bf16_gemm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "bf16.h"
#include "cpu_features.h"
#include "quantize.h"
#include "vec_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PRECAST_BF16_DOTS 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PRECAST_AMX 1
#endif
#endif

namespace precast {

bool dot_unit_available(DotUnit unit) {
  switch (unit) {
    case DotUnit::kFloat32:
      return true;
    case DotUnit::kAvx512Bf16:
#ifdef PRECAST_BF16_DOTS
      return cpu_features().avx512_bf16 && cpu_features().avx512bw;
#else
      return false;
#endif
    case DotUnit::kAmx:
#ifdef PRECAST_AMX
      return cpu_features().amx_bf16;
#else
      return false;
#endif
  }
  return false;
}

std::string dot_unit_name(DotUnit unit) {
  switch (unit) {
    case DotUnit::kAvx512Bf16:
      return "avx512_bf16";
    case DotUnit::kAmx:
      return "amx";
    default:
      return "float32";
  }
}

DotUnit parse_dot_unit(const std::string& name) {
  if (name == "auto") return dot_unit();
  for (DotUnit unit : {DotUnit::kFloat32, DotUnit::kAvx512Bf16, DotUnit::kAmx}) {
    if (name != dot_unit_name(unit)) continue;
    if (!dot_unit_available(unit))
      throw std::invalid_argument("dot-product unit '" + name + "' is not available on this CPU or in this build");
    return unit;
  }
  throw std::invalid_argument("unknown dot-product unit '" + name + "': use auto, amx, avx512_bf16 or float32");
}

DotUnit dot_unit() {
  static const DotUnit unit = [] {
    const char* chosen = std::getenv("PRECAST_CPU_DOT");
    if (chosen && *chosen && std::string(chosen) != "auto") return parse_dot_unit(chosen);
    if (dot_unit_available(DotUnit::kAmx)) return DotUnit::kAmx;
    if (dot_unit_available(DotUnit::kAvx512Bf16)) return DotUnit::kAvx512Bf16;
    return DotUnit::kFloat32;
  }();
  return unit;
}

bool multiplies_in_bf16(WeightDtype dtype, int cols, int group_size, DotUnit unit) {
  const bool exact_or_quantized = dtype == WeightDtype::kBF16 || dtype == WeightDtype::kFP8 ||
                                  dtype == WeightDtype::kNVFP4 || (dtype == WeightDtype::kINT4 && group_size % 32 == 0);
  return unit != DotUnit::kFloat32 && exact_or_quantized && cols % 32 == 0 && dot_unit_available(unit);
}

#ifdef PRECAST_BF16_DOTS
namespace {

// Weights widened on demand (one row block: a decode step) are consumed one AMX step at a time,
// 16 pairs x 64 outputs x 2 bf16 = 4 KB, in two buffers taken in turn.
constexpr int kBlockPairs = 16;
constexpr int kPairBytes = kPanel * 4;       // one input pair of a panel, in bf16
constexpr int kPairValues = kPairBytes / 2;  // the same in uint16 values

constexpr float kE2m1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};

// Quantized weights widened to bf16 pairs (the layout of a bf16 panel, kernels.h), one input
// pair and 16 outputs (16v..16v+15, 64 bytes of bf16) at a time.
template <WeightDtype DT>
struct Widener {
  const PackedMatrix& m;
  const uint8_t* panel;
  int64_t p;
  int group[4] = {-1, -1, -1, -1};  // 4-bit: the group whose scales are loaded, per 16 outputs
  __m512 scales[8];                 // 4-bit: per output, repeated for the pair's two inputs

  Widener(const PackedMatrix& matrix, int64_t panel_index)
      : m(matrix), panel(matrix.data.data() + size_t(panel_index) * matrix.panel_bytes()), p(panel_index) {}

  inline void pair(int kp, int v, uint16_t* dst) {
    if constexpr (DT == WeightDtype::kFP8) {
      // Stored in pairs already; widened to bf16 of value x 256 (PackedMatrix::pack folds the 256
      // into out_scale) because that takes the fewest vector operations: a normal code's exponent
      // and mantissa shifted into place are or-ed with exponent 128 (exponent e - 7 + 127 + 8,
      // no addition needed); the eight subnormal magnitudes (m x 2^-9 x 256) come from a table;
      // the sign, already in bit 15 of the sign-extended byte, is or-ed in last.
      alignas(64) static const uint16_t kSubnormals[32] = {0, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4020, 0x4040, 0x4060};
      const uint8_t* bytes = panel + int64_t(kp) * 2 * kPanel;
      if (v % 2 == 0) prefetch_stream(bytes + 32 * v, kPrefetchQuantized);
      const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32 * v)));
      // (w << 4 & 0x07F0) | 0x4000; 0xEA: (a & b) | c.
      __m512i bits = _mm512_ternarylogic_epi32(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x07F0),
                                               _mm512_set1_epi16(0x4000), 0xEA);
      const __mmask32 subnormal = _mm512_testn_epi16_mask(w, _mm512_set1_epi16(0x78));
      bits = _mm512_mask_permutexvar_epi16(bits, subnormal, w, _mm512_load_si512(kSubnormals));  // index: m
      bits = _mm512_ternarylogic_epi32(bits, w, _mm512_set1_epi16(short(0x8000)), 0xF8);         // bits | (w & 0x8000)
      _mm512_storeu_si512(dst, bits);
    } else if constexpr (DT == WeightDtype::kINT4) {
      // Pair nibbles (kernels.h) -> the codes' exact bf16 values; the group scales multiply the
      // group's partial sums instead (GroupScales). 16 bytes -> 16 words -> low nibbles then high
      // nibbles -> one 16-entry table lookup.
      alignas(64) static const uint16_t kCodes[32] = {0,      0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                                      0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80};
      const uint8_t* bytes = panel + int64_t(kp) * kPanel;
      if (v == 0) prefetch_stream(bytes, kPrefetchQuantized);
      const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16 * v)));
      const __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(words, _mm256_set1_epi16(0xF))),
                                               _mm256_srli_epi16(words, 4), 1);
      _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(codes, _mm512_load_si512(kCodes)));
    } else {
      // nvfp4, stored in pair nibbles (kernels.h): 16 bytes give 16 outputs x 2 inputs, the low
      // nibbles the first 8 outputs' pairs and the high nibbles the next 8's, so one table lookup
      // each lands in pair order. E2M1 x E4M3 group scale is exact in bf16.
      if (2 * kp / m.group_size != group[v]) {  // group sizes are even: a pair never straddles two groups
        group[v] = 2 * kp / m.group_size;
        const int64_t at = m.group_at(p, group[v]) + 16 * v;
        const __m512 s = e4m3x16_div256(m.group_scales.data() + at);
        const __m512i first_eight = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        scales[2 * v] = _mm512_permutexvar_ps(first_eight, s);
        scales[2 * v + 1] = _mm512_permutexvar_ps(_mm512_add_epi32(first_eight, _mm512_set1_epi32(8)), s);
      }
      const uint8_t* bytes = panel + int64_t(kp) * kPanel;
      if (v == 0) prefetch_stream(bytes, kPrefetchQuantized);
      const __m512 lut = _mm512_loadu_ps(kE2m1);
      const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16 * v)));
      const __m512 first = _mm512_mul_ps(_mm512_permutexvar_ps(codes, lut), scales[2 * v]);  // low 4 bits index
      const __m512 next = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), lut), scales[2 * v + 1]);
      _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(next, first)));
    }
  }

  // Pairs [kp_begin, kp_end), all 64 outputs, into `out`.
  void pairs(int kp_begin, int kp_end, uint16_t* out) {
    for (int kp = kp_begin; kp < kp_end; ++kp)
      for (int v = 0; v < 4; ++v) pair(kp, v, out + int64_t(kp - kp_begin) * kPairValues + 32 * v);
  }
};

void widen(const PackedMatrix& m, int64_t p, int kp_begin, int kp_end, uint16_t* out) {
  switch (m.dtype) {
    case WeightDtype::kFP8:
      return Widener<WeightDtype::kFP8>(m, p).pairs(kp_begin, kp_end, out);
    case WeightDtype::kNVFP4:
      return Widener<WeightDtype::kNVFP4>(m, p).pairs(kp_begin, kp_end, out);
    default:
      return Widener<WeightDtype::kINT4>(m, p).pairs(kp_begin, kp_end, out);
  }
}

// int4: every group's partial sum (exact codes x bf16 activations) is multiplied by the group's
// float32 scales and added to the row's total, total = fma(partial, scale, total), group by group.
// Other formats have none (`scales` null): their single sum is the total.
struct GroupScales {
  const uint16_t* scales = nullptr;  // the panel's [group][kPanel] scales (bf16)
  int group_size = 0;

  GroupScales(const PackedMatrix& m, int64_t p) {
    if (m.dtype != WeightDtype::kINT4) return;
    group_size = m.group_size;
    scales = m.int4_scales(p, 0);
  }
  bool ends_group(int inputs_done) const { return scales && inputs_done % group_size == 0; }
  // total[r][0..64) += partial[r][0..64) x the scales of the group that ends before input `inputs_done`.
  void add(const float* partial, int rows, int inputs_done, float* total) const {
    const uint16_t* s = scales + int64_t(inputs_done / group_size - 1) * kPanel;
    for (int r = 0; r < rows; ++r)
      for (int v = 0; v < 4; ++v) {
        const int at = r * kPanel + 16 * v;
        _mm512_storeu_ps(total + at, _mm512_fmadd_ps(_mm512_loadu_ps(partial + at), widen_bf16x16(s + 16 * v),
                                                     _mm512_loadu_ps(total + at)));
      }
  }
};

// Where a row block reads its weight pairs from: a bf16 panel itself, a panel widened whole
// beforehand (many row blocks share it), or a block widened on demand into L1 (one row block:
// a decode step reads each weight once).
struct PairSource {
  const PackedMatrix& m;
  int64_t p;
  const uint16_t* whole;  // the panel's pairs, or null: widen on demand into `blocks`
  uint16_t* blocks;       // two blocks of kBlockPairs pairs
  int next = 0;
  bool streamed = false;  // `whole` is read by one row block only (a decode step): prefetch it

  const uint16_t* pairs(int kp_begin, int kp_end) {
    if (whole) return whole + int64_t(kp_begin) * kPairValues;
    uint16_t* block = blocks + (next ^= 1) * kBlockPairs * kPairValues;
    widen(m, p, kp_begin, kp_end, block);
    return block;
  }
};

// AVX512-BF16: NR rows x 64 outputs in 4 x NR float32 accumulators; per input pair one
// broadcast of the row's two bf16 activations and four VDPBF16PS. Results into tmp[NR][64].
template <int NR>
void avx512_rows(const uint16_t* x, int cols, PairSource& source, const GroupScales& groups, float* tmp) {
  __m512 acc[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  if (groups.scales) std::fill(tmp, tmp + NR * kPanel, 0.0f);
  alignas(64) float partial[NR * kPanel];
  const int num_pairs = cols / 2;
  for (int kb = 0; kb < num_pairs; kb += kBlockPairs) {
    const int ke = std::min(num_pairs, kb + kBlockPairs);
    const uint16_t* b = source.pairs(kb, ke);
    for (int kp = kb; kp < ke; ++kp) {
      const uint16_t* bk = b + int64_t(kp - kb) * kPairValues;
      if (source.streamed)
        for (int line = 0; line < kPairBytes / 64; ++line) prefetch_stream(bk + 32 * line, kPrefetchBf16);
      const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(bk));
      const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(bk + 32));
      const __m512bh w2 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(bk + 64));
      const __m512bh w3 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(bk + 96));
      for (int r = 0; r < NR; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + int64_t(r) * cols + 2 * kp, 4);
        const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xb, w2);
        acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xb, w3);
      }
    }
    if (groups.ends_group(2 * ke)) {
      for (int r = 0; r < NR; ++r)
        for (int v = 0; v < 4; ++v) {
          _mm512_storeu_ps(partial + r * kPanel + 16 * v, acc[r][v]);
          acc[r][v] = _mm512_setzero_ps();
        }
      groups.add(partial, NR, 2 * ke, tmp);
    }
  }
  if (!groups.scales)
    for (int r = 0; r < NR; ++r)
      for (int v = 0; v < 4; ++v) _mm512_storeu_ps(tmp + r * kPanel + 16 * v, acc[r][v]);
}

#ifdef PRECAST_AMX
// Tiles 0-3: C, `rows` x 16 float32 outputs each (outputs 16v..16v+15); tile 4: A, `rows` x 32
// bf16 activations; tiles 5 and 6: B, 16 input pairs x 16 outputs.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace

void configure_amx_tiles(int rows) {
  TileConfig c;
  for (int t = 0; t < 7; ++t) {
    c.bytes_per_row[t] = 64;
    c.rows[t] = uint8_t(t < 5 ? rows : 16);
  }
  _tile_loadconfig(&c);
}

namespace {

// AMX: up to 16 rows x 64 outputs; per 32 inputs one A tile and four B tiles, four TDPBF16PS.
// A row's result does not depend on the number of rows in the tile (tested).
inline void store_tiles(float* out) {
  _tile_stored(0, out, kPanel * 4);
  _tile_stored(1, out + 16, kPanel * 4);
  _tile_stored(2, out + 32, kPanel * 4);
  _tile_stored(3, out + 48, kPanel * 4);
}

inline void zero_tiles() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// At the end of an int4 group: its partial sums into the totals, and the tiles start again from zero.
inline void end_group(const GroupScales& groups, int rows, int inputs_done, float* partial, float* total) {
  store_tiles(partial);
  zero_tiles();
  groups.add(partial, rows, inputs_done, total);
}

void amx_rows(const uint16_t* x, int cols, int rows, PairSource& source, const GroupScales& groups, float* tmp) {
  alignas(64) float partial[16 * kPanel];
  if (groups.scales) std::fill(tmp, tmp + rows * kPanel, 0.0f);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int num_pairs = cols / 2;
  for (int kb = 0; kb < num_pairs; kb += kBlockPairs) {
    const int ke = std::min(num_pairs, kb + kBlockPairs);
    const uint16_t* b = source.pairs(kb, ke);
    for (int kp = kb; kp < ke; kp += 16) {
      const uint16_t* bk = b + int64_t(kp - kb) * kPairValues;
      if (source.streamed)  // 16 pairs x 64 outputs of bf16, 64 lines, each read once
        for (int line = 0; line < 16 * kPairBytes / 64; ++line) prefetch_stream(bk + 32 * line, kPrefetchBf16);
      _tile_loadd(4, x + 2 * kp, cols * 2);
      _tile_loadd(5, bk, kPairBytes);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, bk + 32, kPairBytes);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, bk + 64, kPairBytes);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, bk + 96, kPairBytes);
      _tile_dpbf16ps(3, 4, 6);
      if (groups.ends_group(2 * (kp + 16))) end_group(groups, rows, 2 * (kp + 16), partial, tmp);
    }
  }
  if (!groups.scales) store_tiles(tmp);
}
#endif

#ifdef PRECAST_AMX
// AMX for one row block of quantized weights widened on demand (a decode step): the vector unit
// widens the next step's 16 pairs, a quarter of the outputs at a time, between the tile unit's
// four multiplications of the current step, so the two units work side by side (widening whole
// blocks first would fill the reorder buffer and leave the tile unit idle). The same
// instructions on the same values as amx_rows.
template <WeightDtype DT>
void amx_rows_streaming(const uint16_t* x, int cols, int rows, const PackedMatrix& m, int64_t p,
                        const GroupScales& groups, uint16_t* buffers, float* tmp) {
  alignas(64) float partial[16 * kPanel];
  if (groups.scales) std::fill(tmp, tmp + rows * kPanel, 0.0f);
  Widener<DT> widener(m, p);
  const int steps = cols / 32;
  widener.pairs(0, 16, buffers);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int s = 0; s < steps; ++s) {
    const uint16_t* cur = buffers + (s % 2) * 16 * kPairValues;
    uint16_t* nxt = buffers + ((s + 1) % 2) * 16 * kPairValues;
    const bool more = s + 1 < steps;
    auto widen_next = [&](int v) {
      if (more)
        for (int k = 0; k < 16; ++k) widener.pair(16 * (s + 1) + k, v, nxt + k * kPairValues + 32 * v);
    };
    _tile_loadd(4, x + 32 * s, cols * 2);
    widen_next(0);
    _tile_loadd(5, cur, kPairBytes);
    _tile_dpbf16ps(0, 4, 5);
    widen_next(1);
    _tile_loadd(6, cur + 32, kPairBytes);
    _tile_dpbf16ps(1, 4, 6);
    widen_next(2);
    _tile_loadd(5, cur + 64, kPairBytes);
    _tile_dpbf16ps(2, 4, 5);
    widen_next(3);
    _tile_loadd(6, cur + 96, kPairBytes);
    _tile_dpbf16ps(3, 4, 6);
    if (groups.ends_group(32 * (s + 1))) end_group(groups, rows, 32 * (s + 1), partial, tmp);
  }
  if (!groups.scales) store_tiles(tmp);
}

void amx_rows_streaming_any(const uint16_t* x, int cols, int rows, const PackedMatrix& m, int64_t p,
                            const GroupScales& groups, uint16_t* buffers, float* tmp) {
  switch (m.dtype) {
    case WeightDtype::kFP8:
      return amx_rows_streaming<WeightDtype::kFP8>(x, cols, rows, m, p, groups, buffers, tmp);
    case WeightDtype::kNVFP4:
      return amx_rows_streaming<WeightDtype::kNVFP4>(x, cols, rows, m, p, groups, buffers, tmp);
    default:
      return amx_rows_streaming<WeightDtype::kINT4>(x, cols, rows, m, p, groups, buffers, tmp);
  }
}
#endif

void avx512_rows_any(int rows, const uint16_t* x, int cols, PairSource& source, const GroupScales& g, float* tmp) {
  switch (rows) {
    case 6:
      return avx512_rows<6>(x, cols, source, g, tmp);
    case 5:
      return avx512_rows<5>(x, cols, source, g, tmp);
    case 4:
      return avx512_rows<4>(x, cols, source, g, tmp);
    case 3:
      return avx512_rows<3>(x, cols, source, g, tmp);
    case 2:
      return avx512_rows<2>(x, cols, source, g, tmp);
    default:
      return avx512_rows<1>(x, cols, source, g, tmp);
  }
}

}  // namespace

void round_to_bf16(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i))));
  for (; i < n; ++i) out[i] = bf16_bits(x[i]);
}

void linear_bf16(ThreadPool& pool, const float* x, int num_rows, const PackedMatrix& w, const float* bias,
                 float input_scale, const float* row_scales, float* y) {
  if (w.dot == DotUnit::kFloat32 || w.cols % 32) throw std::invalid_argument("matrix is not packed for bf16 dots");
  const int cols = w.cols;
  AlignedVector<uint16_t> xb(size_t(num_rows) * cols);
  pool.parallel_for(num_rows, [&](int64_t begin, int64_t end) {
    round_to_bf16(x + begin * cols, (end - begin) * cols, xb.data() + begin * cols);
  });
  const bool amx = w.dot == DotUnit::kAmx;
  const int block_rows = amx ? 16 : 6;
  const float out_scale = w.out_scale * input_scale;
  const PanelWork work(num_rows, w.rows);
  pool.parallel_for(work.items(), [&](int64_t begin, int64_t end) {
    thread_local AlignedVector<uint16_t> widened;  // one whole panel as bf16 pairs (many row blocks)
    alignas(64) uint16_t blocks[2 * kBlockPairs * kPairValues];
    alignas(64) float tmp[16 * kPanel];
    int configured_rows = 0;     // tile configuration: loaded by the first AMX row block of this call
    int64_t widened_panel = -1;  // the panel `widened` holds for this chunk of items
    for (int64_t i = begin; i < end; ++i) {
      const PanelWork::Item item = work.item(i);
      const int64_t p = item.panel, r0 = item.first_row;
      const int n = item.num_rows;
      PairSource source{w, p, nullptr, blocks};
      const GroupScales groups(w, p);
      if (w.dtype == WeightDtype::kBF16) {
        source.whole = reinterpret_cast<const uint16_t*>(w.data.data() + size_t(p) * w.panel_bytes());
      } else if (n > block_rows) {
        if (widened_panel != p) {  // items are panel-major: a panel's row chunks follow one another
          widened.resize(size_t(cols / 2) * kPairValues);
          widen(w, p, 0, cols / 2, widened.data());
          widened_panel = p;
        }
        source.whole = widened.data();
      }
      for (int rb = 0; rb < n; rb += block_rows) {
        const int m = std::min(block_rows, n - rb);
        // A bf16 panel comes from memory for the first row block of its first chunk, from cache after.
        if (w.dtype == WeightDtype::kBF16) source.streamed = rb == 0 && item.first_chunk();
        const uint16_t* xr = xb.data() + (r0 + rb) * int64_t(cols);
#ifdef PRECAST_AMX
        if (amx) {
          if (configured_rows != m) configure_amx_tiles(m);
          configured_rows = m;
          if (source.whole)
            amx_rows(xr, cols, m, source, groups, tmp);
          else
            amx_rows_streaming_any(xr, cols, m, w, p, groups, blocks, tmp);
        } else {
          avx512_rows_any(m, xr, cols, source, groups, tmp);
        }
#else
        avx512_rows_any(m, xr, cols, source, groups, tmp);
#endif
        write_panel_rows(tmp, m, y + (r0 + rb) * int64_t(w.rows), w.rows, p, out_scale,
                         row_scales ? row_scales + r0 + rb : nullptr, bias);
      }
    }
#ifdef PRECAST_AMX
    if (configured_rows) _tile_release();  // the 8 KB tile state costs every context switch while live
#endif
  });
}
#else
void linear_bf16(ThreadPool&, const float*, int, const PackedMatrix&, const float*, float, const float*, float*) {
  throw std::invalid_argument("this build of precast has no bf16 dot-product kernels");
}
#endif

}  // namespace precast
