"""The numpy backend's layer semantics, checked independently by ONNX Runtime (opset 23 ops that run on CPU)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from precast.runtime.tensorrt.numpy_ops import NpTensor, NumpyOps, round_to

rng = np.random.default_rng(0)


def run_onnx(
    nodes: onnx.NodeProto | list[onnx.NodeProto],
    inputs: dict[str, np.ndarray],
    outputs: list[tuple[str, int]],
    initializers: list[onnx.TensorProto] = (),
) -> list[np.ndarray]:
    def info(name: str, a: np.ndarray) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)

    nodes = nodes if isinstance(nodes, list) else [nodes]
    graph = helper.make_graph(
        nodes,
        "g",
        [info(n, a) for n, a in inputs.items()],
        [helper.make_tensor_value_info(n, t, None) for n, t in outputs],
        list(initializers),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)


def t(value: np.ndarray, dtype: str = "float32") -> NpTensor:
    return NpTensor(np.asarray(value), dtype)


def test_rotary_matches_onnx_rotary_embedding():
    b, n, s, h, positions = 2, 3, 5, 16, 40
    x = rng.standard_normal((b, n, s, h)).astype(np.float32)
    angles = np.arange(positions, dtype=np.float32)[:, None] * rng.random(h // 2).astype(np.float32)[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    pos = rng.integers(0, positions, (b, s)).astype(np.int64)
    ours = NumpyOps({}).rotary(t(x), t(cos), t(sin), t(pos, "int64")).value
    node = helper.make_node("RotaryEmbedding", ["x", "cos", "sin", "pos"], ["y"], interleaved=0)
    (want,) = run_onnx(node, {"x": x, "cos": cos, "sin": sin, "pos": pos}, [("y", TensorProto.FLOAT)])
    np.testing.assert_allclose(ours, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("s_q", [1, 4, 7])
def test_attention_matches_onnx_attention_with_a_lower_right_causal_mask(s_q):
    """GQA 6:2, padded caches with per-batch lengths, causal anchored lower right, no scaling inside."""
    b, nq, nkv, s_max, h = 3, 6, 2, 16, 8
    q = rng.standard_normal((b, nq, s_q, h)).astype(np.float32)
    k = rng.standard_normal((b, nkv, s_max, h)).astype(np.float32)
    v = rng.standard_normal((b, nkv, s_max, h)).astype(np.float32)
    kv_lengths = np.array([s_q, 9, s_max], np.int32)
    ours = NumpyOps({}).attention(t(q), t(k), t(v), t(kv_lengths, "int32")).value
    for i, kv_len in enumerate(kv_lengths):
        mask = np.arange(kv_len)[None, :] <= np.arange(s_q)[:, None] + kv_len - s_q  # [s_q, kv_len]
        node = helper.make_node("Attention", ["q", "k", "v", "mask"], ["y"], scale=1.0)
        inputs = {"q": q[i : i + 1], "k": k[i : i + 1, :, :kv_len], "v": v[i : i + 1, :, :kv_len], "mask": mask}
        (want,) = run_onnx(node, inputs, [("y", TensorProto.FLOAT)])
        np.testing.assert_allclose(ours[i], want[0], rtol=1e-5, atol=1e-5)


def test_fp8_quantize_and_dequantize_match_onnx():
    x = (rng.standard_normal((4, 32)) * 50).astype(np.float32)
    x[0, :3] = [1e4, -1e4, 0.0]  # saturates to +-448 * scale
    scale = np.float32(0.37)
    ops = NumpyOps({})
    q = ops.quantize(t(x), t(scale), "fp8")
    deq = ops.dequantize(q, t(scale), "float32")
    zero = helper.make_tensor("z", TensorProto.FLOAT8E4M3FN, [], [0])
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], saturate=1),
        helper.make_node("Cast", ["q"], ["q_values"], to=TensorProto.FLOAT),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
    ]
    want_q, want = run_onnx(nodes, {"x": x, "s": np.array(scale)}, [("q_values", TensorProto.FLOAT), ("y", TensorProto.FLOAT)], [zero])
    np.testing.assert_array_equal(q.value, want_q)
    np.testing.assert_array_equal(deq.value, want)


def test_rms_norm_as_lowered_matches_onnx_rms_normalization():
    """The lowering's RMSNorm (x / sqrt(mean(x^2) + eps) * w, from primitives) against opset 23's operator."""
    from types import SimpleNamespace

    from precast.runtime.tensorrt.lowering import DecoderLowering

    x = rng.standard_normal((5, 64)).astype(np.float32) * 3
    w = rng.standard_normal(64).astype(np.float32)
    lowering = DecoderLowering.__new__(DecoderLowering)
    lowering.ops, lowering.act, lowering._scalars = NumpyOps({}), "float32", {}
    lowering.spec = SimpleNamespace(norm_eps=1e-5)
    ours = lowering.rms_norm(t(x), w, "norm").value
    node = helper.make_node("RMSNormalization", ["x", "w"], ["y"], axis=-1, epsilon=1e-5)
    (want,) = run_onnx(node, {"x": x, "w": w}, [("y", TensorProto.FLOAT)])
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-6)


def test_narrow_dtypes_round_like_ml_dtypes():
    x = rng.standard_normal(1000).astype(np.float32) * 10
    np.testing.assert_array_equal(round_to(x, "bfloat16"), x.astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(round_to(x, "fp4"), np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert set(np.unique(round_to(x, "int4"))) <= set(range(-8, 8))


def test_dynamic_fp4_quantize_is_the_nvfp4_activation_definition():
    from precast.engine.formats import fake_quant_nvfp4_activation

    x = rng.standard_normal((6, 64)).astype(np.float32)
    x[1, :16] = 0  # an all-zero block
    ops = NumpyOps({})
    g = t(np.float32(0.01))
    q, scale = ops.dynamic_quantize_fp4(t(x), g)
    deq = ops.dequantize(q, ops.dequantize(scale, g, "float32"), "float32")
    np.testing.assert_array_equal(deq.value, fake_quant_nvfp4_activation(x, 0.01))


def test_strong_typing_and_equal_ranks_are_enforced():
    from precast.errors import PrecastError

    ops = NumpyOps({})
    with pytest.raises(PrecastError, match="different dtypes"):
        ops.elementwise("sum", t(np.ones((2, 2))), t(np.ones((2, 2)), "bfloat16"))
    with pytest.raises(PrecastError, match="ranks"):
        ops.elementwise("sum", t(np.ones((2, 2))), t(np.ones(2)))
    with pytest.raises(PrecastError, match="outside the cache"):
        ops.kv_cache_update(t(np.zeros((1, 1, 4, 2))), t(np.ones((1, 1, 3, 2))), t(np.array([2]), "int32"))
