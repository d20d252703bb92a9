"""Checkpoints quantized elsewhere: modelopt's FP8 Hugging Face export, built without recalibration.

modelopt stores each quantized linear layer as `{name}.weight` (E4M3), `{name}.weight_scale` and
`{name}.input_scale` (float32 scalars), with `quantization_config.quant_method = "modelopt"`,
`quant_algo = "FP8"`. precast fuses q/k/v and gate/up into one matrix with one scale, so the
parts are re-expressed on the largest part scale: values of parts that shared it are kept bit for
bit, the others are re-rounded once (as TensorRT-LLM does when it fuses them). The input scale of
a fused layer is the largest of its parts' (modelopt's export already makes them equal).
"""

from __future__ import annotations

import numpy as np

from precast.builder.checkpoint.base import Checkpoint
from precast.builder.weights import PlannedTensor
from precast.engine.formats import FP8_MAX, quantize_fp8
from precast.engine.quant import Fp8Layer
from precast.errors import PrecastError

SCALE_SUFFIXES = (".weight_scale", ".input_scale")


def scale_tensors(checkpoint: Checkpoint) -> set[str]:
    return {n for n in checkpoint.tensor_names() if n.endswith(SCALE_SUFFIXES)}


def quantized_layers(checkpoint: Checkpoint, plan: list[PlannedTensor]) -> dict[str, Fp8Layer]:
    """Engine layer name -> an fp8 record (scales read with the weights) for every planned matrix stored in
    E4M3 (all parts or none)."""
    layers: dict[str, Fp8Layer] = {}
    for t in plan:
        kinds = {checkpoint.tensor_dtype(s) == "F8_E4M3" for s in t.sources}
        if kinds == {True}:
            layers[t.name[: -len(".weight")]] = Fp8Layer()
        elif len(kinds) > 1:
            raise PrecastError(
                f"{t.name} fuses {', '.join(t.sources)}, which are not all FP8 in the checkpoint; "
                "precast needs q/k/v and gate/up quantized alike"
            )
    return layers


def _scalar(checkpoint: Checkpoint, names: set[str], name: str, of: str) -> float:
    if name not in names:
        raise PrecastError(f"{of} is FP8 in the checkpoint but {name} is missing; the export is incomplete")
    value = float(np.asarray(checkpoint.read(name), dtype=np.float64).reshape(-1)[0])
    if not np.isfinite(value) or value <= 0:
        raise PrecastError(f"{name} is {value}; scales must be finite and positive")
    return value


def fuse_fp8(checkpoint: Checkpoint, tensor: PlannedTensor) -> tuple[np.ndarray, Fp8Layer]:
    """The fused E4M3 matrix of one planned tensor and its record with the weight and input scales."""
    names = set(checkpoint.tensor_names())
    prefixes = [s[: -len(".weight")] for s in tensor.sources]
    weight_scales = [_scalar(checkpoint, names, f"{p}.weight_scale", s) for p, s in zip(prefixes, tensor.sources)]
    input_scales = [_scalar(checkpoint, names, f"{p}.input_scale", s) for p, s in zip(prefixes, tensor.sources)]
    parts = [checkpoint.read(s).astype(np.float32) * np.float32(ws) for s, ws in zip(tensor.sources, weight_scales)]
    scale = max(weight_scales)
    q = quantize_fp8(tensor.arrange(np.concatenate(parts, axis=0)), amax=scale * FP8_MAX)
    return q.values, Fp8Layer(weight_scale=q.scale, input_scale=max(input_scales))
