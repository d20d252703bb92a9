"""Gated activations: out = act(gate) * up for rows of [gate | up]; act(g) = g * sigmoid(a) with a = g (SiLU)
or a = 2 sqrt(2/pi) (g + 0.044715 g^3) (GELU-tanh: 0.5 (1 + tanh(z)) = sigmoid(2z)), as the CPU kernel; quantized
to E4M3 here when the down projection takes fp8 inputs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from precast.plugins.triton.numerics import round_to_e4m3

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


@triton.jit
def _gated_kernel(gate_up_ptr, out_ptr, inter, fp8_scale, GELU: tl.constexpr, FP8: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gate_up_ptr + row * 2 * inter + cols, mask=mask, other=0.0)
    u = tl.load(gate_up_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0)
    arg = g
    if GELU:
        arg = 2.0 * 0.7978845608028654 * (g + 0.044715 * g * g * g)
    y = g / (1.0 + tl.exp(-arg)) * u
    if FP8:
        tl.store(out_ptr + row * inter + cols, round_to_e4m3(y / fp8_scale).to(tl.float8e4nv), mask=mask)
    else:
        tl.store(out_ptr + row * inter + cols, y, mask=mask)


def gated_activation(
    gate_up: torch.Tensor, activation: str, out: torch.Tensor | None = None, fp8_scale: float | None = None
) -> torch.Tensor:
    """float32 [rows, 2 * inter] -> [rows, inter] float32, or float8_e4m3fn (value / fp8_scale) with fp8_scale."""
    rows, width = gate_up.shape
    inter = width // 2
    dtype = torch.float32 if fp8_scale is None else torch.float8_e4m3fn
    out = torch.empty((rows, inter), dtype=dtype, device=gate_up.device) if out is None else out
    if rows:
        block = min(1024, triton.next_power_of_2(inter))
        _gated_kernel[(rows, triton.cdiv(inter, block))](
            gate_up, out, inter, fp8_scale or 1.0, GELU=ACTIVATIONS[activation] == 1, FP8=fp8_scale is not None, BLOCK=block
        )
    return out
