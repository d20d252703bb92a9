"""How linear layers multiply: the `matmul_precision` every backend that runs precast's own kernels takes.

"weights" (default): at the precision the engine's weights define. The CPU runner multiplies bf16 weights, fp8 and
nvfp4 layers (operands exact in bf16) and a bf16 engine's int4 layers (inputs rounded to bf16) on the chip's bf16
dot-product unit (AMX or AVX512-BF16, PRECAST_CPU_DOT picks one) with float32 sums; the CUDA runner on the engine
dtype's tensor cores. "float32": every matrix in IEEE float32 on both, one reference numerics."""

from __future__ import annotations

from precast.errors import PrecastError

MATMUL_PRECISIONS = ("weights", "float32")


def check_matmul_precision(precision: str) -> str:
    if precision not in MATMUL_PRECISIONS:
        raise PrecastError(f"matmul precision must be one of {', '.join(MATMUL_PRECISIONS)}, got {precision!r}")
    return precision
