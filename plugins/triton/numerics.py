"""Number formats inside kernels, computed with integer and float32 arithmetic only.

The interpreter converts float32 to bf16 and to E4M3 with other rounding than a GPU's round-to-nearest-even
(measured with triton 3.9: half of bf16 conversions and 2.5% of E4M3 ones differ), so values are rounded
onto a format's grid here, in float32, the same way in both modes; converting an already representable value
is then exact everywhere. E2M1 has no Triton dtype at all: its nibbles are decoded arithmetically.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

FP8_MAX = 448.0
FP4_MAX = 6.0
NVFP4_BLOCK = 16


def interpreting() -> bool:
    """Whether kernels run in Triton's interpreter (TRITON_INTERPRET=1, read when the kernels were defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def rint(x):
    """Round to the nearest integer, ties to even, for |x| < 2**22 (float32: adding 1.5 * 2**23 leaves no fraction bits)."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def round_to_e4m3(x):
    """x on the E4M3 grid (round to nearest even, saturating at 448), still float32."""
    a = tl.minimum(tl.abs(x), FP8_MAX)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # subnormals share the smallest normal's spacing, 2**-9
    quantum = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    q = tl.minimum(rint(a / quantum) * quantum, FP8_MAX)
    return tl.where(x < 0, -q, q)


@triton.jit
def round_to_e2m1(x):
    """x on the E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} (round to nearest even, saturating at 6), float32."""
    a = tl.abs(x)
    q = tl.where(
        a <= 0.25,
        0.0,
        tl.where(
            a < 0.75,
            0.5,
            tl.where(
                a <= 1.25, 1.0, tl.where(a < 1.75, 1.5, tl.where(a <= 2.5, 2.0, tl.where(a < 3.5, 3.0, tl.where(a <= 5.0, 4.0, 6.0))))
            ),
        ),
    )
    return tl.where(x < 0, -q, q)


@triton.jit
def round_to_bf16(x):
    """x rounded to bfloat16 precision (nearest even), kept in float32."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def round_to_f16(x):
    """x rounded to float16 precision in the interpreter's way and a GPU's alike (float16 conversion is exact there)."""
    return x.to(tl.float16).to(tl.float32)


@triton.jit
def nibble(packed, k):
    """The 4-bit code of element k from bytes holding two (element 2j in the low nibble)."""
    return (packed.to(tl.int32) >> ((k % 2) * 4)) & 0xF


@triton.jit
def decode_int4(code):
    """A two's-complement nibble as float32 in [-8, 7]."""
    return tl.where(code >= 8, code - 16, code).to(tl.float32)


@triton.jit
def decode_e2m1(code):
    """An E2M1 nibble (sign, 2 exponent bits, 1 mantissa bit) as float32."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    power = tl.where(exponent == 1, 0.5, tl.where(exponent == 2, 1.0, 2.0))
    magnitude = tl.where(exponent == 0, mantissa * 0.5, (2.0 + mantissa) * power)
    return tl.where((code & 8) != 0, -magnitude, magnitude)
