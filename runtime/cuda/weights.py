"""An engine's weights uploaded once into device memory, in their stored formats (plugins/triton/linear.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from precast.engine.directory import Engine
from precast.engine.quant import SIDE_TENSOR_SUFFIXES
from precast.engine.tensors import engine_tensor_shapes
from precast.errors import PrecastError
from precast.plugins.triton import LinearWeight

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_VIEWS = {"fp8": torch.float8_e4m3fn}  # uint8 bits -> their dtype


def _device(array: np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A numpy array on the device; 16-bit floats travel as their bit patterns, 8-bit ones as bytes."""
    array = np.ascontiguousarray(array)
    if array.dtype.itemsize == 2 and array.dtype != np.float16:  # bfloat16 (ml_dtypes): no numpy twin in torch
        return torch.from_numpy(array.view(np.uint16)).to(device).view(torch.bfloat16)
    tensor = torch.from_numpy(array).to(device)
    return tensor.view(dtype) if dtype is not None else tensor


@dataclass
class DeviceWeights:
    linears: dict[str, LinearWeight] = field(default_factory=dict)  # layer name -> weight
    vectors: dict[str, torch.Tensor] = field(default_factory=dict)  # norms and biases, float32

    def linear(self, layer: str) -> LinearWeight:
        if layer not in self.linears:
            raise PrecastError(f"the engine has no weight {layer}.weight")
        return self.linears[layer]

    def vector(self, name: str) -> torch.Tensor:
        if name not in self.vectors:
            raise PrecastError(f"the engine has no weight {name}")
        return self.vectors[name]


def upload(engine: Engine, device: torch.device) -> DeviceWeights:
    """Every tensor once: matrices in the engine dtype or their quantized format, vectors float32. NaN or Inf
    in a weight is refused (an engine damaged since its build), as the CPU runner does."""
    shapes = engine_tensor_shapes(engine.config.model)
    quantized = engine.config.quant.layers
    out = DeviceWeights()
    for name in engine.weights.tensors:
        if name.endswith(SIDE_TENSOR_SUFFIXES):
            continue  # read with its weight
        layer = name[: -len(".weight")] if name.endswith(".weight") else None
        if layer in quantized:
            arrays = quantized[layer].device_arrays(layer, engine.weights.read)
            fmt = arrays.pop("format")
            values = _device(arrays.pop("values"), device, _VIEWS.get(fmt))
            scales = arrays.pop("scales", None)
            if scales is not None:
                scales = _device(scales, device, torch.float8_e4m3fn if fmt == "nvfp4" else None)
            if "offsets" in arrays:
                arrays["offsets"] = _device(arrays["offsets"], device)
            weight = LinearWeight(fmt, values, *shapes[name], scales=scales, **arrays)
            out.linears[layer] = weight
            continue
        array = engine.weights.read(name)
        if not np.isfinite(array.astype(np.float32)).all():
            raise PrecastError(f"engine {engine.path}: {name} holds NaN or Inf; the engine is damaged, rebuild it")
        if name not in shapes or array.shape != shapes[name]:
            raise PrecastError(f"engine {engine.path}: {name} is {array.shape}, the model needs {shapes.get(name, 'no such tensor')}")
        if array.ndim == 2:
            tensor = _device(array, device)
            out.linears[layer] = LinearWeight("dense", tensor, *array.shape)
        else:
            tensor = _device(array.astype(np.float32), device)
            out.vectors[name] = tensor
    return out


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]
