"""The C++ side of quantization: FP8/FP4 rounding, activation quantization and the quantized
linear kernels, against the Python definitions (quantization/formats.py) and ml_dtypes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from precast import _C
from precast.engine.formats import (
    Int4Tensor,
    bf16_values,
    fake_quant_fp8_activation,
    fake_quant_nvfp4_activation,
    quantize_fp8,
    quantize_int4,
    quantize_nvfp4,
)

RNG = np.random.default_rng(7)


def _interesting_floats() -> np.ndarray:
    """Random values over many binades, every E4M3 value and the midpoints between neighbours (ties)."""
    every = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    every = every[np.isfinite(every)]
    grid = np.unique(every)
    ties = (grid[:-1] + grid[1:]) / 2
    scale = np.float32(2.0) ** RNG.integers(-14, 10, 20000)
    random = (RNG.standard_normal(20000) * scale).astype(np.float32)
    return np.concatenate([every, ties, -ties, random, [0.0, -0.0, 448.0, 464.0, 500.0, -1e6, 1e-30]]).astype(np.float32)


def test_e4m3_rounding_is_bit_exact_with_ml_dtypes():
    x = _interesting_floats()
    expected = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(_C.round_to_e4m3(x), expected.astype(np.float32))
    np.testing.assert_array_equal(_C.e4m3_bits(x), expected.view(np.uint8))


def test_e2m1_rounding_is_bit_exact_with_ml_dtypes():
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    ties = (grid[:-1] + grid[1:]) / 2
    x = np.concatenate([grid, -grid, ties, -ties, RNG.standard_normal(20000).astype(np.float32) * 3, [7.0, -100.0]]).astype(np.float32)
    expected = np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(_C.round_to_e2m1(x), expected)


@pytest.mark.parametrize("scale", [1e-3, 0.037, 2.5])
def test_fp8_activation_quantization_matches_definition(scale):
    x = (RNG.standard_normal((33, 80)) * RNG.exponential(1.0, (33, 80))).astype(np.float32)
    np.testing.assert_array_equal(_C.fake_quant_fp8(x, scale), fake_quant_fp8_activation(x, scale))


@pytest.mark.parametrize("global_scale", [1e-4, 3e-3, 0.2])
def test_nvfp4_activation_quantization_matches_definition(global_scale):
    x = (RNG.standard_normal((17, 96)) * RNG.exponential(1.0, (17, 96))).astype(np.float32)
    x[3, :16] = 0.0  # an all-zero block
    ours = _C.fake_quant_nvfp4(x, global_scale)
    np.testing.assert_array_equal(ours, fake_quant_nvfp4_activation(x, global_scale))
    # Dynamic per 16: every block uses at most 8 magnitudes of its own scale.
    for block in ours.reshape(-1, 16):
        assert len(np.unique(np.abs(block))) <= 8


def _stored(fmt: str, w: np.ndarray, group: int | None = None):
    """(dtype, values, group_scales, group_size, scale, dequantized) for one format; "int4_asym" also returns its
    group offsets, as a seventh item (None otherwise)."""
    if fmt == "fp8":
        q = quantize_fp8(w)
        return _C.WeightDtype.FP8, q.values.view(np.uint8), None, 0, q.scale, q.dequantize(), None
    if fmt == "nvfp4":
        q4 = quantize_nvfp4(w)
        return _C.WeightDtype.NVFP4, q4.packed, q4.block_scales.view(np.uint8), 16, q4.global_scale, q4.dequantize(), None
    qi = quantize_int4(w, group, asymmetric=fmt == "int4_asym")
    return _C.WeightDtype.INT4, qi.packed, qi.scales, qi.group_size, 1.0, qi.dequantize(), qi.offsets


DOT_UNITS = _C.dot_units()  # every unit this host has: float32 FMAs, and AMX / AVX512-BF16 where present


def _bf16(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16).astype(np.float64)


def _expected(x: np.ndarray, weight: np.ndarray, dot: str) -> np.ndarray:
    """What a unit computes, in float64. On a bf16 unit x is rounded to bf16; the weights are exact
    there (bf16, fp8 and nvfp4 values, int4 codes, with int4's group scales applied to group sums)."""
    if dot == "float32":
        return x.astype(np.float64) @ weight.T.astype(np.float64)
    return _bf16(x) @ weight.T.astype(np.float64)


def _int8_rows(x: np.ndarray, group: int) -> np.ndarray:
    """x as the int8 path sees it (plugins/cpu/int8_gemm.h): per row and group of `group` inputs, int8 codes
    round(x x 127 / amax) (nearest even) times amax / 127."""
    groups = x.reshape(len(x), -1, group).astype(np.float32)
    amax = np.abs(groups).max(axis=2, keepdims=True)
    inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    codes = np.rint(groups * inverse)
    return (codes * (amax / np.float32(127))).astype(np.float64).reshape(x.shape)


def _expected_quantized(fmt: str, x: np.ndarray, dequantized: np.ndarray, group: int, dot: str) -> np.ndarray:
    """_expected for a quantized format; int4 on a unit that multiplies it in int8 takes x quantized per group."""
    if fmt.startswith("int4") and _C.int4_multiplies_in_int8(dot):
        return _int8_rows(x, group) @ dequantized.T.astype(np.float64)
    return _expected(x, dequantized, dot)


@pytest.mark.parametrize("dot", DOT_UNITS)
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "int4", "int4_asym"])
@pytest.mark.parametrize("rows,cols,group", [(64, 64, 32), (100, 96, 32), (130, 576, 64), (7, 128, 128), (300, 64, 32)])
def test_quantized_linear_matches_dequantized_matmul(fmt, rows, cols, group, dot):
    w = (RNG.standard_normal((rows, cols)) * 0.1 + 0.05).astype(np.float32)
    dtype, values, scales, group_size, scale, dequantized, offsets = _stored(fmt, w, group)
    for num_rows in (1, 2, 5, 6, 7, 13, 17, 40):  # every row-block size of the kernels and remainders
        x = RNG.standard_normal((num_rows, cols)).astype(np.float32)
        y = _C.linear(x, dtype, rows, cols, values, scales, group_size, scale, num_threads=2, dot=dot, group_offsets=offsets)
        reference = _expected_quantized(fmt, x, dequantized, group, dot)
        np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())


@pytest.mark.parametrize("dot", DOT_UNITS)
def test_int4_group_scales_and_offsets_are_held_in_bf16(dot):
    """Scales and offsets that are not bf16 values (engines built before the quantizer rounded them) are rounded to
    the nearest bf16 when packed: the result is the matmul with the rounded ones."""
    rows, cols, group = 96, 128, 32
    w = (RNG.standard_normal((rows, cols)) * 0.1 + 0.05).astype(np.float32)
    qi = quantize_int4(w, group, asymmetric=True)
    scales = (qi.scales * (1 + RNG.uniform(-3e-3, 3e-3, qi.scales.shape))).astype(np.float32)
    offsets = (qi.offsets * (1 + RNG.uniform(-3e-3, 3e-3, qi.offsets.shape))).astype(np.float32)
    assert (scales != bf16_values(scales)).any() and (offsets != bf16_values(offsets)).any()
    held = Int4Tensor(qi.packed, bf16_values(scales), group, bf16_values(offsets)).dequantize()
    for num_rows in (1, 7):
        x = RNG.standard_normal((num_rows, cols)).astype(np.float32)
        y = _C.linear(x, _C.WeightDtype.INT4, rows, cols, qi.packed, scales, group, 1.0, num_threads=2, dot=dot, group_offsets=offsets)
        reference = _expected_quantized("int4_asym", x, held, group, dot)
        np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())


@pytest.mark.parametrize("dot", DOT_UNITS)
def test_bf16_linear_multiplies_bf16_values(dot):
    rows, cols = 150, 320
    w = RNG.standard_normal((rows, cols)).astype(ml_dtypes.bfloat16)
    for num_rows in (1, 6, 16, 33, 200):  # one row block, several, several row chunks of 96
        x = RNG.standard_normal((num_rows, cols)).astype(np.float32)
        y = _C.linear(x, _C.WeightDtype.BF16, rows, cols, w.view(np.uint8), num_threads=2, dot=dot)
        reference = _expected(x, w.astype(np.float32), dot)
        np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())


@pytest.mark.parametrize("dot", DOT_UNITS)
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "int4", "int4_asym"])
def test_linear_is_batch_invariant(fmt, dot):
    """Each row alone, in a batch of 11, or in a prefill of 230 rows (several row blocks and
    chunks, weights widened once per panel) comes out bit-identical."""
    rows, cols = 200, 128
    w = (RNG.standard_normal((rows, cols)) * 0.1).astype(np.float32)
    offsets = None
    if fmt == "bf16":
        dtype, values, scales, group_size, scale = _C.WeightDtype.BF16, w.astype(ml_dtypes.bfloat16).view(np.uint8), None, 0, 1.0
    else:
        dtype, values, scales, group_size, scale, _, offsets = _stored(fmt, w, 32)
    x = RNG.standard_normal((230, cols)).astype(np.float32)

    def run(rows_x: np.ndarray, threads: int) -> np.ndarray:
        return _C.linear(rows_x, dtype, rows, cols, values, scales, group_size, scale, threads, dot=dot, group_offsets=offsets)

    prefill, together = run(x, 2), run(x[:11], 2)
    np.testing.assert_array_equal(prefill[:11], together)
    for r in (0, 5, 10, 99, 229):
        np.testing.assert_array_equal(run(x[r : r + 1], 1)[0], prefill[r])


def test_dot_unit_names():
    assert _C.dot_unit() in DOT_UNITS and "float32" in DOT_UNITS
    with pytest.raises(ValueError, match="unknown dot-product unit 'tpu'"):
        _C.linear(np.ones((1, 64), np.float32), _C.WeightDtype.BF16, 64, 64, np.zeros(64 * 64 * 2, np.uint8), dot="tpu")


def test_linear_rejects_wrong_sizes():
    w = np.zeros((64, 64), np.float32)
    dtype, values, scales, group_size, scale, _, offsets = _stored("int4_asym", w + 1, 32)
    x = np.ones((1, 64), np.float32)
    with pytest.raises(ValueError, match="value bytes"):
        _C.linear(x, dtype, 64, 64, values[:, :-1].copy(), scales, group_size, scale)
    with pytest.raises(ValueError, match="group scales"):
        _C.linear(x, dtype, 64, 64, values, scales[:, :-1].copy(), group_size, scale)
    with pytest.raises(ValueError, match="group offset bytes"):
        _C.linear(x, dtype, 64, 64, values, scales, group_size, scale, group_offsets=offsets[:, :-1].copy())
    fp8 = _stored("fp8", w + 1)
    with pytest.raises(ValueError, match="group offsets come with int4 weights only"):
        _C.linear(x, fp8[0], 64, 64, fp8[1], None, 0, fp8[4], group_offsets=offsets)
