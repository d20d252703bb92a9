// Linear layers on the CPU's bfloat16 dot-product units: AMX tiles (TDPBF16PS, Intel
// Sapphire Rapids and later) or AVX512-BF16 (VDPBF16PS: Intel Cooper Lake and later, AMD Zen 4
// and later). Both multiply pairs of bf16 values exactly and accumulate in float32.
//
// Which engines compute this way: bf16, fp8, nvfp4 and int4 weights (kernels.h, WeightView).
// Their activations are rounded to bf16 (round to nearest even) before each layer, as HF
// transformers' bf16 models do; fp8 and nvfp4 activation codes are exact in bf16 and their
// scale is applied to the outputs. Weights are widened to bf16 inside the kernel, exactly: bf16,
// fp8, nvfp4 (E2M1 x E4M3 group scale has at most 6 significant bits) and int4 codes; int4's
// float32 group scale multiplies each group's partial sum instead (groups of a multiple of 32
// inputs), y = sum over groups of scale x (codes . x). float32 and float16 engines keep the float32
// FMA path. Exception: int4 matrices on AVX512-BF16 (no AMX) multiply on the int8 dot products
// instead (int8_gemm.h), twice as fast, with activations quantized to int8 per group.
//
// Invariance: every output row is one fixed sequence of dot-product instructions over the
// inputs in order, 32 at a time (AMX) or 2 at a time (AVX512-BF16), whatever the number of
// rows in the call, the thread split or the position of the row in a tile. A process uses
// one unit for all its layers, so decode steps, prefill chunks and batches of any size give
// bit-identical rows. AMX and AVX512-BF16 round differently (AMX does not round between the
// products of one instruction the way VDPBF16PS does), so engines give slightly different
// numbers on the two kinds of CPU, as they do with float32 FMA and without.
#pragma once

#include <string>

#include "kernels.h"

namespace precast {

// The unit bf16-compute layers use in this process: AMX where the CPU and OS allow it, else
// AVX512-BF16, else none (kFloat32: those engines then multiply in float32 like the others).
// PRECAST_CPU_DOT=amx|avx512_bf16|float32 (read once) picks a unit the host has, e.g. to
// compare units on one machine; an unavailable one is an error.
DotUnit dot_unit();
std::string dot_unit_name(DotUnit unit);
DotUnit parse_dot_unit(const std::string& name);  // "auto" is dot_unit()
bool dot_unit_available(DotUnit unit);

// Whether a matrix of this dtype, input size and (int4) group size is multiplied on `unit` (see
// above; the input size must be a multiple of 32: one AMX step).
bool multiplies_in_bf16(WeightDtype dtype, int cols, int group_size, DotUnit unit);

// y = (x @ w^T) * input_scale * row_scales[r] (+ bias) for a matrix packed with w.dot != kFloat32.
// x holds num_rows rows of w.cols floats, rounded to bf16 here; row_scales may be null (1).
void linear_bf16(ThreadPool& pool, const float* x, int num_rows, const PackedMatrix& w, const float* bias,
                 float input_scale, const float* row_scales, float* y);

// Shared with the bf16 attention kernels (paged_attention_bf16.cpp); built only where the
// compiler targets AVX512-BF16 (AMX for the second).
// Float32 -> bf16, round to nearest even (what torch's .to(bfloat16) does).
void round_to_bf16(const float* x, int64_t n, uint16_t* out);
// Loads this thread's AMX tile configuration: tiles 0-3 C (`rows` x 16 float32), 4 A (`rows` x 32
// bf16), 5 and 6 B (16 pairs x 16 columns of bf16 pairs). _tile_release() when done.
void configure_amx_tiles(int rows);

}  // namespace precast
