"""Weight format numerics, bit-exact against ml_dtypes' conversions."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from precast.engine.formats import (
    FP8_MAX,
    bf16_values,
    default_group_size,
    pack_fp4,
    quantize_fp8,
    quantize_int4,
    quantize_nvfp4,
    unpack_fp4,
    unpack_int4,
)

RNG = np.random.default_rng(0)
W = (RNG.standard_normal((64, 96)) * 0.05).astype(np.float32)


def test_fp8_is_mldtypes_e4m3_of_scaled_weights():
    t = quantize_fp8(W)
    assert t.scale == pytest.approx(np.abs(W).max() / FP8_MAX)
    expected = (W / np.float32(t.scale)).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(t.values.view(np.uint8), expected.view(np.uint8))
    assert np.abs(t.dequantize()).max() <= np.abs(W).max() * (1 + 1e-6)
    # Relative error of E4M3 (3 mantissa bits) is at most 2^-4 for normal values.
    big = np.abs(W) > t.scale * 2**-6 * 4
    assert (np.abs(t.dequantize() - W)[big] / np.abs(W)[big]).max() <= 2**-4 + 1e-6


def test_fp8_never_produces_nan_at_the_edge():
    w = np.array([[448.0, -448.0, 447.99997, 0.0]], np.float32)
    t = quantize_fp8(w, amax=447.9)  # calibration amax below the true max: clipped, not NaN
    assert np.isfinite(t.values.astype(np.float32)).all()


def test_fp4_pack_round_trips_every_code():
    codes = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).reshape(2, 8)
    np.testing.assert_array_equal(unpack_fp4(pack_fp4(codes)).view(np.uint8), codes.view(np.uint8))
    assert pack_fp4(codes)[0, 0] == 0x10  # element 0 in the low nibble, element 1 in the high


def test_nvfp4_two_level_scales():
    t = quantize_nvfp4(W)
    assert t.global_scale == pytest.approx(np.abs(W).max() / (6 * 448))
    blocks = W.reshape(64, 6, 16)
    want_scales = (np.abs(blocks).max(axis=2) / np.float32(6 * t.global_scale)).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(t.block_scales.view(np.uint8), want_scales.view(np.uint8))
    effective = t.block_scales.astype(np.float32) * np.float32(t.global_scale)
    want_q = np.clip(blocks / effective[:, :, None], -6, 6).astype(ml_dtypes.float4_e2m1fn).reshape(64, 96)
    np.testing.assert_array_equal(unpack_fp4(t.packed).view(np.uint8), want_q.view(np.uint8))
    # E2M1 has 1 mantissa bit: error at most a quarter of each block's scale times 4 (the top step, 4 -> 6).
    err = np.abs(t.dequantize() - W).reshape(64, 6, 16).max(axis=2)
    assert (err <= effective * 1.0 + 1e-7).all()


def test_nvfp4_refuses_non_multiple_of_16():
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(np.ones((4, 24), np.float32))


def test_int4_groups():
    assert default_group_size(576) == 64 and default_group_size(1536) == 64 and default_group_size(96) == 32
    t = quantize_int4(W)
    assert t.group_size == 32 and t.scales.shape == (64, 3)
    q = np.rint(W.reshape(64, 3, 32) / t.scales[:, :, None]).clip(-8, 7)
    np.testing.assert_allclose(t.dequantize(), (q * t.scales[:, :, None]).reshape(64, 96), rtol=0, atol=0)
    assert np.abs(t.dequantize() - W).max() <= t.scales.max() / 2 + 1e-7


def test_int4_scales_and_offsets_are_bf16_values():
    """The CPU kernels keep group scales and offsets in bf16, so the quantizer rounds them first and picks the
    codes for the rounded values: searched scales too."""
    for t in (quantize_int4(W), quantize_int4(W + 0.5, 32, asymmetric=True)):
        for a in (t.scales, t.offsets):
            if a is not None:
                assert a.dtype == np.float32
                np.testing.assert_array_equal(a, bf16_values(a))
    given = np.full((64, 3), 0.0123456, np.float32)
    t = quantize_int4(W, 32, given, asymmetric=True, offsets=np.full((64, 3), 0.001, np.float32))
    assert t.scales[0, 0] == bf16_values(given)[0, 0] != given[0, 0]
    q = np.rint((W.reshape(64, 3, 32) - t.offsets[:, :, None]) / t.scales[:, :, None]).clip(-8, 7)
    np.testing.assert_array_equal(unpack_int4(t.packed).reshape(64, 3, 32), q)


def test_asymmetric_int4_groups_span_their_min_and_max():
    """Each group's min and max are codes -8 and 7 (scale (max - min) / 15, offset min + 8 scale), every value is
    within half a step, and a constant group is exact."""
    w = W + np.float32(0.5)  # off-centre groups, where an offset pays
    w[1, :32] = 0.25
    t = quantize_int4(w, 32, asymmetric=True)
    groups = w.reshape(64, 3, 32)
    scales = (groups.max(2) - groups.min(2)) / np.float32(15)
    np.testing.assert_array_equal(t.scales, bf16_values(scales))  # rounded to bf16, and the codes chosen for them
    np.testing.assert_array_equal(t.offsets, bf16_values(groups.min(2) + np.float32(8) * scales))
    codes, spread = unpack_int4(t.packed).reshape(64, 3, 32), t.scales[:, :, None] > 0
    assert (codes[(groups == groups.min(2, keepdims=True)) & spread] == -8).all()
    assert (codes[(groups == groups.max(2, keepdims=True)) & spread] == 7).all()
    deq = t.dequantize()
    assert np.abs(deq - w).max() <= t.scales.max() / 2 + 1e-6
    np.testing.assert_array_equal(deq[1, :32], 0.25)
    sym = quantize_int4(w, 32)
    assert np.abs(deq - w).mean() < 0.8 * np.abs(sym.dequantize() - w).mean()
    with pytest.raises(ValueError, match="offsets come with asymmetric int4 only"):
        quantize_int4(w, 32, t.scales, offsets=t.offsets)
    with pytest.raises(ValueError, match="offsets come with asymmetric int4 only"):
        quantize_int4(w, 32, t.scales, asymmetric=True)
    with pytest.raises(ValueError, match="offsets must be"):
        quantize_int4(w, 32, t.scales, asymmetric=True, offsets=t.offsets[:, :2])
