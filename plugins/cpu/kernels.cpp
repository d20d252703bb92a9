#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#include "bf16.h"
#include "bf16_gemm.h"
#include "int8_gemm.h"
#include "quantize.h"
#include "vec_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PRECAST_AVX512 1
#endif

namespace precast {
namespace {

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <WeightDtype DT>
inline float load_scalar(const void* base, int64_t i) {
  if constexpr (DT == WeightDtype::kF32) return static_cast<const float*>(base)[i];
  if constexpr (DT == WeightDtype::kBF16) return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  if constexpr (DT == WeightDtype::kF16) return f16_to_float(static_cast<const uint16_t*>(base)[i]);
  return e4m3_div256(static_cast<const uint8_t*>(base)[i]);  // kFP8 (quantize.h)
}

// 4-bit codes -> values. nvfp4: E2M1 (sign, 2 exponent bits, 1 mantissa bit); int4: two's complement.
constexpr float kE2m1Values[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
constexpr float kInt4Values[16] = {0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1};

size_t element_bytes(WeightDtype dtype) {
  switch (dtype) {
    case WeightDtype::kF32:
      return 4;
    case WeightDtype::kBF16:
    case WeightDtype::kF16:
      return 2;
    default:
      return 1;  // kFP8; 4-bit formats are handled as nibbles
  }
}

// The byte of a 4-bit panel on a dot-product unit (kernels.h: int4 quad nibbles for int8 dots,
// else pair nibbles) that holds W[p * kPanel + j][i], and whether in its high nibble.
struct NibbleAt {
  int64_t byte;
  bool high;
};
inline NibbleAt dot_nibble(bool quad_nibbles, int64_t i, int j) {
  const int in_sixteen = j % 16;
  if (quad_nibbles) return {(i / 4) * 2 * kPanel + 64 * (j / 32) + 4 * in_sixteen + i % 4, j % 32 >= 16};
  return {(i / 2) * kPanel + 16 * (j / 16) + 2 * (in_sixteen % 8) + i % 2, in_sixteen >= 8};
}

// Dequantized W[p * kPanel + j][i] without out_scale (portable paths and embedding rows).
float packed_at(const PackedMatrix& m, int64_t p, int64_t i, int j) {
  const uint8_t* panel = m.data.data() + size_t(p) * m.panel_bytes();
  switch (m.dtype) {
    case WeightDtype::kF32:
      return load_scalar<WeightDtype::kF32>(panel, i * kPanel + j);
    case WeightDtype::kBF16:  // input pairs on a dot-product unit (kernels.h)
      return load_scalar<WeightDtype::kBF16>(
          panel, m.dot == DotUnit::kFloat32 ? i * kPanel + j : ((i / 2) * kPanel + j) * 2 + i % 2);
    case WeightDtype::kF16:
      return load_scalar<WeightDtype::kF16>(panel, i * kPanel + j);
    case WeightDtype::kFP8:  // value / 256 for the FMA path; in pairs and value x 256 on a dot unit
      if (m.dot == DotUnit::kFloat32) return load_scalar<WeightDtype::kFP8>(panel, i * kPanel + j);
      return e4m3_to_float(panel[((i / 2) * kPanel + j) * 2 + i % 2]) * 256.0f;
    default:
      break;
  }
  int code;
  if (m.dot == DotUnit::kFloat32) {
    const uint8_t byte = panel[i * (kPanel / 2) + j % 32];
    code = j < 32 ? byte & 0xf : byte >> 4;
  } else {
    const bool quad = m.multiplies_in_int8();
    const NibbleAt at = dot_nibble(quad, i, j);
    code = at.high ? panel[at.byte] >> 4 : panel[at.byte] & 0xf;
    if (quad) code ^= 8;  // stored as q + 8
  }
  if (m.dtype == WeightDtype::kNVFP4)
    return kE2m1Values[code] *
           load_scalar<WeightDtype::kFP8>(m.group_scales.data(), m.group_at(p, i / m.group_size) + j);
  return kInt4Values[code] * bf16_to_float(m.int4_scales(p, i / m.group_size)[j]);
}

#ifdef PRECAST_AVX512
template <WeightDtype DT>
inline __m512 load16(const void* base, int64_t i) {
  if constexpr (DT == WeightDtype::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  } else if constexpr (DT == WeightDtype::kFP8) {
    return e4m3x16_div256(static_cast<const uint8_t*>(base) + i);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(base) + i;
    if constexpr (DT == WeightDtype::kBF16) return widen_bf16x16(p);
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// 32 E4M3 bytes at once (e4m3x16_div256's conversion in 512-bit steps: fewer instructions).
inline void load32_fp8(const void* base, int64_t i, __m512& lo, __m512& hi) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint8_t*>(base) + i));
  const __m512i h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7), _mm512_set1_epi16(short(0xBFFF)));
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

template <int NR>
inline void zero(__m512 (&acc)[NR][4]) {
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
}

// acc[r] += x[r][i] * (w0 | w1 | w2 | w3): one broadcast and four FMAs per input row.
template <int NR>
inline void accumulate(__m512 (&acc)[NR][4], const float* x, int64_t x_stride, int i, __m512 w0, __m512 w1, __m512 w2,
                       __m512 w3) {
  for (int r = 0; r < NR; ++r) {
    const __m512 xb = _mm512_set1_ps(x[r * x_stride + i]);
    acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
    acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
    acc[r][2] = _mm512_fmadd_ps(xb, w2, acc[r][2]);
    acc[r][3] = _mm512_fmadd_ps(xb, w3, acc[r][3]);
  }
}

inline void store_outputs(__m512 (*acc)[4], int nr, int valid, const float* bias, float out_scale, float* y,
                          int64_t y_stride) {
  const __m512 s = _mm512_set1_ps(out_scale);
  for (int v = 0; v < 4; ++v) {
    if (valid <= v * 16) break;
    const __mmask16 mask = first_lanes(valid - v * 16);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + v * 16) : _mm512_setzero_ps();
    for (int r = 0; r < nr; ++r)
      _mm512_mask_storeu_ps(y + r * y_stride + v * 16, mask, _mm512_fmadd_ps(acc[r][v], s, b));
  }
}

template <WeightDtype DT>
using Element =
    std::conditional_t<DT == WeightDtype::kF32, float, std::conditional_t<DT == WeightDtype::kFP8, uint8_t, uint16_t>>;

// NR input rows x one 64-output panel: 4 x NR accumulators, one broadcast FMA per input
// element and output vector.
//
// Inputs [i_begin, i_end) only: a prefill walks the panel in blocks of inputs that stay in L1
// across row groups. The partial sums wait in y between blocks (a float32 store and load,
// exact), so every output is still one FMA chain in input order.
template <WeightDtype DT, int NR>
inline void panel_kernel(const float* x, int64_t x_stride, const PackedMatrix& w, int64_t p, int valid,
                         const float* bias, float* y, int64_t y_stride, int i_begin, int i_end) {
  const uint8_t* panel = w.data.data() + size_t(p) * w.panel_bytes();
  __m512 acc[NR][4];
  if (i_begin == 0) {
    zero<NR>(acc);
  } else {
    for (int r = 0; r < NR; ++r)
      for (int v = 0; v < 4; ++v)
        acc[r][v] = _mm512_maskz_loadu_ps(first_lanes(valid - v * 16), y + r * y_stride + v * 16);
  }
  for (int i = i_begin; i < i_end; ++i) {
    const int64_t off = int64_t(i) * kPanel;
    if constexpr (DT != WeightDtype::kF32) {  // float32 is consumed fast enough for the hardware prefetcher
      const uint8_t* row = panel + off * sizeof(Element<DT>);  // kPanel elements: one line per element byte
      constexpr int ahead = DT == WeightDtype::kFP8 ? kPrefetchQuantized : kPrefetchBf16;
      for (size_t line = 0; line < sizeof(Element<DT>); ++line) prefetch_stream(row + 64 * line, ahead);
    }
    __m512 w0, w1, w2, w3;
    if constexpr (DT == WeightDtype::kFP8) {
      load32_fp8(panel, off, w0, w1);
      load32_fp8(panel, off + 32, w2, w3);
    } else {
      w0 = load16<DT>(panel, off), w1 = load16<DT>(panel, off + 16);
      w2 = load16<DT>(panel, off + 32), w3 = load16<DT>(panel, off + 48);
    }
    accumulate<NR>(acc, x, x_stride, i, w0, w1, w2, w3);
  }
  if (i_end < w.cols) {  // partial sums of the valid outputs (padding rows of the panel are zero)
    for (int r = 0; r < NR; ++r)
      for (int v = 0; v < 4; ++v)
        _mm512_mask_storeu_ps(y + r * y_stride + v * 16, first_lanes(valid - v * 16), acc[r][v]);
    return;
  }
  store_outputs(acc, NR, valid, bias, w.out_scale, y, y_stride);
}

// The 4-bit twin: per group, load the 64 group scales; per input element, expand 32
// bytes into 64 codes, look the values up (vpermps uses the low 4 bits of each index, so
// the low nibble needs no mask) and scale them.
template <WeightDtype DT, int NR>
inline void panel_kernel_4bit(const float* x, int64_t x_stride, const PackedMatrix& w, int64_t p, int valid,
                              const float* bias, float* y, int64_t y_stride) {
  const uint8_t* panel = w.data.data() + size_t(p) * w.panel_bytes();
  const int groups = int(w.groups());
  const __m512 lut = _mm512_loadu_ps(DT == WeightDtype::kNVFP4 ? kE2m1Values : kInt4Values);
  __m512 acc[NR][4];
  zero<NR>(acc);
  for (int g = 0; g < groups; ++g) {
    __m512 s[4];
    const int64_t s_off = w.group_at(p, g);
    for (int v = 0; v < 4; ++v) {
      if constexpr (DT == WeightDtype::kNVFP4)
        s[v] = load16<WeightDtype::kFP8>(w.group_scales.data(), s_off + v * 16);
      else
        s[v] = widen_bf16x16(w.int4_scales(p, g) + v * 16);
    }
    for (int i = g * w.group_size; i < (g + 1) * w.group_size; ++i) {
      const uint8_t* bytes = panel + int64_t(i) * (kPanel / 2);
      if (i % 2 == 0) prefetch_stream(bytes, kPrefetchQuantized);
      const __m512i c0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
      const __m512i c1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16)));
      const __m512 w0 = _mm512_mul_ps(_mm512_permutexvar_ps(c0, lut), s[0]);
      const __m512 w1 = _mm512_mul_ps(_mm512_permutexvar_ps(c1, lut), s[1]);
      const __m512 w2 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(c0, 4), lut), s[2]);
      const __m512 w3 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(c1, 4), lut), s[3]);
      accumulate<NR>(acc, x, x_stride, i, w0, w1, w2, w3);
    }
  }
  store_outputs(acc, NR, valid, bias, w.out_scale, y, y_stride);
}
#endif

template <WeightDtype DT>
struct Kernel {
#ifdef PRECAST_AVX512
  template <int NR>
  static void run(const float* x, int64_t xs, const PackedMatrix& w, int64_t p, int valid, const float* b, float* y,
                  int64_t ys, int i0, int i1) {
    if constexpr (DT == WeightDtype::kNVFP4 || DT == WeightDtype::kINT4)
      panel_kernel_4bit<DT, NR>(x, xs, w, p, valid, b, y, ys);
    else
      panel_kernel<DT, NR>(x, xs, w, p, valid, b, y, ys, i0, i1);
  }
#endif
};

// Panels [p_begin, p_end) for all input rows.
template <WeightDtype DT>
void linear_panels(const float* x, int num_rows, const PackedMatrix& w, const float* bias, float* y, int64_t p_begin,
                   int64_t p_end) {
  const int cols = w.cols;
  for (int64_t p = p_begin; p < p_end; ++p) {
    const int valid = int(std::min<int64_t>(kPanel, w.rows - p * kPanel));
    const float* b = bias ? bias + p * kPanel : nullptr;
#ifdef PRECAST_AVX512
    // 4 x R accumulators + 4 weight vectors (+ 4 scales and the table for 4-bit) fit the 32 registers.
    constexpr bool k4bit = DT == WeightDtype::kNVFP4 || DT == WeightDtype::kINT4;
    constexpr int R = k4bit ? 4 : 6;
    // Many rows (a prefill): inputs in blocks whose slice of the panel (kInputBlock x 64
    // weights) stays in L1 while every row group passes over it; few rows: one pass.
    constexpr int kInputBlock = 128;
    const int block = !k4bit && num_rows > 2 * R ? kInputBlock : cols;
    for (int i0 = 0; i0 < cols; i0 += block) {
      const int i1 = std::min(cols, i0 + block);
      for (int r = 0; r < num_rows; r += R) {
        const float* xr = x + int64_t(r) * cols;
        float* yr = y + int64_t(r) * w.rows + p * kPanel;
        switch (std::min(R, num_rows - r)) {
          case 6:
            Kernel<DT>::template run<(R >= 6 ? 6 : 1)>(xr, cols, w, p, valid, b, yr, w.rows, i0, i1);
            break;
          case 5:
            Kernel<DT>::template run<(R >= 5 ? 5 : 1)>(xr, cols, w, p, valid, b, yr, w.rows, i0, i1);
            break;
          case 4:
            Kernel<DT>::template run<4>(xr, cols, w, p, valid, b, yr, w.rows, i0, i1);
            break;
          case 3:
            Kernel<DT>::template run<3>(xr, cols, w, p, valid, b, yr, w.rows, i0, i1);
            break;
          case 2:
            Kernel<DT>::template run<2>(xr, cols, w, p, valid, b, yr, w.rows, i0, i1);
            break;
          default:
            Kernel<DT>::template run<1>(xr, cols, w, p, valid, b, yr, w.rows, i0, i1);
            break;
        }
      }
    }
#else
    const uint8_t* panel = w.data.data() + size_t(p) * w.panel_bytes();
    for (int r = 0; r < num_rows; ++r) {
      float acc[kPanel] = {0};
      for (int i = 0; i < cols; ++i) {
        const float xi = x[int64_t(r) * cols + i];
        if constexpr (DT == WeightDtype::kNVFP4 || DT == WeightDtype::kINT4) {
          for (int j = 0; j < kPanel; ++j) acc[j] += xi * packed_at(w, p, i, j);
        } else {  // one inlined load per element: the compiler vectorizes this loop (AVX2 machines)
          for (int j = 0; j < kPanel; ++j) acc[j] += xi * load_scalar<DT>(panel, int64_t(i) * kPanel + j);
        }
      }
      for (int j = 0; j < valid; ++j)
        y[int64_t(r) * w.rows + p * kPanel + j] = acc[j] * w.out_scale + (b ? b[j] : 0.0f);
    }
#endif
  }
}

}  // namespace

bool is_4bit(WeightDtype dtype) { return dtype == WeightDtype::kNVFP4 || dtype == WeightDtype::kINT4; }

size_t weight_values_bytes(WeightDtype dtype, int rows, int cols) {
  return is_4bit(dtype) ? size_t(rows) * size_t(cols / 2) : size_t(rows) * size_t(cols) * element_bytes(dtype);
}

void check_weight_view(const std::string& name, const WeightView& w, size_t values_bytes, size_t scales_bytes,
                       size_t offsets_bytes) {
  auto fail = [&](const std::string& what) { throw std::invalid_argument(name + ": " + what); };
  if (w.dtype != WeightDtype::kFP8 && !is_4bit(w.dtype)) fail("not a quantized dtype");
  if (values_bytes != weight_values_bytes(w.dtype, w.rows, w.cols)) fail("wrong number of value bytes");
  const bool offsets = w.group_offsets != nullptr;
  if (offsets && w.dtype != WeightDtype::kINT4) fail("group offsets come with int4 weights only");
  if (!is_4bit(w.dtype)) return;
  const int g = w.group_size;
  if (g <= 0 || g % 2 || w.cols % g || (w.dtype == WeightDtype::kNVFP4 && g != 16))
    fail("bad group size " + std::to_string(g));
  const size_t groups = size_t(w.rows) * size_t(w.cols / g);
  if (!w.group_scales || scales_bytes != groups * (w.dtype == WeightDtype::kNVFP4 ? 1 : 4))
    fail("4-bit weights need group scales [rows, cols / group_size]: wrong number of group scale bytes");
  if (offsets && offsets_bytes != groups * sizeof(float))
    fail("wrong number of group offset bytes (float32 [rows, cols / group_size])");
}

size_t PackedMatrix::panel_bytes() const {
  return is_4bit(dtype) ? size_t(cols) * (kPanel / 2) : size_t(cols) * kPanel * element_bytes(dtype);
}

bool PackedMatrix::multiplies_in_int8() const { return dtype == WeightDtype::kINT4 && int4_multiplies_in_int8(dot); }

PackedMatrix PackedMatrix::pack(const WeightView& w, DotUnit unit) {
  PackedMatrix m;
  m.dot = multiplies_in_bf16(w.dtype, w.cols, w.group_size, unit) ? unit : DotUnit::kFloat32;
  m.dtype = w.dtype;
  m.rows = w.rows;
  m.cols = w.cols;
  const int64_t panels = (int64_t(w.rows) + kPanel - 1) / kPanel;
  m.data.assign(size_t(panels) * m.panel_bytes(), 0);
  const uint8_t* src = static_cast<const uint8_t*>(w.values);
  if ((w.dtype == WeightDtype::kBF16 || w.dtype == WeightDtype::kFP8) && m.dot != DotUnit::kFloat32) {  // input pairs
    const size_t es = element_bytes(w.dtype);
    for (int64_t o = 0; o < w.rows; ++o) {
      const int64_t p = o / kPanel, j = o % kPanel;
      for (int64_t i = 0; i < w.cols; ++i)
        std::memcpy(m.data.data() + (p * w.cols * kPanel + ((i / 2) * kPanel + j) * 2 + i % 2) * es,
                    src + (o * w.cols + i) * es, es);
    }
    if (w.dtype == WeightDtype::kFP8) m.out_scale = w.scale / 256.0f;  // widened to value x 256 (bf16_gemm.cpp)
    return m;
  }
  if (!is_4bit(w.dtype)) {
    const size_t es = element_bytes(w.dtype);
    for (int64_t o = 0; o < w.rows; ++o) {
      const int64_t p = o / kPanel, j = o % kPanel;
      for (int64_t i = 0; i < w.cols; ++i)
        std::memcpy(m.data.data() + ((p * w.cols + i) * kPanel + j) * es, src + (o * w.cols + i) * es, es);
    }
    if (w.dtype == WeightDtype::kFP8) m.out_scale = w.scale * 256.0f;
    return m;
  }
  m.group_size = w.group_size;
  const int64_t groups = m.groups();
  const bool int4 = w.dtype == WeightDtype::kINT4;
  m.group_scales.assign(size_t(panels * groups * kPanel) * (int4 ? 2 : 1), 0);
  uint16_t* int4_scales = reinterpret_cast<uint16_t*>(m.group_scales.data());
  const bool quad_nibbles = m.multiplies_in_int8();  // once, not per nibble
  for (int64_t o = 0; o < w.rows; ++o) {
    const int64_t p = o / kPanel, j = o % kPanel;
    uint8_t* panel = m.data.data() + size_t(p) * m.panel_bytes();
    const uint8_t flip = quad_nibbles ? 8 : 0;  // stored as q + 8
    for (int64_t i = 0; i < w.cols; ++i) {
      const uint8_t code = ((src[o * (w.cols / 2) + i / 2] >> (4 * (i % 2))) & 0xf) ^ flip;
      if (m.dot == DotUnit::kFloat32)
        panel[i * (kPanel / 2) + j % 32] |= j < 32 ? code : uint8_t(code << 4);
      else if (const NibbleAt at = dot_nibble(quad_nibbles, i, int(j)); at.high)
        panel[at.byte] |= uint8_t(code << 4);
      else
        panel[at.byte] |= code;
    }
    for (int64_t g = 0; g < groups; ++g) {
      if (int4)
        int4_scales[m.group_at(p, g) + j] = bf16_bits(static_cast<const float*>(w.group_scales)[o * groups + g]);
      else
        m.group_scales[size_t(m.group_at(p, g) + j)] = static_cast<const uint8_t*>(w.group_scales)[o * groups + g];
    }
  }
  if (w.group_offsets) {  // [panel][group][64] as the scales: a panel's offsets lie beside its weights
    m.group_offsets.assign(size_t(panels * groups * kPanel), 0);
    for (int64_t o = 0; o < w.rows; ++o)
      for (int64_t g = 0; g < groups; ++g)
        m.group_offsets[size_t(m.group_at(o / kPanel, g) + o % kPanel)] = bf16_bits(w.group_offsets[o * groups + g]);
  }
  // nvfp4 group scales are E4M3 read as value / 256; the global scale carries the 256.
  m.out_scale = w.dtype == WeightDtype::kNVFP4 ? w.scale * 256.0f : 1.0f;
  return m;
}

namespace {
// Asymmetric int4: y[r, o] += sum_g offset[o, g] * (sum of x[r] over group g), each row on its own in a fixed
// order (batch invariance). Inputs are summed as the unit multiplies them: rounded to bf16 on a bf16 unit.
void add_group_offsets(ThreadPool& pool, const float* x, int num_rows, const PackedMatrix& w, float* y) {
  const int g = w.group_size, groups = int(w.groups());
  std::vector<float> sums(size_t(num_rows) * groups);
  const bool bf16 = w.dot != DotUnit::kFloat32;
  auto group_sums = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int k = 0; k < groups; ++k) {
        const float* xg = x + r * w.cols + int64_t(k) * g;
        float lanes[16] = {0};  // 16 independent sums (vectorizable), then added in lane order
        int j = 0;
        for (; j + 16 <= g; j += 16)
          for (int l = 0; l < 16; ++l) lanes[l] += bf16 ? bf16_round(xg[j + l]) : xg[j + l];
        for (; j < g; ++j) lanes[j % 16] += bf16 ? bf16_round(xg[j]) : xg[j];
        float sum = 0.0f;
        for (float v : lanes) sum += v;
        sums[size_t(r * groups + k)] = sum;
      }
    }
  };
  // One panel's outputs at a time: per row, acc[o] += offset[k][o] * sum[k] for k in order (a panel's offsets are
  // stored group by group, so the inner loop runs along contiguous outputs and vectorizes), then y += acc.
  const int64_t blocks = (int64_t(w.rows) + kPanel - 1) / kPanel;
  auto add = [&](int64_t begin, int64_t end) {
    float acc[kPanel];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t o0 = b * kPanel, n = std::min<int64_t>(kPanel, w.rows - o0);
      for (int64_t r = 0; r < num_rows; ++r) {
        std::fill(acc, acc + n, 0.0f);
        for (int k = 0; k < groups; ++k) {
          const uint16_t* offsets = w.group_offsets.data() + w.group_at(b, k);
          const float s = sums[size_t(r * groups + k)];
          for (int64_t o = 0; o < n; ++o) acc[o] += bf16_to_float(offsets[o]) * s;
        }
        float* yr = y + r * w.rows + o0;
        for (int64_t o = 0; o < n; ++o) yr[o] += acc[o];
      }
    }
  };
  // Small steps cost less than waking the workers; a decode step of a large matrix streams its
  // offsets (rows x groups floats) from memory, on both threads.
  if (int64_t(num_rows) * w.rows * groups < (int64_t(1) << 14)) {
    group_sums(0, num_rows);
    add(0, blocks);
  } else {
    pool.parallel_for(num_rows, group_sums);
    pool.parallel_for(blocks, add);
  }
}

// The float32 FMA path of linear().
void linear_float32(ThreadPool& pool, const float* x, int num_rows, const PackedMatrix& w, const float* bias,
                    float* y) {
  const PanelWork work(num_rows, w.rows);
  pool.parallel_for(work.items(), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const PanelWork::Item item = work.item(i);
      const int64_t p = item.panel, r0 = item.first_row;
      const int n = item.num_rows;
      const float* xr = x + r0 * w.cols;
      float* yr = y + r0 * w.rows;
      switch (w.dtype) {
        case WeightDtype::kF32:
          linear_panels<WeightDtype::kF32>(xr, n, w, bias, yr, p, p + 1);
          break;
        case WeightDtype::kBF16:
          linear_panels<WeightDtype::kBF16>(xr, n, w, bias, yr, p, p + 1);
          break;
        case WeightDtype::kF16:
          linear_panels<WeightDtype::kF16>(xr, n, w, bias, yr, p, p + 1);
          break;
        case WeightDtype::kFP8:
          linear_panels<WeightDtype::kFP8>(xr, n, w, bias, yr, p, p + 1);
          break;
        case WeightDtype::kNVFP4:
          linear_panels<WeightDtype::kNVFP4>(xr, n, w, bias, yr, p, p + 1);
          break;
        case WeightDtype::kINT4:
          linear_panels<WeightDtype::kINT4>(xr, n, w, bias, yr, p, p + 1);
          break;
      }
    }
  });
}

}  // namespace

void linear(ThreadPool& pool, const float* x, int num_rows, const PackedMatrix& w, const float* bias, float* y,
            float input_scale, const float* row_scales) {
  if (w.multiplies_in_int8()) {
    // Adds asymmetric groups' offsets itself, for the inputs as it quantized them.
    linear_int4_int8(pool, x, num_rows, w, bias, input_scale, row_scales, y);
    return;
  }
  if (w.dot != DotUnit::kFloat32) {
    linear_bf16(pool, x, num_rows, w, bias, input_scale, row_scales, y);
  } else {
    if (input_scale != 1.0f || row_scales)
      throw std::invalid_argument("an input scale needs a matrix on a bf16 dot-product unit");
    linear_float32(pool, x, num_rows, w, bias, y);
  }
  if (!w.group_offsets.empty()) add_group_offsets(pool, x, num_rows, w, y);
}

void matrix_row(const PackedMatrix& w, int row, float* out) {
  const int64_t p = row / kPanel;
  const int j = row % kPanel;
  for (int i = 0; i < w.cols; ++i) out[i] = packed_at(w, p, i, j) * w.out_scale;
  if (!w.group_offsets.empty())
    for (int i = 0; i < w.cols; ++i)
      out[i] += bf16_to_float(w.group_offsets[size_t(w.group_at(p, i / w.group_size) + j)]);
}

void rms_norm(const float* x, const float* weight, int num_rows, int dim, float eps, float* y) {
  for (int r = 0; r < num_rows; ++r) {
    const float* xr = x + int64_t(r) * dim;
    float* yr = y + int64_t(r) * dim;
    float acc[16] = {0};
    for (int i = 0; i < dim; ++i) acc[i % 16] += xr[i] * xr[i];
    float sum = 0;
    for (float a : acc) sum += a;
    const float inv = 1.0f / std::sqrt(sum / float(dim) + eps);
    for (int i = 0; i < dim; ++i) yr[i] = weight[i] * (xr[i] * inv);
  }
}

namespace {
// The argument whose sigmoid, times g, is the activation: g for silu, 2z for gelu_tanh.
inline float sigmoid_argument(float g, Activation act) {
  return act == Activation::kSilu ? g : 2.0f * 0.7978845608028654f * (g + 0.044715f * g * g * g);
}
}  // namespace

void gated_activation(const float* gate_up, int num_rows, int inter, Activation act, float* out) {
  for (int r = 0; r < num_rows; ++r) {
    const float* g = gate_up + int64_t(r) * 2 * inter;
    const float* u = g + inter;
    float* o = out + int64_t(r) * inter;
    int i = 0;
#ifdef PRECAST_AVX512
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= inter; i += 16) {  // a glibc expf per element cost more than the rest of the loop
      const __m512 gv = _mm512_loadu_ps(g + i);
      __m512 arg = gv;
      if (act == Activation::kGeluTanh) {
        const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(gv, gv), gv);
        arg = _mm512_mul_ps(_mm512_set1_ps(2.0f * 0.7978845608028654f),
                            _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), cube, gv));
      }
      const __m512 y = _mm512_div_ps(gv, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), arg))));
      _mm512_storeu_ps(o + i, _mm512_mul_ps(y, _mm512_loadu_ps(u + i)));
    }
#endif
    for (; i < inter; ++i) o[i] = g[i] / (1.0f + std::exp(-sigmoid_argument(g[i], act))) * u[i];
  }
}

void soft_cap(float* x, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) x[i] = cap * std::tanh(x[i] / cap);  // a division, as transformers computes it
}

void rope(float* x, int num_heads, int head_dim, int rotary_pairs, int position, const float* inv_freq, float scale) {
  const int half = head_dim / 2;
  // Pairs from rotary_pairs on pass through untouched (partial rotary; not scaled either).
  for (int j = 0; j < rotary_pairs; ++j) {
    // The angle in float32, as reference implementations compute it.
    const float angle = float(position) * inv_freq[j];
    const float c = std::cos(angle) * scale, s = std::sin(angle) * scale;
    for (int h = 0; h < num_heads; ++h) {
      float* xh = x + int64_t(h) * head_dim;
      const float a = xh[j], b = xh[j + half];
      xh[j] = a * c - b * s;
      xh[j + half] = b * c + a * s;
    }
  }
}

}  // namespace precast
