"""RMSNorm over rows, optionally adding a residual first (the CPU runner's add_then_norm):
x += residual (stored back), out = weight * (x / sqrt(mean(x^2) + eps)). When the next linear layer takes
fp8 inputs, the output is quantized here (E4M3 of out / input_scale), saving that layer a pass over it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from precast.plugins.triton.numerics import round_to_e4m3


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, rows, dim, x_stride, out_stride, eps, fp8_scale,
    ADD: tl.constexpr, FP8: tl.constexpr, BR: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BLOCK)
    mask = (row < rows)[:, None] & (cols < dim)[None, :]
    x = tl.load(x_ptr + row[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
    if ADD:
        x = x + tl.load(residual_ptr + row[:, None] * dim + cols[None, :], mask=mask, other=0.0)
        tl.store(x_ptr + row[:, None] * x_stride + cols[None, :], x, mask=mask)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / dim + eps)
    w = tl.load(weight_ptr + cols, mask=cols < dim, other=0.0)
    y = w[None, :] * (x * inv[:, None])
    if FP8:
        tl.store(out_ptr + row[:, None] * out_stride + cols[None, :], round_to_e4m3(y / fp8_scale).to(tl.float8e4nv), mask=mask)
    else:
        tl.store(out_ptr + row[:, None] * out_stride + cols[None, :], y, mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    fp8_scale: float | None = None,
) -> torch.Tensor:
    """Rows of float32 x [rows, dim] (x may be `out`: normed in place). With `residual` [rows, dim], x += residual
    first. With `fp8_scale`, the output is float8_e4m3fn: E4M3 of the normed value / fp8_scale."""
    rows, dim = x.shape
    if out is None:
        out = torch.empty_like(x) if fp8_scale is None else torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    if rows:
        block = triton.next_power_of_2(dim)
        per_program = max(1, min(16, 4096 // block))  # rows per program: wide rows take one each
        _rms_norm_kernel[(triton.cdiv(rows, per_program),)](
            x, residual if residual is not None else x, weight, out, rows, dim, x.stride(0), out.stride(0), eps,
            fp8_scale or 1.0, ADD=residual is not None, FP8=fp8_scale is not None, BR=per_program, BLOCK=block,
        )  # fmt: skip
    return out
