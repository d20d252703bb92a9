"""Linear layers y = x W^T (+ bias) for every engine format, and the run-time input quantizers.

Weights stay in their stored format in device memory and are widened in registers, tile by tile:
  dense   float32 / bfloat16 / float16 [out, in]
  fp8     E4M3 [out, in], one per-tensor scale; inputs quantized to E4M3 with the static input scale, and the
          product taken on fp8 operands (Hopper's fp8 tensor cores), scaled once by input_scale * weight_scale
  int4    two's-complement nibbles [out, in / 2] (low nibble first), a float32 scale per group of inputs and,
          asymmetric, a float32 offset per group (w = code * scale + offset)
  nvfp4   E2M1 nibbles [out, in / 2], E4M3 scales per 16 inputs and a global scale; inputs quantized per 16 at
          run time. E2M1 x E4M3 values have at most 6 significant bits, so both operands are exact in bf16: the
          product runs on bf16 tensor cores with no rounding, scaled by the two global scales
Activations are float32 between kernels. `precision` picks the multiply for dense and int4 weights:
"float32" (IEEE float32 FMAs: the CPU runner's numerics, up to summation order) or "weights" (inputs and
widened weights rounded to the engine dtype, bf16 / fp16 tensor cores with float32 accumulation; float32
engines stay float32). In the interpreter bf16 operands are rounded in float32 and multiplied as float32:
the same products a GPU's bf16 tensor cores form, since a bf16 x bf16 product is exact in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from precast.plugins.triton.numerics import (
    FP4_MAX,
    NVFP4_BLOCK,
    decode_e2m1,
    decode_int4,
    interpreting,
    nibble,
    round_to_bf16,
    round_to_e2m1,
    round_to_e4m3,
)

FORMATS = {"dense": 0, "fp8": 1, "int4": 2, "nvfp4": 3}
DOT_FP32, DOT_BF16, DOT_FP16, DOT_FP8 = 0, 1, 2, 3
INPUT_QUANT = ("none", "fp8", "nvfp4")


@dataclass
class LinearWeight:
    """One linear layer's weight on the device, in its stored format (see the module docstring)."""

    format: str  # dense | fp8 | int4 | nvfp4
    values: torch.Tensor  # dense: [rows, cols] float; fp8: float8_e4m3fn [rows, cols]; 4-bit: uint8 [rows, cols / 2]
    rows: int
    cols: int
    scales: torch.Tensor | None = None  # int4: float32 [rows, cols / group]; nvfp4: float8_e4m3fn [rows, cols / 16]
    group_size: int = 0
    offsets: torch.Tensor | None = None  # asymmetric int4: float32 [rows, cols / group]
    weight_scale: float = 1.0  # fp8: per-tensor scale; nvfp4: global scale
    input_quant: str = "none"  # how the layer's input is quantized at run time (its recipe)
    input_scale: float = 1.0  # fp8: static input scale; nvfp4: input global scale

    def __post_init__(self) -> None:
        if self.format not in FORMATS or self.input_quant not in INPUT_QUANT:
            raise ValueError(f"unknown linear format {self.format!r} / input quantization {self.input_quant!r}")
        if self.format == "fp8" and self.input_quant != "fp8":
            raise ValueError("fp8 weights multiply fp8-quantized inputs (the fp8 recipe); weight-only fp8 has no kernel")
        if self.format == "nvfp4" and self.input_quant != "nvfp4":
            raise ValueError("nvfp4 weights multiply nvfp4-quantized inputs (the nvfp4 recipe); weight-only nvfp4 has no kernel")
        if self.offsets is not None and self.format != "int4":
            raise ValueError("group offsets come with int4 weights only")

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.values, self.scales, self.offsets) if t is not None)


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, bias_ptr, y_ptr, M, N, K, y_stride, out_scale,
    W_FORMAT: tl.constexpr, DOT: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
    INTERPRET: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    m_mask, n_mask = rm < M, rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        k_mask = rk < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        rows = rn[None, :].to(tl.int64)
        if W_FORMAT == 0 or W_FORMAT == 1:  # [BK, BN] of W^T, as stored
            w = tl.load(w_ptr + rows * K + rk[:, None], mask=w_mask, other=0.0)
        else:
            code = nibble(tl.load(w_ptr + rows * (K // 2) + rk[:, None] // 2, mask=w_mask, other=0), rk[:, None])
            scale = tl.load(scale_ptr + rows * (K // GROUP) + rk[:, None] // GROUP, mask=w_mask, other=0.0).to(tl.float32)
            if W_FORMAT == 2:
                w = decode_int4(code) * scale
                if HAS_OFFSET:  # asymmetric groups: the widened weight is code * scale + offset
                    group = rows * (K // GROUP) + rk[:, None] // GROUP
                    w += tl.load(offset_ptr + group, mask=w_mask, other=0.0)
            else:
                w = decode_e2m1(code) * scale
        if DOT == 3:  # E4M3 x E4M3, accumulated in float32
            acc += tl.dot(x, w)
        elif DOT == 0:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        elif DOT == 1:
            if INTERPRET:
                acc += tl.dot(round_to_bf16(x.to(tl.float32)), round_to_bf16(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x.to(tl.bfloat16), w.to(tl.bfloat16))
        else:
            acc += tl.dot(x.to(tl.float16), w.to(tl.float16))
    y = acc * out_scale
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=n_mask, other=0.0)[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * y_stride + rn[None, :], y, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _quantize_fp8_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    x = tl.load(x_ptr + i, mask=mask, other=0.0)
    tl.store(out_ptr + i, round_to_e4m3(x / scale).to(tl.float8e4nv), mask=mask)


@triton.jit
def _quantize_nvfp4_kernel(x_ptr, out_ptr, cols, global_scale, NB: tl.constexpr):
    """One row: per 16 values, block scale e4m3(amax / (6 * global)); out = e2m1(x / (block * global)) * block."""
    row = tl.program_id(0).to(tl.int64)
    blocks = tl.arange(0, NB)
    offs = blocks[:, None] * 16 + tl.arange(0, 16)[None, :]
    mask = offs < cols
    x = tl.load(x_ptr + row * cols + offs, mask=mask, other=0.0)
    amax = tl.max(tl.abs(x), axis=1)
    block = round_to_e4m3(amax / (FP4_MAX * global_scale))
    effective = block * global_scale
    safe = tl.where(effective > 0.0, effective, 1.0)
    q = round_to_e2m1(x / safe[:, None])
    tl.store(out_ptr + row * cols + offs, q * block[:, None], mask=mask)


def quantize_fp8_input(x: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 [rows, cols] -> E4M3 values of x / scale (nearest even, saturating), float8_e4m3fn."""
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    n = x.numel()
    if n:
        _quantize_fp8_kernel[(triton.cdiv(n, 1024),)](x, out, n, scale, BLOCK=1024)
    return out


def quantize_nvfp4_input(x: torch.Tensor, global_scale: float) -> torch.Tensor:
    """float32 [rows, cols] -> e2m1 value x its E4M3 block scale, per 16 values (the global scale left out:
    the GEMM applies it), float32 and exact in bf16."""
    rows, cols = x.shape
    if cols % NVFP4_BLOCK:
        raise ValueError(f"nvfp4 inputs need a size that is a multiple of {NVFP4_BLOCK}, got {cols}")
    out = torch.empty_like(x)
    if rows:
        _quantize_nvfp4_kernel[(rows,)](x, out, cols, global_scale, NB=triton.next_power_of_2(cols // NVFP4_BLOCK))
    return out


def _dot_mode(weight: LinearWeight, precision: str, compute_dtype: torch.dtype | None) -> int:
    if weight.format == "fp8":
        return DOT_FP8
    if weight.format == "nvfp4":
        return DOT_BF16  # exact: see the module docstring
    if precision == "float32":
        return DOT_FP32
    dtype = weight.values.dtype if weight.format == "dense" else compute_dtype
    return {torch.bfloat16: DOT_BF16, torch.float16: DOT_FP16}.get(dtype, DOT_FP32)


def linear(
    x: torch.Tensor,
    weight: LinearWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    precision: str = "float32",
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """float32 x [M, cols] -> float32 [M, rows]. An fp8 layer also takes x already quantized (float8_e4m3fn,
    from a norm or activation kernel that quantized its output). `compute_dtype`: the engine dtype that
    precision="weights" rounds int4 products to (dense weights carry their own)."""
    if precision not in ("float32", "weights"):
        raise ValueError(f"precision must be 'float32' or 'weights', got {precision!r}")
    M, K = x.shape
    if K != weight.cols:
        raise ValueError(f"linear input has {K} columns, the weight {weight.cols}")
    N = weight.rows
    out = torch.empty((M, N), dtype=torch.float32, device=x.device) if out is None else out
    if M == 0:
        return out
    out_scale = 1.0
    if x.dtype == torch.float8_e4m3fn and weight.input_quant != "fp8":
        raise ValueError("an fp8-quantized input for a layer that does not take fp8 inputs")
    if weight.input_quant == "fp8":
        if x.dtype != torch.float8_e4m3fn:
            x = quantize_fp8_input(x, weight.input_scale)
        out_scale = weight.input_scale * weight.weight_scale
    elif weight.input_quant == "nvfp4":
        x = quantize_nvfp4_input(x, weight.input_scale)
        out_scale = weight.input_scale * weight.weight_scale
    dot = _dot_mode(weight, precision, compute_dtype)
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    block_n, block_k = 64, 64
    scales = weight.scales if weight.scales is not None else weight.values
    _linear_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n))](
        x, weight.values, scales, weight.offsets if weight.offsets is not None else scales,
        bias if bias is not None else out, out, M, N, K, out.stride(0), out_scale,
        W_FORMAT=FORMATS[weight.format], DOT=dot, GROUP=max(weight.group_size, 1), HAS_OFFSET=weight.offsets is not None,
        HAS_BIAS=bias is not None, INTERPRET=interpreting(), BM=block_m, BN=block_n, BK=block_k,
    )  # fmt: skip
    return out
