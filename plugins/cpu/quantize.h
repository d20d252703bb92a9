// FP8 (E4M3) and FP4 (E2M1) rounding on the CPU, and the activation quantization the
// quantized recipes apply before each linear layer (docs/quantization.md).
//
// Rounding is round-to-nearest-even with saturation, bit-exact with ml_dtypes'
// float8_e4m3fn / float4_e2m1fn conversions (tested). Quantized activations are
// returned dequantized (q * scale as float32): the GEMM then multiplies exactly the
// values the recipe defines, on hardware without FP8/FP4 arithmetic.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace precast {

constexpr float kFp8Max = 448.0f;
constexpr float kFp4Max = 6.0f;
constexpr int kNvfp4Block = 16;

// The nearest E4M3 / E2M1 value (saturating at +-448 / +-6), as a float.
float round_to_e4m3(float x);
float round_to_e2m1(float x);

// E4M3 encoding of a value that is already exactly representable (from round_to_e4m3).
uint8_t e4m3_bits(float representable);

// The value of an E4M3 byte (every finite code; 0x7f / 0xff, NaN, are never stored).
inline float e4m3_to_float(uint8_t bits) {
  const uint32_t e = (bits >> 3) & 0xf, m = bits & 7;
  float a;
  if (e == 0) {
    a = float(m) * (1.0f / 512.0f);  // subnormal: m x 2^-9
  } else {
    const uint32_t f = ((e + 120) << 23) | (m << 20);  // rebias 7 -> 127, 3 mantissa bits on top
    std::memcpy(&a, &f, 4);
  }
  return bits & 0x80 ? -a : a;
}

// How the kernels widen E4M3: to value / 256, which is what the float16 bits
// ((b & 0x7f) << 7) | (sign << 15) hold (exact for every finite code). Callers fold the
// 256 into a scale.
inline float e4m3_div256(uint8_t bits) { return e4m3_to_float(bits) * (1.0f / 256.0f); }

#if defined(__AVX512F__)
// 16 E4M3 bytes -> 16 floats of value / 256: sign-extend each byte to 16 bits, shift the
// magnitude into float16 position, clear bit 14 (the sign's copy), widen.
inline __m512 e4m3x16_div256(__m128i bytes) {
  const __m256i s = _mm256_cvtepi8_epi16(bytes);
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(s, 7), _mm256_set1_epi16(short(0xBFFF))));
}
inline __m512 e4m3x16_div256(const uint8_t* p) {
  return e4m3x16_div256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// out = e4m3(clip(x / scale)) * scale, element-wise (fp8 static activation quantization).
void fake_quant_fp8(const float* x, int64_t n, float scale, float* out);

// nvfp4 dynamic activation quantization of `num_rows` rows of `cols` (a multiple of 16):
// per block of 16, block_scale = e4m3(block_amax / (6 * global)), effective = block_scale
// * global, out = e2m1(clip(x / effective)) * effective.
void fake_quant_nvfp4(const float* x, int num_rows, int cols, float global_scale, float* out);

// The same quantizations with the per-tensor scale left out, for kernels that apply it to
// their outputs (bf16_gemm.h): fp8 gives e4m3(clip(x / scale)); nvfp4 gives the block's
// e2m1 value * block_scale (exact in bf16). Multiplied by `scale` / `global_scale`, each
// equals its fake_quant_* value.
void fp8_codes(const float* x, int64_t n, float scale, float* out);

// fp8 dynamic (per-token) activation scales: scales[r] = max|x[r, :]| / 448, 1 for an all-zero row
// (precast.engine.formats.fp8_dynamic_scales).
void fp8_dynamic_scales(const float* x, int num_rows, int cols, float* scales);
void nvfp4_codes(const float* x, int num_rows, int cols, float global_scale, float* out);

// AWQ's search (quantization/awq.py) for rows [row_begin, row_end) of a [rows, cols] weight: the int4 round trip of
// the input-scaled weight, unscaled again: out = dequantize(int4(w * s)) / s, groups of `group_size` columns, one
// scale max|group| / 7 per group, round half to even, clamped to [-8, 7]. The same float32 operations as
// precast.engine.formats.quantize_int4 and its dequantization (bit-identical; tested), in one pass instead of numpy's
// eight (the search runs it 20 times per linear layer).
// asymmetric: scale (max - min) / 15 and offset min + 8 scale per group, codes clamp(rint((v - offset) / scale)).
void int4_round_trip_scaled(const float* w, const float* s, int64_t row_begin, int64_t row_end, int cols,
                            int group_size, bool asymmetric, float* out);

// The group scales of int4_awq's scale search (quantization/awq.py) for rows [row_begin, row_end) of a [rows, cols]
// weight: per group, the scale minimising sum_j a_j (w_j - scale q_j)^2, q_j = clamp(rint(w_j / scale), -8, 7) as
// precast.engine.formats.quantize_int4 rounds, a_j = importance[column] (the mean squared input of that column).
// Candidates: the plain scale max|group| / 7 (kept on ties) and kInt4ScaleCandidates scales from it down to half of
// it (smaller scales clip the largest values to refine the grid for the rest), each refit by weighted least squares
// for its codes. scales is [rows, cols / group_size].
constexpr int kInt4ScaleCandidates = 28;
void int4_search_scales(const float* w, const float* importance, int64_t row_begin, int64_t row_end, int cols,
                        int group_size, float* scales);

// The same search for asymmetric int4 groups (w ~ scale q + offset, q = clamp(rint((w - offset) / scale), -8, 7)):
// per group, the (scale, offset) minimising sum_j a_j (w_j - scale q_j - offset)^2. Candidates: the plain pair from
// the group's min and max (kept on ties), and grids from it down to half its step (kInt4AsymSteps) anchored at the
// min, the max or the middle of the group, each refit by weighted least squares for its codes (both parameters),
// then coded again. scales and offsets are [rows, cols / group_size].
constexpr int kInt4AsymSteps = 14;
void int4_search_scales_offsets(const float* w, const float* importance, int64_t row_begin, int64_t row_end, int cols,
                                int group_size, float* scales, float* offsets);

// nvfp4's block scale search (quantization/awq.py's search_group_scales for nvfp4) for rows [row_begin, row_end)
// of a [rows, cols] weight with its global scale: per block of 16, the E4M3 block scale minimising
// sum_j a_j (w_j - e2m1(w_j / (scale * global)) * scale * global)^2, a_j = importance[column]. Candidates: the plain
// scale e4m3(max|block| / (6 * global)) (kept on ties), the kNvfp4ScaleStepsDown E4M3 values below it (clipping the
// largest values) and the one above. block_scales [rows, cols / 16] holds the chosen scales' values.
constexpr int kNvfp4ScaleStepsDown = 6;
void nvfp4_search_block_scales(const float* w, const float* importance, float global_scale, int64_t row_begin,
                               int64_t row_end, int cols, float* block_scales);

}  // namespace precast
