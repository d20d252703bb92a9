// int4 linear layers on the CPU's int8 dot products (AVX512-VNNI, VPDPBUSD), where the bf16
// unit is AVX512-BF16 (AMD Zen 4 and later, Intel without AMX): VPDPBUSD multiplies 64 byte
// pairs per instruction, twice VDPBF16PS's 32, and the int4 codes are exact bytes.
//
// Activations are quantized per row and per weight group (the int4 groups, a multiple of 32
// inputs) to int8 with a float32 scale, amax / 127 (round to nearest even), as llama.cpp
// quantizes its activations (Q8 blocks) before its integer dot products. A group's codes x
// int8 activations sum exactly in int32; per row and group, partial x activation scale x the
// weight group's scale is added to the output, group by group in order, and for asymmetric
// groups the offset x the group's sum of quantized inputs (activation scale x sum of codes): the
// layer computes W x' exactly for x' its int8-quantized input, up to float32 rounding.
//
// Invariance: every output is integer sums (exact, in any order) then one fixed sequence of
// float operations per group, whatever the rows beside it: decode steps, prefill chunks and
// batches give bit-identical rows.
#pragma once

#include "kernels.h"

namespace precast {

// Whether int4 matrices packed for `unit` multiply in int8 (the unit is AVX512-BF16 and this
// build and CPU have AVX512-VNNI); their panels then hold "quad nibbles" (kernels.h).
bool int4_multiplies_in_int8(DotUnit unit);

// y[r] = w x[r] + bias for an int4 matrix packed for int8 (w.multiplies_in_int8()), its
// asymmetric groups' offsets included; int4 layers have no input scale (input_scale 1, no
// row_scales: anything else is an error).
void linear_int4_int8(ThreadPool& pool, const float* x, int num_rows, const PackedMatrix& w, const float* bias,
                      float input_scale, const float* row_scales, float* y);

}  // namespace precast
