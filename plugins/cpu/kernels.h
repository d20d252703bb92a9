// CPU kernels of the generic decoder. Activations are float32; weight matrices are
// float32, bfloat16, float16, or quantized (fp8 E4M3 per tensor, nvfp4, int4 groups) and
// are widened inside the inner loops (never materialized): to float32 for the FMA path, or,
// for bf16 / fp8 / nvfp4 / int4 matrices on a CPU with bf16 dot-product units, to bf16 for
// those units (bf16_gemm.h). Every kernel computes each output row with the same operations
// in the same order whatever else is in the batch (batch invariance).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "thread_pool.h"

namespace precast {

// CPU buffers start on a cache line (64 bytes). AMX tile rows are 64 bytes: a row that straddles
// two lines made a tile load about three times slower (benchmarks/amx_tiles.cpp), and glibc's
// large blocks start 16 bytes past a page.
constexpr std::align_val_t kCacheLine{64};

template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kCacheLine)); }
  void deallocate(T* p, size_t) { ::operator delete(p, kCacheLine); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const {
    return true;
  }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const {
    return false;
  }
};
template <typename T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

// Uninitialized bytes on a cache line, for buffers whose untouched pages should cost no memory
// (KV pools; std::vector would zero them).
struct CacheLineDelete {
  void operator()(uint8_t* p) const { ::operator delete[](p, kCacheLine); }
};
using CacheLineBytes = std::unique_ptr<uint8_t[], CacheLineDelete>;
inline CacheLineBytes uninitialized_bytes(size_t n) {
  return CacheLineBytes(static_cast<uint8_t*>(::operator new[](n, kCacheLine)));
}

enum class WeightDtype { kF32, kBF16, kF16, kFP8, kNVFP4, kINT4 };

// What multiplies a matrix: float32 FMAs, or a bf16 dot-product unit (bf16_gemm.h).
enum class DotUnit { kFloat32, kAvx512Bf16, kAmx };

// A row-major weight as the engine stores it ([rows = out, cols = in]).
//   kF32/kBF16/kF16  values: rows x cols elements
//   kFP8             values: rows x cols E4M3 bytes; w = value * scale
//   kNVFP4           values: rows x cols/2 bytes of E2M1 pairs (low nibble first);
//                    group_scales: rows x cols/16 E4M3 bytes; w = value * group_scale * scale
//   kINT4            values: rows x cols/2 bytes of two's-complement nibbles (low first);
//                    group_scales: rows x cols/group_size float32; w = value * group_scale
//                    (+ group_offset: asymmetric groups, rows x cols/group_size float32)
struct WeightView {
  WeightDtype dtype = WeightDtype::kF32;
  int rows = 0;
  int cols = 0;
  const void* values = nullptr;
  const void* group_scales = nullptr;
  int group_size = 0;
  float scale = 1.0f;
  const float* group_offsets = nullptr;  // int4 only; null: symmetric
};
size_t weight_values_bytes(WeightDtype dtype, int rows, int cols);
bool is_4bit(WeightDtype dtype);
// Throws std::invalid_argument, its message starting with `name`, unless the view's arrays have these sizes (bytes).
void check_weight_view(const std::string& name, const WeightView& w, size_t values_bytes, size_t scales_bytes,
                       size_t offsets_bytes);

// A weight matrix [rows = output features, cols = input features] repacked for the
// kernels: panels of kPanel output rows, each stored input-major,
//
//   panel p: for i in 0..cols: W[p*kPanel + 0][i], W[p*kPanel + 1][i], ..., W[p*kPanel + kPanel-1][i]
//
// (rows past the end are zero). A linear layer then streams each panel once, front to
// back, accumulating kPanel outputs per input element with no horizontal sums, and
// every output is one chain of FMAs in input order whatever the batch (batch invariance).
//
// Quantized panels keep their stored bits. FP8 panels are 64 bytes per input element.
// 4-bit panels are 32 bytes per input element, byte j holding outputs j (low nibble) and
// j + 32 (high nibble), with the group scales in a second array [panel][group][64] (group_at):
// nvfp4's as E4M3 bytes, int4's as bf16, rounded from the stored float32 (quantize_int4 rounds
// them before choosing the codes, so they are exact for engines built since; bf16 keeps
// float32's range, and its 2^-9 relative step is far below a 4-bit code's). With groups of 64
// the scales and offsets are 11% of a decode step's bytes; in float32 they would be 20%.
// E4M3 bytes widen exactly through float16 bits, ((b & 0x7f) << 7) | sign, which gives
// the value / 256; the 256 is folded into `out_scale`.
//
// bf16 and fp8 panels multiplied on a dot-product unit (dot != kFloat32) hold input pairs
// instead, the layout those units read: for pair k, W[p*kPanel + j][2k], W[p*kPanel + j][2k + 1]
// for j in 0..kPanel (256 bytes per pair in bf16, 128 in fp8). 4-bit panels there hold "pair
// nibbles": per pair, 16 bytes for each 16 outputs 16v..16v+15, byte 2d + e holding input 2k + e
// of output 16v + d in its low nibble and of output 16v + 8 + d in its high nibble (d < 8).
// Except int4 panels for int8 dots (int8_gemm.h), in "quad nibbles": 128 bytes per input quad k
// (inputs 4k..4k+3), byte 64h + 4d + e holding input 4k + e of output 32h + d in its low nibble
// and of output 32h + 16 + d in its high one (d < 16), as q + 8 (0..15): masking and shifting
// give VPDPBUSD's unsigned byte operands directly.
constexpr int kPanel = 64;

struct PackedMatrix {
  AlignedVector<uint8_t> data;
  AlignedVector<uint8_t> group_scales;  // 4-bit formats only (E4M3 bytes, or int4's bf16)
  // Asymmetric int4: bf16 [panel][group][64] like the scales (from the stored [rows][groups]), read
  // beside the panel's codes. The kernels multiply the codes; the offsets add sum over groups of offset
  // x (the group's sum of inputs), their share of x . w (linear(), or the int8 kernel's epilogue).
  AlignedVector<uint16_t> group_offsets;
  WeightDtype dtype = WeightDtype::kF32;
  int rows = 0;
  int cols = 0;
  int group_size = 0;  // 4-bit formats
  // Multiplies every output: fp8 scale / nvfp4 global (x 256 where the float32 path widens / 256,
  // / 256 where the bf16 path widens fp8 to value x 256).
  float out_scale = 1.0f;
  DotUnit dot = DotUnit::kFloat32;
  // `dot` is the unit the matrix is multiplied on: the one asked for where the dtype and shape
  // allow it (multiplies_in_bf16), else float32.
  static PackedMatrix pack(const WeightView& w, DotUnit unit);
  size_t panel_bytes() const;  // bytes of one panel in `data`
  // 4-bit formats: groups per row, and where panel p's group g starts in group_scales (counted in scales, not
  // bytes) and in group_offsets: kPanel entries, one per output row of the panel.
  int64_t groups() const { return cols / group_size; }
  int64_t group_at(int64_t p, int64_t g) const { return (p * groups() + g) * kPanel; }
  // int4: the bf16 scales of panel p's group g (kPanel of them).
  const uint16_t* int4_scales(int64_t p, int64_t g) const {
    return reinterpret_cast<const uint16_t*>(group_scales.data()) + group_at(p, g);
  }
  // An int4 matrix packed for the int8 dot products (int8_gemm.h): panels in quad nibbles, codes as q + 8.
  bool multiplies_in_int8() const;
};

// How every linear kernel divides a layer among threads: work items are (panel, chunk of rows) pairs,
// panel-major, so a thread finishes one panel's row chunks while the panel is in its cache. A decode step
// has one chunk; a prefill of hundreds of rows also splits its rows, so that a layer with few panels (576
// outputs are 9 panels) still divides evenly among the threads. Rows are computed the same way whichever
// item holds them (batch invariance).
struct PanelWork {
  static constexpr int kRowChunk = 96;  // a multiple of every kernel's row-block height (16, 6 and 4)
  struct Item {
    int64_t panel;
    int64_t first_row;
    int num_rows;
    bool first_chunk() const { return first_row == 0; }  // the item that reads the panel from memory
  };
  PanelWork(int num_rows, int out_rows)
      : num_rows(num_rows),
        panels((int64_t(out_rows) + kPanel - 1) / kPanel),
        row_chunks(num_rows >= 2 * kRowChunk ? (num_rows + kRowChunk - 1) / kRowChunk : 1),
        chunk_rows(row_chunks == 1 ? num_rows : kRowChunk) {}
  int64_t items() const { return panels * row_chunks; }
  Item item(int64_t i) const {
    const int64_t first = (i % row_chunks) * chunk_rows;
    return {i / row_chunks, first, int(std::min<int64_t>(chunk_rows, num_rows - first))};
  }
  int num_rows;
  int64_t panels, row_chunks, chunk_rows;
};

// y[r, o] = input_scale * row_scales[r] * sum_i x[r, i] * w[o, i] (+ bias[o]) for r < num_rows; x is
// [num_rows, w.cols]; row_scales may be null (1). Scales other than 1 (quantized activation codes) only for
// matrices on a dot-product unit.
void linear(ThreadPool& pool, const float* x, int num_rows, const PackedMatrix& w, const float* bias, float* y,
            float input_scale = 1.0f, const float* row_scales = nullptr);

// Row `row` of the matrix (an embedding lookup), widened to float32 into `out`.
void matrix_row(const PackedMatrix& w, int row, float* out);

// y = x / sqrt(mean(x^2) + eps) * weight, per row of `dim` values.
void rms_norm(const float* x, const float* weight, int num_rows, int dim, float eps, float* y);

// The gated MLP's gate activation (ModelSpec.activation).
enum class Activation { kSilu, kGeluTanh };

// out[i] = act(gate_up[i]) * gate_up[inter + i] per row; gate_up is [num_rows, 2 * inter].
// silu(g) = g * sigmoid(g); gelu_tanh(g) = 0.5 g (1 + tanh(z)) = g * sigmoid(2z), z = sqrt(2/pi) (g + 0.044715 g^3).
void gated_activation(const float* gate_up, int num_rows, int inter, Activation act, float* out);

// x = cap * tanh(x / cap) for `n` values (Gemma 2's logit soft-capping).
void soft_cap(float* x, int64_t n, float cap);

// Rotary embedding in place on `num_heads` heads of `head_dim` starting at `x` (HF's
// rotate-half layout): pair (j, j + head_dim / 2) rotated by position * inv_freq[j],
// then multiplied by `scale` (yarn's / longrope's attention factor, 1 otherwise), for
// j < rotary_pairs; later pairs pass through (partial rotary, rows reordered by the builder).
void rope(float* x, int num_heads, int head_dim, int rotary_pairs, int position, const float* inv_freq, float scale);

}  // namespace precast
