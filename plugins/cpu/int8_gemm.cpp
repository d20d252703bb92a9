#include "int8_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "cpu_features.h"
#include "vec_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define PRECAST_INT8_DOTS 1
#endif

namespace precast {

bool int4_multiplies_in_int8(DotUnit unit) {
#ifdef PRECAST_INT8_DOTS
  return unit == DotUnit::kAvx512Bf16 && cpu_features().avx512_vnni;
#else
  (void)unit;
  return false;
#endif
}

#ifdef PRECAST_INT8_DOTS
namespace {

// acc += unsigned bytes a . signed bytes b (VPDPBUSD), in inline assembly: with _mm512_dpbusd_epi32
// GCC 12 copied every accumulator to a scratch register and back (some through the stack) on each
// quad, 33 moves per 16 VPDPBUSD; in assembly the loop holds the dot products, the loads and the
// unpacking only (prefill and 32-way +8-9% at 4 rows, Qwen2.5-1.5B int4, AMD Zen 5).
inline void dpbusd(__m512i& acc, __m512i a, __m512i b) { asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b)); }

constexpr int kQuadBytes = 2 * kPanel;  // one input quad of a panel: 4 inputs x 64 outputs, nibbles
// 24 int32 accumulators, 4 weight vectors, a broadcast and the mask: 30 of the 32 vector registers.
constexpr int kBlockRows = 6;

// Activations of one call quantized per row and group (int8_gemm.h).
struct QuantizedRows {
  QuantizedRows(int num_rows, int cols, int groups)
      : values(size_t(num_rows) * cols),
        scales(size_t(num_rows) * groups),
        code_bias(size_t(num_rows) * groups),
        input_sums(size_t(num_rows) * groups) {}
  AlignedVector<int8_t> values;  // [rows][cols]
  std::vector<float> scales;     // [rows][groups]: amax / 127
  // [rows][groups]: -8 x the sum of the group's int8 values, where a group's accumulators start: the weight codes
  // are q + 8, so sum (q + 8) x8 starting from -8 sum x8 ends at sum q x8.
  std::vector<int32_t> code_bias;
  std::vector<float> input_sums;  // [rows][groups]: scale x the sum of the int8 values (asymmetric groups' offsets)
};

void quantize_row(const float* x, int cols, int group_size, int8_t* q, float* scales, int32_t* code_bias,
                  float* input_sums) {
  for (int g = 0; g < cols / group_size; ++g) {
    const float* xg = x + g * group_size;
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < group_size; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xg + i)));
    const float m = _mm512_reduce_max_ps(amax);
    const __m512 inv = _mm512_set1_ps(m > 0 ? 127.0f / m : 0.0f);
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < group_size; i += 16) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + i), inv));  // nearest even
      sum = _mm512_add_epi32(sum, v);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * group_size + i), _mm512_cvtsepi32_epi8(v));
    }
    const int32_t total = _mm512_reduce_add_epi32(sum);
    scales[g] = m / 127.0f;
    code_bias[g] = -8 * total;
    input_sums[g] = scales[g] * float(total);
  }
}

// NR rows x the 64 outputs of panel `p` into tmp[NR][64] (without out_scale and bias). Per input
// quad: the quad nibbles (kernels.h) give four vectors of unsigned codes u = q + 8 with two ands
// and a shift per 32 bytes, and each row's four int8 activations are broadcast to four VPDPBUSD.
// Per group: accumulators start at -8 sum x8, so they end at sum q x8 exactly; x activation scale x weight
// scale into tmp (the epilogue runs per output vector, its scales and offsets widened once for all rows).
template <int NR>
void vnni_rows(const QuantizedRows& xq, int64_t row0, const PackedMatrix& w, int64_t p, float* tmp) {
  const bool offsets = !w.group_offsets.empty();
  const int cols = w.cols, groups = int(w.groups()), quads_per_group = w.group_size / 4;
  const uint8_t* panel = w.data.data() + size_t(p) * w.panel_bytes();
  const int8_t* x = xq.values.data() + row0 * cols;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  std::fill(tmp, tmp + NR * kPanel, 0.0f);
  for (int g = 0; g < groups; ++g) {
    __m512i acc[NR][4];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const __m512i start = _mm512_set1_epi32(xq.code_bias[(row0 + r) * groups + g]);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) acc[r][v] = start;
    }
    for (int kq = g * quads_per_group; kq < (g + 1) * quads_per_group; ++kq) {
      // No software prefetch: on AMD Zen 5 the hardware prefetcher alone streamed a decode step 7-25%
      // faster than with vec_math.h's prefetch_stream (alternated runs, Qwen2.5-1.5B int4), prefill the same.
      const uint8_t* b = panel + int64_t(kq) * kQuadBytes;
      const __m512i first = _mm512_loadu_si512(b), second = _mm512_loadu_si512(b + 64);
      const __m512i w0 = _mm512_and_si512(first, low_nibbles);
      const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(first, 4), low_nibbles);
      const __m512i w2 = _mm512_and_si512(second, low_nibbles);
      const __m512i w3 = _mm512_and_si512(_mm512_srli_epi16(second, 4), low_nibbles);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
        int32_t quad;
        std::memcpy(&quad, x + int64_t(r) * cols + 4 * kq, 4);
        const __m512i xb = _mm512_set1_epi32(quad);
        dpbusd(acc[r][0], w0, xb);
        dpbusd(acc[r][1], w1, xb);
        dpbusd(acc[r][2], w2, xb);
        dpbusd(acc[r][3], w3, xb);
      }
    }
    const uint16_t* s = w.int4_scales(p, g);
    // Asymmetric groups: offset x the group's sum of the quantized inputs (scale x sum of codes).
    const uint16_t* off = offsets ? w.group_offsets.data() + w.group_at(p, g) : nullptr;
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      const __m512 scale = widen_bf16x16(s + 16 * v);
      const __m512 offset = off ? widen_bf16x16(off + 16 * v) : _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
        const int64_t at = (row0 + r) * groups + g;
        const __m512 partial = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][v]), _mm512_set1_ps(xq.scales[at]));
        float* out = tmp + r * kPanel + 16 * v;
        __m512 total = _mm512_fmadd_ps(partial, scale, _mm512_loadu_ps(out));
        if (off) total = _mm512_fmadd_ps(_mm512_set1_ps(xq.input_sums[at]), offset, total);
        _mm512_storeu_ps(out, total);
      }
    }
  }
}

void vnni_rows_any(int rows, const QuantizedRows& xq, int64_t row0, const PackedMatrix& w, int64_t p, float* tmp) {
  switch (rows) {
    case 6:
      return vnni_rows<6>(xq, row0, w, p, tmp);
    case 5:
      return vnni_rows<5>(xq, row0, w, p, tmp);
    case 4:
      return vnni_rows<4>(xq, row0, w, p, tmp);
    case 3:
      return vnni_rows<3>(xq, row0, w, p, tmp);
    case 2:
      return vnni_rows<2>(xq, row0, w, p, tmp);
    default:
      return vnni_rows<1>(xq, row0, w, p, tmp);
  }
}

}  // namespace

void linear_int4_int8(ThreadPool& pool, const float* x, int num_rows, const PackedMatrix& w, const float* bias,
                      float input_scale, const float* row_scales, float* y) {
  if (!w.multiplies_in_int8() || w.group_size % 32) throw std::invalid_argument("matrix is not packed for int8 dots");
  if (input_scale != 1.0f || row_scales)  // int4 layers take their inputs as they are (weight-only recipes)
    throw std::invalid_argument("int4 layers take no input scale");
  const int cols = w.cols, groups = int(w.groups());
  QuantizedRows xq(num_rows, cols, groups);
  pool.parallel_for(num_rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_row(x + r * cols, cols, w.group_size, xq.values.data() + r * cols, xq.scales.data() + r * groups,
                   xq.code_bias.data() + r * groups, xq.input_sums.data() + r * groups);
  });
  const PanelWork work(num_rows, w.rows);
  pool.parallel_for(work.items(), [&](int64_t begin, int64_t end) {
    alignas(64) float tmp[kBlockRows * kPanel];
    for (int64_t i = begin; i < end; ++i) {
      const PanelWork::Item item = work.item(i);
      for (int rb = 0; rb < item.num_rows; rb += kBlockRows) {
        const int m = std::min(kBlockRows, item.num_rows - rb);
        const int64_t row = item.first_row + rb;
        vnni_rows_any(m, xq, row, w, item.panel, tmp);
        write_panel_rows(tmp, m, y + row * w.rows, w.rows, item.panel, w.out_scale, nullptr, bias);
      }
    }
  });
}
#else
void linear_int4_int8(ThreadPool&, const float*, int, const PackedMatrix&, const float*, float, const float*, float*) {
  throw std::invalid_argument("this build of precast has no int8 dot-product kernels");
}
#endif

}  // namespace precast
