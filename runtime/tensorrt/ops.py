"""The op interface the TensorRT lowering is written against, and the trace both backends record.

One lowering (lowering.py) calls these methods; two backends implement them:
  - TrtOps (trt_ops.py) adds the matching layer to a strongly typed TensorRT network;
  - NumpyOps (numpy_ops.py) evaluates the op at once in numpy, following TensorRT's
    documented semantics for that layer.
Each op is one TensorRT layer, so the two traces can be compared entry by entry (op, shape,
dtype). Composite steps (RMSNorm, SiLU, a quantized linear) live in the lowering, built from
these primitives, exactly as the network holds them.

Dtypes are names: float32, float16, bfloat16 (activations), fp8, fp4, int4 (quantized values),
int32, int64 (indices). A shape entry of -1 is a dimension the network leaves dynamic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

ACTIVATION_DTYPES = ("float32", "float16", "bfloat16")
ELEMENTWISE = ("sum", "prod", "sub", "div", "max")
UNARY = ("sqrt", "exp", "recip", "tanh")


@dataclass(frozen=True)
class TraceEntry:
    op: str
    shape: tuple[int, ...]
    dtype: str

    def matches(self, other: TraceEntry) -> bool:
        """Same op and dtype, and shapes that agree wherever both are known (-1: dynamic)."""
        if self.op != other.op or self.dtype != other.dtype or len(self.shape) != len(other.shape):
            return False
        return all(a == b or a == -1 or b == -1 for a, b in zip(self.shape, other.shape))


class Tensor(Protocol):
    shape: tuple[int, ...]
    dtype: str


class Ops(Protocol):
    """What the lowering may call. `name` arguments name network inputs/outputs and constants."""

    trace: list[TraceEntry]

    def input(self, name: str, dtype: str, shape: tuple[int, ...]) -> Any: ...
    def constant(self, name: str, values: np.ndarray, dtype: str) -> Any: ...
    def output(self, name: str, x: Any) -> None: ...
    def elementwise(self, kind: str, a: Any, b: Any) -> Any: ...
    def unary(self, kind: str, x: Any) -> Any: ...
    def sigmoid(self, x: Any) -> Any: ...
    def reduce_mean(self, x: Any, axis: int) -> Any: ...  # keeps the reduced axis (size 1)
    def matmul(self, a: Any, b: Any, transpose_b: bool) -> Any: ...
    def reshape(self, x: Any, dims: tuple[int, ...]) -> Any: ...  # 0 copies the input's dimension
    def gather(self, table: Any, indices: Any, axis: int) -> Any: ...
    def cast(self, x: Any, dtype: str) -> Any: ...
    def rotary(self, x: Any, cos: Any, sin: Any, position_ids: Any) -> Any: ...
    def transpose(self, x: Any, perm: tuple[int, ...]) -> Any: ...
    def kv_cache_update(self, cache: Any, update: Any, write_indices: Any) -> Any: ...
    def attention(self, q: Any, k: Any, v: Any, kv_lengths: Any) -> Any: ...
    def quantize(self, x: Any, scale: Any, dtype: str) -> Any: ...
    def dequantize(self, x: Any, scale: Any, dtype: str) -> Any: ...
    def dynamic_quantize_fp4(self, x: Any, global_scale: Any) -> tuple[Any, Any]: ...
