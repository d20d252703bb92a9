"""The Triton kernels (plugins/triton) under Triton's interpreter, against the CPU kernels (precast._C) and
numpy definitions, on random inputs with poisoned (NaN) outputs and pools. On a GPU (benchmarks/gpu_check.sh:
TRITON_INTERPRET=0 PRECAST_TEST_DEVICE=cuda) the same tests run the compiled kernels."""

from __future__ import annotations

import math
import os

import ml_dtypes
import numpy as np
import pytest
import torch

from precast import _C
from precast.engine import formats
from precast.plugins.triton import (
    LinearWeight,
    embedding_gather,
    gated_activation,
    linear,
    paged_attention,
    quantize_fp8_input,
    quantize_nvfp4_input,
    rms_norm,
    rope_and_cache,
)
from precast.plugins.triton.attention import AttentionBatch

RNG = np.random.default_rng(0)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's numpy exp
DEVICE = os.environ.get("PRECAST_TEST_DEVICE", "cpu")


def t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)


def test_fp8_and_nvfp4_input_quantizers_match_the_cpu_bit_for_bit():
    x = (RNG.standard_normal((7, 96)) * 30).astype(np.float32)
    x[0, :4] = [1000.0, -1000.0, 0.0, 1e-6]  # saturation, zero, the subnormal range
    q = quantize_fp8_input(t(x), 0.37).float().cpu().numpy() * np.float32(0.37)
    np.testing.assert_array_equal(q, _C.fake_quant_fp8(x, 0.37))
    g = 0.05
    scaled = quantize_nvfp4_input(t(x), g).cpu().numpy()
    np.testing.assert_allclose(scaled * np.float32(g), _C.fake_quant_nvfp4(x, g), rtol=1e-6, atol=0)
    # x / global is exact in bf16: the GEMM may multiply it on bf16 tensor cores without rounding
    np.testing.assert_array_equal(scaled.astype(ml_dtypes.bfloat16).astype(np.float32), scaled)


def _weights(fmt: str, rows: int, cols: int, dtype=np.float32):
    """(LinearWeight, the CPU kernel's arguments, dequantized float32 W)."""
    w = RNG.standard_normal((rows, cols)).astype(np.float32)
    if fmt == "dense":
        stored = w.astype(dtype)
        raw = stored.view(np.uint16) if stored.itemsize == 2 else stored
        cpu_dtype = {np.float32: _C.WeightDtype.F32, ml_dtypes.bfloat16: _C.WeightDtype.BF16, np.float16: _C.WeightDtype.F16}[dtype]
        return (
            LinearWeight("dense", t(stored.view(np.uint16)).view(torch.bfloat16) if dtype is ml_dtypes.bfloat16 else t(stored), rows, cols),
            (cpu_dtype, raw.view(np.uint8).reshape(rows, -1), None, 0, 1.0),
            stored.astype(np.float32),
        )
    if fmt == "fp8":
        q = formats.quantize_fp8(w)
        weight = LinearWeight(
            "fp8",
            t(q.values.view(np.uint8)).view(torch.float8_e4m3fn),
            rows,
            cols,
            weight_scale=q.scale,
            input_quant="fp8",
            input_scale=0.02,
        )
        return weight, (_C.WeightDtype.FP8, q.values.view(np.uint8), None, 0, q.scale), q.dequantize()
    if fmt in ("int4", "int4_asym"):
        q = formats.quantize_int4(w + np.float32(0.05), 32, asymmetric=fmt == "int4_asym")  # off-centre: offsets matter
        offsets = None if q.offsets is None else t(q.offsets)
        weight = LinearWeight("int4", t(q.packed), rows, cols, scales=t(q.scales), group_size=32, offsets=offsets)
        return weight, (_C.WeightDtype.INT4, q.packed, q.scales, 32, 1.0, q.offsets), q.dequantize()
    q = formats.quantize_nvfp4(w)
    scales = t(q.block_scales.view(np.uint8)).view(torch.float8_e4m3fn)
    weight = LinearWeight(
        "nvfp4", t(q.packed), rows, cols, scales=scales, group_size=16, weight_scale=q.global_scale, input_quant="nvfp4", input_scale=0.01
    )
    return weight, (_C.WeightDtype.NVFP4, q.packed, q.block_scales.view(np.uint8), 16, q.global_scale), q.dequantize()


@pytest.mark.parametrize("fmt", ["dense", "fp8", "int4", "int4_asym", "nvfp4"])
@pytest.mark.parametrize("rows,cols,batch", [(96, 64, 1), (130, 160, 5), (64, 96, 37)])
def test_linear_matches_the_cpu_kernel(fmt, rows, cols, batch):
    weight, cpu_args, _ = _weights(fmt, rows, cols)
    x = RNG.standard_normal((batch, cols)).astype(np.float32)
    bias = RNG.standard_normal(rows).astype(np.float32)
    out = torch.full((batch, rows), float("nan"), device=DEVICE)
    got = linear(t(x), weight, bias=t(bias), out=out).cpu().numpy()
    if weight.input_quant == "fp8":
        x = _C.fake_quant_fp8(x, weight.input_scale)
    elif weight.input_quant == "nvfp4":
        x = _C.fake_quant_nvfp4(x, weight.input_scale)
    dtype, values, scales, group_size, scale, *offsets = cpu_args
    # the CPU kernel's float32 path: the Triton kernel's default precision (a bf16 unit would round x)
    offsets = (offsets or [None])[0]
    want = _C.linear(x, dtype, rows, cols, values, scales, group_size, scale, 1, 1, "float32", offsets) + bias
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_linear_in_the_weights_precision_rounds_inputs_to_the_engine_dtype(dtype):
    weight, _, w = _weights("dense", 96, 64, dtype)
    x = RNG.standard_normal((3, 64)).astype(np.float32)
    got = linear(t(x), weight, precision="weights").cpu().numpy()
    want = x.astype(dtype).astype(np.float64) @ w.astype(np.float64).T  # products exact; only the sums round
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, x @ w.T, rtol=1e-6, atol=0)  # the inputs were rounded


@pytest.mark.parametrize("fmt", ["int4", "int4_asym"])
def test_int4_in_the_weights_precision_rounds_dequantized_weights_too(fmt):
    weight, _, w = _weights(fmt, 64, 64)
    x = RNG.standard_normal((2, 64)).astype(np.float32)
    got = linear(t(x), weight, precision="weights", compute_dtype=torch.bfloat16).cpu().numpy()
    bf = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_allclose(got, bf(x) @ bf(w).T, rtol=1e-5, atol=1e-5)


def test_linear_refuses_mismatches():
    weight, _, _ = _weights("dense", 8, 32)
    with pytest.raises(ValueError, match="16 columns, the weight 32"):
        linear(torch.zeros(2, 16, device=DEVICE), weight)
    with pytest.raises(ValueError, match="weight-only fp8"):
        LinearWeight("fp8", torch.zeros(8, 32, dtype=torch.float8_e4m3fn, device=DEVICE), 8, 32)
    with pytest.raises(ValueError, match="offsets come with int4 weights only"):
        LinearWeight("dense", torch.zeros(8, 32, device=DEVICE), 8, 32, offsets=torch.zeros(8, 1, device=DEVICE))


def test_rms_norm_with_and_without_residual():
    x = RNG.standard_normal((5, 72)).astype(np.float32)
    r = RNG.standard_normal((5, 72)).astype(np.float32)
    w = RNG.standard_normal(72).astype(np.float32)

    def ref(a):
        return w * (a / np.sqrt((a.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-5))

    xt = t(x.copy())
    out = torch.full((5, 72), float("nan"), device=DEVICE)
    rms_norm(xt, t(w), 1e-5, out=out, residual=t(r))
    np.testing.assert_allclose(xt.cpu().numpy(), x + r, rtol=0, atol=0)  # the residual stream is updated in place
    np.testing.assert_allclose(out.cpu().numpy(), ref(x + r), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(rms_norm(t(x), t(w), 1e-5).cpu().numpy(), ref(x), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_activation(activation):
    gu = (RNG.standard_normal((4, 2 * 70)) * 3).astype(np.float32)
    g, u = gu[:, :70].astype(np.float64), gu[:, 70:].astype(np.float64)
    if activation == "silu":
        want = g / (1 + np.exp(-g)) * u
    else:
        want = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * u
    np.testing.assert_allclose(gated_activation(t(gu), activation).cpu().numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", ["dense", "fp8", "int4", "int4_asym", "nvfp4"])
def test_embedding_gather_every_format(fmt):
    weight, _, w = _weights(fmt, 50, 64)
    ids = np.array([3, 49, 0, 3], np.int32)
    got = embedding_gather(t(ids), weight, embedding_scale=8.0).cpu().numpy()
    np.testing.assert_allclose(got, w[ids] * np.float32(8.0), rtol=1e-6, atol=0)


def _rope_tables(positions: int, head_dim: int, rotary_pairs: int):
    half = head_dim // 2
    inv = (1.0 / 10000 ** (np.arange(half) * 2 / head_dim)).astype(np.float32)
    angles = np.arange(positions, dtype=np.float32)[:, None] * inv[None, :]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    cos[:, rotary_pairs:], sin[:, rotary_pairs:] = 1.0, 0.0
    return cos, sin


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,qk_norm,pool",
    [
        (4, 2, 16, False, "float32"),
        (6, 2, 48, True, "float32"),
        (4, 4, 32, False, "fp8"),
        (4, 2, 32, True, "bfloat16"),
        (4, 2, 16, False, "float16"),
    ],
)
def test_rope_and_cache(heads, kv_heads, head_dim, qk_norm, pool):
    T, B, blocks = 9, 16, 6
    half = head_dim // 2
    rotary_pairs = half if head_dim != 48 else 12  # partial rotary: pairs past it pass through
    qkv = RNG.standard_normal((T, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
    positions = RNG.choice(200, T, replace=False).astype(np.int32)
    slots = RNG.permutation(blocks * B)[:T]  # distinct (block, row) slots anywhere in the pool
    slot_blocks, slot_offsets = (slots // B).astype(np.int32), (slots % B).astype(np.int32)
    cos, sin = _rope_tables(256, head_dim, rotary_pairs)
    qn = RNG.standard_normal(head_dim).astype(np.float32) if qk_norm else None
    kn = RNG.standard_normal(head_dim).astype(np.float32) if qk_norm else None
    fp8 = pool == "fp8"
    dtype = {"float32": torch.float32, "fp8": torch.float8_e4m3fn, "bfloat16": torch.bfloat16, "float16": torch.float16}[pool]
    k_cache = torch.full((blocks, kv_heads, B, head_dim), float("nan"), device=DEVICE).to(dtype)
    v_cache = torch.full((blocks, kv_heads, B, head_dim), float("nan"), device=DEVICE).to(dtype)
    got = t(qkv.copy())
    rope_and_cache(got, t(positions), t(slot_blocks), t(slot_offsets), t(cos), t(sin), k_cache, v_cache, heads, kv_heads,
                   None if qn is None else t(qn), None if kn is None else t(kn), 1e-6, 0.5 if fp8 else 1.0, 0.25 if fp8 else 1.0)  # fmt: skip

    def rotate(x, norm, pos):  # [n, D]
        if norm is not None:
            x = norm * (x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6))
        c, s = cos[pos], sin[pos]
        a, b = x[:, :half], x[:, half:]
        return np.concatenate([a * c - b * s, b * c + a * s], axis=1)

    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    for i in range(T):
        q = rotate(qkv[i, :q_size].reshape(heads, head_dim), qn, positions[i])
        k = rotate(qkv[i, q_size : q_size + kv_size].reshape(kv_heads, head_dim), kn, positions[i])
        v = qkv[i, q_size + kv_size :].reshape(kv_heads, head_dim)
        np.testing.assert_allclose(got[i, :q_size].cpu().numpy().reshape(heads, head_dim), q, rtol=1e-5, atol=1e-5)
        stored_k = k_cache[slot_blocks[i], :, slot_offsets[i]].float().cpu().numpy()
        stored_v = v_cache[slot_blocks[i], :, slot_offsets[i]].float().cpu().numpy()
        if fp8:
            np.testing.assert_array_equal(stored_k, _C.round_to_e4m3((k / 0.5).astype(np.float32)).reshape(k.shape))
            np.testing.assert_array_equal(stored_v, _C.round_to_e4m3((v / 0.25).astype(np.float32)).reshape(v.shape))
        elif pool != "float32":  # rounded to nearest even, as torch rounds
            np.testing.assert_allclose(stored_k, k, rtol=2**-8, atol=1e-6)
            np.testing.assert_array_equal(stored_v, t(v).to(dtype).float().cpu().numpy())
        else:
            np.testing.assert_allclose(stored_k, k, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(stored_v, v)
    written = np.zeros((blocks, B), bool)
    written[slot_blocks, slot_offsets] = True
    untouched = torch.from_numpy(~written).to(DEVICE)
    assert torch.isnan(k_cache.float().permute(0, 2, 1, 3)[untouched]).all()  # nothing else written
    assert torch.isnan(v_cache.float().permute(0, 2, 1, 3)[untouched]).all()


def _reference_attention(q, k_pos, v_pos, ctx, n, heads, group, scale, window, softcap):
    """q [n, heads, D]; k_pos/v_pos [positions, kv_heads, D] -> [n, heads, D]."""
    out = np.zeros_like(q, dtype=np.float64)
    for i in range(n):
        pos = ctx + i
        lo = max(0, pos - window + 1) if window else 0
        for h in range(heads):
            s = (k_pos[lo : pos + 1, h // group].astype(np.float64) @ q[i, h]) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v_pos[lo : pos + 1, h // group]
    return out


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,window,softcap,fp8",
    [
        (4, 4, 16, 0, 0.0, False),
        (8, 2, 32, 0, 0.0, False),
        (7, 1, 24, 20, 0.0, False),
        (4, 2, 16, 0, 30.0, True),
        (6, 3, 64, 33, 50.0, False),
        (8, 2, 32, 0, 0.0, "bfloat16"),
    ],
)
def test_paged_attention_prefill_chunks_and_decode(heads, kv_heads, head_dim, window, softcap, fp8):
    """Three sequences in one batch (a chunk continuing a cached prefix, a fresh prompt, a decode token) through
    shuffled block tables; unwritten pool rows hold NaN."""
    B, num_blocks = 16, 40
    group = heads // kv_heads
    seqs = [(37, 21), (0, 45), (70, 1)]  # (context_len, num_tokens): lengths not multiples of the block
    perm = iter(RNG.permutation(num_blocks).tolist())
    bf16, fp8 = fp8 == "bfloat16", fp8 is True  # the last case: a bf16 pool
    k_scale, v_scale = (0.05, 0.04) if fp8 else (1.0, 1.0)
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16 if bf16 else torch.float32
    k_cache = torch.full((num_blocks, kv_heads, B, head_dim), float("nan"), device=DEVICE).to(dtype)
    v_cache = torch.full((num_blocks, kv_heads, B, head_dim), float("nan"), device=DEVICE).to(dtype)
    tables, k_all, v_all = [], [], []
    for ctx, n in seqs:
        total = ctx + n
        table = [next(perm) for _ in range(-(-total // B))]
        tables.append(table)
        k = RNG.standard_normal((total, kv_heads, head_dim)).astype(np.float32)
        v = RNG.standard_normal((total, kv_heads, head_dim)).astype(np.float32)
        if fp8:  # the pool holds E4M3 values of k / scale; the reference uses what was stored
            k = (k / k_scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(k_scale)
            v = (v / v_scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(v_scale)
        if bf16:
            k, v = (a.astype(ml_dtypes.bfloat16).astype(np.float32) for a in (k, v))
        for p in range(total):
            k_cache[table[p // B], :, p % B] = t(k[p] / np.float32(k_scale)).to(dtype)
            v_cache[table[p // B], :, p % B] = t(v[p] / np.float32(v_scale)).to(dtype)
        k_all.append(k)
        v_all.append(v)
    T = sum(n for _, n in seqs)
    qkv = RNG.standard_normal((T, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
    offsets = np.cumsum([0] + [n for _, n in seqs])[:-1].tolist()
    scale = 1 / math.sqrt(head_dim)
    for tokens_per_tile in (None, 3):
        batch = AttentionBatch.make(tables, [c for c, _ in seqs], [n for _, n in seqs], offsets, group, DEVICE, tokens_per_tile)
        out = torch.full((T, heads * head_dim), float("nan"), device=DEVICE)
        paged_attention(t(qkv), k_cache, v_cache, batch, heads, scale, out, window, softcap, k_scale, v_scale)
        for (ctx, n), off, k, v in zip(seqs, offsets, k_all, v_all):
            q = qkv[off : off + n, : heads * head_dim].reshape(n, heads, head_dim)
            want = _reference_attention(q, k, v, ctx, n, heads, group, scale, window, softcap)
            np.testing.assert_allclose(out[off : off + n].cpu().numpy().reshape(n, heads, head_dim), want, rtol=1e-4, atol=1e-5)


def test_attention_refuses_a_block_size_the_kernel_cannot_tile():
    batch = AttentionBatch.make([[0]], [0], [1], [0], 1, DEVICE)
    cache = torch.zeros(2, 1, 12, 16, device=DEVICE)
    with pytest.raises(ValueError, match="power of two"):
        paged_attention(torch.zeros(1, 48, device=DEVICE), cache, cache, batch, 1, 0.25, torch.zeros(1, 16, device=DEVICE))


def test_norm_and_activation_quantize_their_outputs_for_fp8_layers_exactly():
    """Fused: the E4M3 values the separate quantizer would make from the float32 output."""
    x = RNG.standard_normal((6, 80)).astype(np.float32)
    w = RNG.standard_normal(80).astype(np.float32)
    fused = rms_norm(t(x), t(w), 1e-5, fp8_scale=0.01)
    assert fused.dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(fused.float().cpu().numpy(), quantize_fp8_input(rms_norm(t(x), t(w), 1e-5), 0.01).float().cpu().numpy())
    gu = (RNG.standard_normal((3, 2 * 40)) * 3).astype(np.float32)
    fused = gated_activation(t(gu), "silu", fp8_scale=0.02)
    separate = quantize_fp8_input(gated_activation(t(gu), "silu"), 0.02)
    np.testing.assert_array_equal(fused.float().cpu().numpy(), separate.float().cpu().numpy())
    weight, _, _ = _weights("fp8", 32, 40)
    weight.input_scale = 0.02
    np.testing.assert_array_equal(linear(fused, weight).cpu().numpy(), linear(gated_activation(t(gu), "silu"), weight).cpu().numpy())
