// FP8 (E4M3) and FP4 (E2M1) rounding on the CPU, and the activation quantization the
// quantized recipes apply before each linear layer (docs/quantization.md).
//
// Rounding is round-to-nearest-even with saturation, bit-exact with ml_dtypes'
// float8_e4m3fn / float4_e2m1fn conversions (tested). Quantized activations are
// returned dequantized (q * scale as float32): the GEMM then multiplies exactly the
// values the recipe defines, on hardware without FP8/FP4 arithmetic.
#pragma once

#include <cstdint>

namespace precast {

constexpr float kFp8Max = 448.0f;
constexpr float kFp4Max = 6.0f;
constexpr int kNvfp4Block = 16;

// The nearest E4M3 / E2M1 value (saturating at +-448 / +-6), as a float.
float round_to_e4m3(float x);
float round_to_e2m1(float x);

// E4M3 encoding of a value that is already exactly representable (from round_to_e4m3).
uint8_t e4m3_bits(float representable);
float e4m3_to_float(uint8_t bits);

// out = e4m3(clip(x / scale)) * scale, element-wise (fp8 static activation quantization).
void fake_quant_fp8(const float* x, int64_t n, float scale, float* out);

// nvfp4 dynamic activation quantization of `num_rows` rows of `cols` (a multiple of 16):
// per block of 16, block_scale = e4m3(block_amax / (6 * global)), effective = block_scale
// * global, out = e2m1(clip(x / effective)) * effective.
void fake_quant_nvfp4(const float* x, int num_rows, int cols, float global_scale, float* out);

}  // namespace precast
