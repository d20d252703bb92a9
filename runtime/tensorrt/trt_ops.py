"""The op interface recorded as a strongly typed TensorRT network (GPU-only at run time).

Works with `tensorrt` (full TensorRT, datacenter GPUs) or `tensorrt_rtx` (TensorRT for RTX, which
builds plans on a machine without a GPU); both expose the same Python API for what is used here.
Each method adds one layer and appends its output to the trace, so a recorded network can be
compared with a NumpyOps evaluation of the same lowering.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np

from precast.errors import PrecastError
from precast.runtime.tensorrt.ops import TraceEntry

BUILDER_MODULES = ("tensorrt", "tensorrt_rtx")


def import_tensorrt() -> ModuleType:
    """`tensorrt` where installed, else `tensorrt_rtx`; a clear error when neither is."""
    for name in BUILDER_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise PrecastError(
        "--target tensorrt needs a TensorRT builder: install TensorRT (`pip install tensorrt`, NVIDIA GPUs with a "
        "datacenter driver) or TensorRT for RTX (`pip install tensorrt-rtx`, which also builds on a machine without a GPU)"
    )


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """4-bit codes (uint8 < 16), row-major, two per byte with the first element in the low nibble."""
    flat = codes.reshape(-1)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)


class TrtOps:
    def __init__(self, trt: ModuleType, network: Any):
        self.trt = trt
        self.network = network
        self.trace: list[TraceEntry] = []
        self._keep_alive: list[np.ndarray] = []  # trt.Weights do not copy: the arrays must outlive the build
        self._dtypes = {
            "float32": trt.float32,
            "float16": trt.float16,
            "bfloat16": trt.bfloat16,
            "fp8": trt.fp8,
            "fp4": trt.fp4,
            "int4": trt.int4,
            "int32": trt.int32,
            "int64": trt.int64,
        }
        self._names = {v: k for k, v in self._dtypes.items()}

    def _out(self, op: str, layer: Any, name: str, index: int = 0) -> Any:
        if layer is None:
            raise PrecastError(f"TensorRT refused the {op} layer {name!r}")
        layer.name = f"{name or op}#{len(self.trace)}"  # unique: TensorRT refuses a name twice
        t = layer.get_output(index)
        self.trace.append(TraceEntry(op, tuple(t.shape), self._names[t.dtype]))
        return t

    def input(self, name: str, dtype: str, shape: tuple[int, ...]) -> Any:
        t = self.network.add_input(name, self._dtypes[dtype], shape)
        self.trace.append(TraceEntry("input", tuple(t.shape), dtype))
        return t

    def constant(self, name: str, values: np.ndarray, dtype: str) -> Any:
        trt = self.trt
        shape = tuple(values.shape)
        if dtype == "fp8":
            raw = np.ascontiguousarray(np.asarray(values, dtype=ml_dtypes.float8_e4m3fn)).view(np.uint8)
        elif dtype == "fp4":
            raw = _pack_nibbles(np.asarray(values, dtype=ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F)
        elif dtype == "int4":
            raw = _pack_nibbles((np.asarray(values, dtype=np.int8) & 0x0F).astype(np.uint8))
        elif dtype == "bfloat16":
            raw = np.ascontiguousarray(np.asarray(values, dtype=np.float32).astype(ml_dtypes.bfloat16)).view(np.uint16)
        else:
            raw = np.ascontiguousarray(
                np.asarray(values).astype({"float32": np.float32, "float16": np.float16, "int32": np.int32, "int64": np.int64}[dtype])
            )
        self._keep_alive.append(raw)
        weights = trt.Weights(self._dtypes[dtype], raw.ctypes.data, int(np.prod(shape)) if shape else 1)
        return self._out("constant", self.network.add_constant(shape, weights), name)

    def output(self, name: str, x: Any) -> None:
        x.name = name
        self.network.mark_output(x)

    def elementwise(self, kind: str, a: Any, b: Any) -> Any:
        op = {"sum": "SUM", "prod": "PROD", "sub": "SUB", "div": "DIV", "max": "MAX"}[kind]
        return self._out(kind, self.network.add_elementwise(a, b, getattr(self.trt.ElementWiseOperation, op)), "")

    def unary(self, kind: str, x: Any) -> Any:
        op = {"sqrt": "SQRT", "exp": "EXP", "recip": "RECIP", "tanh": "TANH"}[kind]
        return self._out(kind, self.network.add_unary(x, getattr(self.trt.UnaryOperation, op)), "")

    def sigmoid(self, x: Any) -> Any:
        return self._out("sigmoid", self.network.add_activation(x, self.trt.ActivationType.SIGMOID), "")

    def reduce_mean(self, x: Any, axis: int) -> Any:
        axis = axis % len(x.shape)
        return self._out("reduce_mean", self.network.add_reduce(x, self.trt.ReduceOperation.AVG, 1 << axis, True), "")

    def matmul(self, a: Any, b: Any, transpose_b: bool) -> Any:
        mo = self.trt.MatrixOperation
        return self._out("matmul", self.network.add_matrix_multiply(a, mo.NONE, b, mo.TRANSPOSE if transpose_b else mo.NONE), "")

    def reshape(self, x: Any, dims: tuple[int, ...]) -> Any:
        layer = self.network.add_shuffle(x)
        layer.reshape_dims = dims  # 0 copies the input's dimension (zero_is_placeholder)
        return self._out("reshape", layer, "")

    def gather(self, table: Any, indices: Any, axis: int) -> Any:
        return self._out("gather", self.network.add_gather(table, indices, axis), "")

    def cast(self, x: Any, dtype: str) -> Any:
        return self._out("cast", self.network.add_cast(x, self._dtypes[dtype]), "")

    def rotary(self, x: Any, cos: Any, sin: Any, position_ids: Any) -> Any:
        layer = self.network.add_rotary_embedding(x, cos, sin, False, 0)
        if layer is not None:
            layer.set_input(3, position_ids)
        return self._out("rotary", layer, "")

    def transpose(self, x: Any, perm: tuple[int, ...]) -> Any:
        layer = self.network.add_shuffle(x)
        layer.first_transpose = perm
        return self._out("transpose", layer, "")

    def kv_cache_update(self, cache: Any, update: Any, write_indices: Any) -> Any:
        return self._out("kv_cache_update", self.network.add_kv_cache_update(cache, update, write_indices, self.trt.KVCacheMode.LINEAR), "")

    def attention(self, q: Any, k: Any, v: Any, kv_lengths: Any) -> Any:
        trt = self.trt
        layer = self.network.add_attention_v2(q, k, v, trt.AttentionNormalizationOp.SOFTMAX, trt.CausalMaskKind.LOWER_RIGHT)
        if layer is not None:
            layer.key_value_lengths = kv_lengths
            layer.decomposable = True  # float32 has no fused kernel: allow the BMM-softmax-BMM form
        return self._out("attention", layer, "")

    def quantize(self, x: Any, scale: Any, dtype: str) -> Any:
        return self._out("quantize", self.network.add_quantize(x, scale, self._dtypes[dtype]), "")

    def dequantize(self, x: Any, scale: Any, dtype: str) -> Any:
        return self._out("dequantize", self.network.add_dequantize(x, scale, self._dtypes[dtype]), "")

    def dynamic_quantize_fp4(self, x: Any, global_scale: Any) -> tuple[Any, Any]:
        trt = self.trt
        layer = self.network.add_dynamic_quantize(x, len(x.shape) - 1, 16, trt.fp4, trt.fp8)
        if layer is not None:
            layer.set_input(1, global_scale)
        q = self._out("dynamic_quantize", layer, "")
        return q, layer.get_output(1)


def quiet_logger(trt: Any) -> Any:
    """Errors and warnings that matter; TensorRT-RTX's report that no CUDA driver is present is dropped
    (building a plan needs no GPU)."""

    class Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: Any, msg: str) -> None:
            if severity <= trt.ILogger.Severity.ERROR and "CUDA driver version is insufficient" not in msg:
                print(f"[{trt.__name__}] {msg}", flush=True)

    return Logger()
