// bf16 <-> float32 for single values: the rounding every bf16 in precast uses (to nearest, ties to even, as
// ml_dtypes and VCVTNEPS2BF16 round finite values).
#pragma once

#include <cstdint>
#include <cstring>

namespace precast {

// Float32 -> the nearest bf16's bits.
inline uint16_t bf16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return uint16_t((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Float32 -> the nearest bf16, as a float.
inline float bf16_round(float x) { return bf16_to_float(bf16_bits(x)); }

}  // namespace precast
