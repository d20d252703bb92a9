"""The op interface evaluated eagerly in numpy, following TensorRT's documented layer semantics.

Every tensor holds float32 (or integer) values plus the dtype the network gives it; values of
a narrow dtype (bfloat16, float16, fp8, fp4, int4) are kept exactly representable in it, i.e.
each op computes in float32 and rounds its result to its output dtype, as a strongly typed
TensorRT network with float32 accumulation does. Layers checked independently against ONNX
Runtime (tests/builder/tensorrt/test_numpy_ops.py): rotary embedding, attention, FP8
quantize/dequantize.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from precast.engine.formats import FP4_MAX, FP8_MAX, NVFP4_BLOCK
from precast.errors import PrecastError
from precast.runtime.tensorrt.ops import ACTIVATION_DTYPES, TraceEntry

_NARROW = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
_INTEGER = {"int32": np.int32, "int64": np.int64}


@dataclass
class NpTensor:
    value: np.ndarray
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to what `dtype` can hold (returned as float32, or integers)."""
    if dtype in _INTEGER:
        return np.asarray(x).astype(_INTEGER[dtype])
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float32":
        return x
    if dtype in _NARROW:
        return x.astype(_NARROW[dtype]).astype(np.float32)
    if dtype == "fp8":  # saturating, round to nearest even (E4M3 has no infinity)
        return np.clip(x, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    if dtype == "fp4":
        return np.clip(x, -FP4_MAX, FP4_MAX).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    if dtype == "int4":
        return np.clip(np.rint(x), -8, 7).astype(np.float32)
    raise PrecastError(f"unknown dtype {dtype!r}")


class NumpyOps:
    """Evaluates each call at once; `feeds` gives the network inputs by name."""

    def __init__(self, feeds: dict[str, np.ndarray]):
        self.feeds = feeds
        self.outputs: dict[str, NpTensor] = {}
        self.trace: list[TraceEntry] = []

    def _out(self, op: str, value: np.ndarray, dtype: str) -> NpTensor:
        t = NpTensor(round_to(value, dtype), dtype)
        self.trace.append(TraceEntry(op, t.shape, dtype))
        return t

    @staticmethod
    def _same_dtype(op: str, *tensors: NpTensor) -> str:
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) != 1:
            raise PrecastError(f"{op}: inputs of different dtypes {sorted(dtypes)} (the network is strongly typed)")
        return dtypes.pop()

    def input(self, name: str, dtype: str, shape: tuple[int, ...]) -> NpTensor:
        if name not in self.feeds:
            raise PrecastError(f"no value fed for network input {name!r}")
        value = np.asarray(self.feeds[name])
        if value.ndim != len(shape) or any(s not in (-1, v) for s, v in zip(shape, value.shape)):
            raise PrecastError(f"input {name!r} has shape {list(value.shape)}, the network takes {list(shape)}")
        return self._out("input", value, dtype)

    def constant(self, name: str, values: np.ndarray, dtype: str) -> NpTensor:
        return self._out("constant", np.asarray(values).astype(np.float32) if dtype not in _INTEGER else values, dtype)

    def output(self, name: str, x: NpTensor) -> None:
        self.outputs[name] = x

    def elementwise(self, kind: str, a: NpTensor, b: NpTensor) -> NpTensor:
        dtype = self._same_dtype(kind, a, b)
        if len(a.shape) != len(b.shape):
            raise PrecastError(f"{kind}: ranks {len(a.shape)} and {len(b.shape)} differ (TensorRT broadcasts equal ranks only)")
        fn = {"sum": np.add, "prod": np.multiply, "sub": np.subtract, "div": np.divide, "max": np.maximum}[kind]
        return self._out(kind, fn(a.value, b.value), dtype)

    def unary(self, kind: str, x: NpTensor) -> NpTensor:
        fn = {"sqrt": np.sqrt, "exp": np.exp, "recip": np.reciprocal, "tanh": np.tanh}[kind]
        return self._out(kind, fn(x.value), x.dtype)

    def sigmoid(self, x: NpTensor) -> NpTensor:
        with np.errstate(over="ignore"):  # exp overflows to inf for large negative x: the sigmoid is 0, as intended
            return self._out("sigmoid", 1.0 / (1.0 + np.exp(-x.value)), x.dtype)

    def reduce_mean(self, x: NpTensor, axis: int) -> NpTensor:
        return self._out("reduce_mean", x.value.mean(axis=axis, keepdims=True, dtype=np.float32), x.dtype)

    def matmul(self, a: NpTensor, b: NpTensor, transpose_b: bool) -> NpTensor:
        dtype = self._same_dtype("matmul", a, b)
        return self._out("matmul", a.value @ (np.swapaxes(b.value, -1, -2) if transpose_b else b.value), dtype)

    def reshape(self, x: NpTensor, dims: tuple[int, ...]) -> NpTensor:
        shape = tuple(x.shape[i] if d == 0 else d for i, d in enumerate(dims))
        return self._out("reshape", x.value.reshape(shape), x.dtype)

    def gather(self, table: NpTensor, indices: NpTensor, axis: int) -> NpTensor:
        idx = indices.value
        if idx.size and (idx.min() < 0 or idx.max() >= table.shape[axis]):
            raise PrecastError(f"gather index out of range [0, {table.shape[axis]})")
        return self._out("gather", np.take(table.value, idx, axis=axis), table.dtype)

    def cast(self, x: NpTensor, dtype: str) -> NpTensor:
        return self._out("cast", x.value, dtype)

    def rotary(self, x: NpTensor, cos: NpTensor, sin: NpTensor, position_ids: NpTensor) -> NpTensor:
        """input [b, n, s, h], caches [max_position + 1, h / 2], position_ids [b, s]; halves rotated (not interleaved)."""
        half = x.shape[-1] // 2
        c = cos.value[position_ids.value][:, None, :, :]  # [b, 1, s, h/2]
        s = sin.value[position_ids.value][:, None, :, :]
        x1, x2 = x.value[..., :half], x.value[..., half:]
        return self._out("rotary", np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1), x.dtype)

    def transpose(self, x: NpTensor, perm: tuple[int, ...]) -> NpTensor:
        return self._out("transpose", np.transpose(x.value, perm), x.dtype)

    def kv_cache_update(self, cache: NpTensor, update: NpTensor, write_indices: NpTensor) -> NpTensor:
        """LINEAR mode, padded update [b, n, s, h]: output[i, :, write_indices[i] + s, :] = update[i, :, s, :]."""
        out = cache.value.copy()
        steps = update.shape[2]
        for i, w in enumerate(write_indices.value):
            if w < 0 or w + steps > cache.shape[2]:
                raise PrecastError(f"KV-cache write [{w}, {w + steps}) of slot {i} is outside the cache's {cache.shape[2]} positions")
            out[i, :, w : w + steps, :] = update.value[i]
        return self._out("kv_cache_update", out, cache.dtype)

    def attention(self, q: NpTensor, k: NpTensor, v: NpTensor, kv_lengths: NpTensor) -> NpTensor:
        """Padded q [b, nq, s_q, h], k/v [b, nkv, s_max, h] (nq a multiple of nkv), keys j < kv_lengths[b]; softmax over
        keys with the causal mask anchored lower right (query i attends j <= i + kv_len - s_q); no scaling inside.
        A query row with no key left (only possible for padding rows) gives zeros here; TensorRT leaves it undefined."""
        out = np.zeros(q.shape, dtype=np.float32)
        group, s_q = q.shape[1] // k.shape[1], q.shape[2]
        for b in range(q.shape[0]):
            kv_len = int(kv_lengths.value[b])
            kb = np.repeat(k.value[b, :, :kv_len], group, axis=0)  # [nq, kv_len, h]
            vb = np.repeat(v.value[b, :, :kv_len], group, axis=0)
            scores = q.value[b] @ np.swapaxes(kb, 1, 2)  # [nq, s_q, kv_len]
            allowed = np.arange(kv_len)[None, :] <= (np.arange(s_q)[:, None] + kv_len - s_q)
            scores = np.where(allowed[None], scores, -np.inf)
            peak = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)
            e = np.where(allowed[None], np.exp(scores - np.where(np.isfinite(peak), peak, 0)), 0)
            total = e.sum(axis=-1, keepdims=True)
            out[b] = (e / np.where(total > 0, total, 1)) @ vb
        return self._out("attention", out, q.dtype)

    def quantize(self, x: NpTensor, scale: NpTensor, dtype: str) -> NpTensor:
        return self._out("quantize", x.value / scale.value, dtype)

    def dequantize(self, x: NpTensor, scale: NpTensor, dtype: str) -> NpTensor:
        """Per-tensor (scalar scale) or blocked (scale of the same rank, last axis x.shape[-1] / block)."""
        s = scale.value
        if s.ndim:
            s = np.repeat(s, x.shape[-1] // s.shape[-1], axis=-1)
        return self._out("dequantize", x.value * s, dtype)

    def dynamic_quantize_fp4(self, x: NpTensor, global_scale: NpTensor) -> tuple[NpTensor, NpTensor]:
        """NVFP4 per 16 values of the last axis: block_scale = e4m3(block_amax / (6 * global)),
        q = e2m1(x / (block_scale * global)) (0 where the block is all zero)."""
        rows, cols = x.shape
        blocks = x.value.reshape(rows, cols // NVFP4_BLOCK, NVFP4_BLOCK)
        g = np.float32(global_scale.value)
        block_scale = round_to(np.abs(blocks).max(axis=2) / (np.float32(FP4_MAX) * g), "fp8")
        effective = (block_scale * g)[:, :, None]
        q = np.where(effective > 0, blocks / np.where(effective > 0, effective, 1), 0).reshape(rows, cols)
        q_t = self._out("dynamic_quantize", q, "fp4")
        scale_t = NpTensor(block_scale, "fp8")
        return q_t, scale_t


assert set(ACTIVATION_DTYPES) <= set(_NARROW) | {"float32"}
