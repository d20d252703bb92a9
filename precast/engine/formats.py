"""Quantized weight formats: the numerics, independent of any model or kernel.

Each format turns a float32 matrix [out, in] into stored arrays plus scales, and back.
The conversions to FP8 (E4M3) and FP4 (E2M1) are ml_dtypes' (round to nearest even),
so stored values match every other implementation bit for bit.

  fp8      E4M3 values, one float32 scale per tensor:        w ~ q * scale,  scale = amax / 448
  nvfp4    E2M1 values packed two per byte (low nibble first), one E4M3 scale per 16 inputs and
           one float32 global scale per tensor:            w ~ q * block_scale * global
           global = amax / (6 * 448), block_scale = block_amax / (6 * global) (stored as E4M3)
  int4     signed 4-bit integers in [-8, 7], packed two per byte (low nibble first), one
           scale per group of `group_size` inputs:   w ~ q * scale, scale = group_amax / 7
           asymmetric: also an offset per group (the value of code 0; Q4_1's and Q4_K's "min" in another
           guise):   w ~ q * scale + offset, scale = (max - min) / 15, offset = min + 8 * scale
           Scales and offsets are stored as float32 holding bf16 values (rounded before the codes are chosen):
           the CPU kernels keep them in bf16, half the bytes a decode step reads beside the codes.

Activations (the inputs of quantized linear layers) are quantized at run time by the C++
runner (plugins/cpu/quantize.h); `fake_quant_*_activation` below are the definitions it is
tested against bit for bit, in float32 arithmetic as the runner does it.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest float4_e2m1fn
NVFP4_BLOCK = 16
INT4_MAX = 7


def per_tensor_scale(amax: float, maximum: float) -> float:
    """amax / maximum: the scale that maps a tensor's largest magnitude onto the format's largest value
    (1 for an all-zero tensor, whose values any scale represents)."""
    return float(amax) / maximum if amax > 0 else 1.0


@dataclass(frozen=True)
class Fp8Tensor:
    values: np.ndarray  # float8_e4m3fn [out, in]
    scale: float

    def dequantize(self) -> np.ndarray:
        return self.values.astype(np.float32) * np.float32(self.scale)


def quantize_fp8(w: np.ndarray, amax: float | None = None) -> Fp8Tensor:
    """Per-tensor E4M3 with scale amax / 448 (amax of `w` unless given, e.g. from calibration)."""
    w = np.asarray(w, dtype=np.float32)
    scale = per_tensor_scale(float(np.abs(w).max()) if amax is None else amax, FP8_MAX)
    # Clip first: values a rounding step above 448 would otherwise become NaN in E4M3 (it has no inf).
    q = np.clip(w / np.float32(scale), -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return Fp8Tensor(q, scale)


@dataclass(frozen=True)
class Nvfp4Tensor:
    packed: np.ndarray  # uint8 [out, in / 2]: element 2j in the low nibble, 2j + 1 in the high
    block_scales: np.ndarray  # float8_e4m3fn [out, in / 16]
    global_scale: float
    shape: tuple[int, int]

    def dequantize(self) -> np.ndarray:
        values = unpack_fp4(self.packed).astype(np.float32)
        scales = self.block_scales.astype(np.float32) * np.float32(self.global_scale)
        return values * np.repeat(scales, NVFP4_BLOCK, axis=1)


def pack_fp4(values: np.ndarray) -> np.ndarray:
    """float4_e2m1fn [r, c] (c even) -> uint8 [r, c / 2], low nibble first."""
    bits = values.view(np.uint8) & 0x0F
    return (bits[:, 0::2] | (bits[:, 1::2] << 4)).astype(np.uint8)


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    out = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out.view(ml_dtypes.float4_e2m1fn)


def nvfp4_global_scale(w: np.ndarray) -> float:
    """An nvfp4 weight's global scale: max|w| / (6 x 448), so that the largest block scale is E4M3's largest."""
    return per_tensor_scale(float(np.abs(w).max()), FP4_MAX * FP8_MAX)


def quantize_nvfp4(w: np.ndarray, amax: float | None = None, block_scales: np.ndarray | None = None) -> Nvfp4Tensor:
    """Block scales e4m3(max|block| / (6 x global)) unless `block_scales` [rows, cols / 16] gives them (E4M3 values:
    the nvfp4 block scale search, quantization/awq.py); codes e2m1(clip(w / (block_scale x global)))."""
    w = np.asarray(w, dtype=np.float32)
    rows, cols = w.shape
    if cols % NVFP4_BLOCK:
        raise ValueError(f"nvfp4 needs the input dimension to be a multiple of {NVFP4_BLOCK}, got {cols}")
    global_scale = nvfp4_global_scale(w) if amax is None else per_tensor_scale(amax, FP4_MAX * FP8_MAX)
    blocks = w.reshape(rows, cols // NVFP4_BLOCK, NVFP4_BLOCK)
    if block_scales is None:
        block_amax = np.abs(blocks).max(axis=2)
        block_scales = np.clip(block_amax / np.float32(FP4_MAX * global_scale), 0, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    else:
        if block_scales.shape != (rows, cols // NVFP4_BLOCK):
            raise ValueError(f"nvfp4 block scales must be [{rows}, {cols // NVFP4_BLOCK}], got {list(block_scales.shape)}")
        exact = np.asarray(block_scales, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)
        if not np.array_equal(exact.astype(np.float32), block_scales):
            raise ValueError("nvfp4 block scales must be E4M3 values")
        block_scales = exact
    # Divide by the scale as stored (rounded to E4M3), so dequantization inverts exactly what was done.
    effective = block_scales.astype(np.float32) * np.float32(global_scale)
    safe = np.where(effective > 0, effective, 1.0)[:, :, None]
    q = np.clip(blocks / safe, -FP4_MAX, FP4_MAX).astype(ml_dtypes.float4_e2m1fn).reshape(rows, cols)
    return Nvfp4Tensor(pack_fp4(q), block_scales, global_scale, (rows, cols))


@dataclass(frozen=True)
class Int4Tensor:
    packed: np.ndarray  # uint8 [out, in / 2]: two's-complement nibbles, low nibble first
    scales: np.ndarray  # float32 [out, in / group_size], bf16 values
    group_size: int
    offsets: np.ndarray | None = None  # float32 [out, in / group_size], bf16 values: asymmetric groups only

    def dequantize(self) -> np.ndarray:
        w = unpack_int4(self.packed).astype(np.float32) * np.repeat(self.scales, self.group_size, axis=1)
        return w if self.offsets is None else w + np.repeat(self.offsets, self.group_size, axis=1)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    out = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.int8)
    nibbles = (packed & 0x0F, packed >> 4)
    for k, n in enumerate(nibbles):
        out[:, k::2] = np.where(n >= 8, n.astype(np.int16) - 16, n).astype(np.int8)
    return out


def default_group_size(cols: int) -> int:
    """64, or 32 where 64 does not divide the input size. Groups of 64 with bf16 scales and offsets cost the same
    4.5 bits a weight as groups of 128 with float32 ones did, for a third less loss (benchmarks/README.md, --dither)."""
    for g in (64, 32):
        if cols % g == 0:
            return g
    raise ValueError(f"int4 groups need an input dimension divisible by 32, got {cols}")


def quantize_int4(
    w: np.ndarray,
    group_size: int | None = None,
    scales: np.ndarray | None = None,
    asymmetric: bool = False,
    offsets: np.ndarray | None = None,
) -> Int4Tensor:
    """Codes rint((w - offset) / scale) clamped to [-8, 7]. Symmetric: offset 0, scale = max|group| / 7. Asymmetric:
    scale = (max - min) / 15 and offset = min + 8 * scale, so that the group's min and max are codes -8 and 7. `scales`
    (and, asymmetric, `offsets`) [rows, groups] replace the plain ones (int4_awq's scale search, quantization/awq.py).
    Scales and offsets are rounded to bf16 values first (the CPU kernels' storage), so the codes fit them."""
    w = np.asarray(w, dtype=np.float32)
    rows, cols = w.shape
    g = group_size or default_group_size(cols)
    if cols % g or cols % 2:
        raise ValueError(f"group size {g} does not divide the input dimension {cols}")
    if (offsets is not None and not asymmetric) or ((scales is None) != (offsets is None) and asymmetric):
        raise ValueError("offsets come with asymmetric int4 only, and with its scales")
    groups = w.reshape(rows, cols // g, g)
    if scales is None:
        if asymmetric:
            low, high = groups.min(axis=2), groups.max(axis=2)
            scales = (high - low) / np.float32(15)
            offsets = low + np.float32(8) * scales
        else:
            scales = np.abs(groups).max(axis=2) / INT4_MAX
    for name, given in (("scales", scales), ("offsets", offsets)):
        if given is not None and given.shape != (rows, cols // g):
            raise ValueError(f"int4 {name} must be [{rows}, {cols // g}], got {list(given.shape)}")
    scales = bf16_values(scales)
    offsets = None if offsets is None else bf16_values(offsets)
    safe = np.where(scales > 0, scales, 1.0)[:, :, None]
    centred = groups if offsets is None else groups - offsets[:, :, None]
    q = np.clip(np.rint(centred / safe), -8, INT4_MAX).astype(np.int8).reshape(rows, cols)
    nib = (q & 0x0F).astype(np.uint8)
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    return Int4Tensor(packed, scales, g, offsets)


def bf16_values(a: np.ndarray) -> np.ndarray:
    """float32 `a` rounded to the nearest bf16 values (ties to even), as float32."""
    return np.asarray(a, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def fake_quant_fp8_activation(x: np.ndarray, scale: float) -> np.ndarray:
    """fp8 static: e4m3(clip(x / scale)) * scale, with the calibrated per-tensor scale."""
    s = np.float32(scale)
    q = np.clip(np.asarray(x, dtype=np.float32) / s, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float32) * s


def fp8_dynamic_scales(x: np.ndarray) -> np.ndarray:
    """fp8 dynamic (per-token) activation scales of x [rows, cols]: max|row| / 448 in float32, 1 for an all-zero row."""
    amax = np.abs(np.asarray(x, dtype=np.float32)).max(axis=-1, keepdims=True)
    return np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)


def fake_quant_fp8_dynamic(x: np.ndarray) -> np.ndarray:
    """fp8 dynamic: each row on its own scale (fp8_dynamic_scales), e4m3(clip(x / scale)) * scale."""
    s = fp8_dynamic_scales(x)
    q = np.clip(np.asarray(x, dtype=np.float32) / s, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float32) * s


def fake_quant_nvfp4_activation(x: np.ndarray, global_scale: float) -> np.ndarray:
    """nvfp4 dynamic, per 16 consecutive values of each row: block_scale = e4m3(block_amax / (6 * global)),
    effective = block_scale * global, x ~ e2m1(clip(x / effective)) * effective."""
    x = np.asarray(x, dtype=np.float32)
    rows, cols = x.shape
    g = np.float32(global_scale)
    blocks = x.reshape(rows, cols // NVFP4_BLOCK, NVFP4_BLOCK)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    block_scale = np.clip(amax / (np.float32(FP4_MAX) * g), -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    effective = block_scale.astype(np.float32) * g
    safe = np.where(effective > 0, effective, np.float32(1))
    q = np.clip(blocks / safe, -FP4_MAX, FP4_MAX).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return (q * effective).reshape(rows, cols)
