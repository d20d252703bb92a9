"""A full-precision engine -> a quantized engine's weights and `quant` section.

Streaming like the build: each tensor is read from the full-precision engine, folded (AWQ),
quantized or cast, and written before the next is read. Per-tensor scales go into the config;
block and group scales are written beside their weights (quantization/recipe.py).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from precast.builder.engine import WEIGHTS_FILE, Engine, numpy_dtype
from precast.builder.safetensors_file import DTYPES, SafetensorsWriter
from precast.errors import PrecastError
from precast.quantization import awq
from precast.quantization.calibration import CalibrationResult
from precast.quantization.formats import FP4_MAX, FP8_MAX, per_tensor_scale, quantize_fp8, quantize_int4, quantize_nvfp4
from precast.quantization.recipe import LayerPlan, QuantOptions


def quant_section(options: QuantOptions, plan: dict[str, LayerPlan]) -> dict[str, Any]:
    """The section before any scale is known (enough to lay out the weights file)."""
    layers: dict[str, Any] = {}
    for name, p in plan.items():
        layers[name] = {"format": p.format, "group_size": p.group_size} if p.format == "int4" else {"format": p.format}
    return {
        "recipe": options.recipe,
        "lm_head": options.quantize_lm_head,
        "exclude": list(options.exclude),
        "layers": layers,
    }


def awq_scales(engine: Engine, plan: dict[str, LayerPlan], calib: CalibrationResult, progress: bool) -> dict[str, awq.AwqScale]:
    """Search a scale for every int4 layer whose 1 / s can be folded into what feeds it."""
    spec = engine.config.model
    found: dict[str, awq.AwqScale] = {}
    targets = {}
    for i in range(spec.num_layers):
        targets.update(awq.fold_targets(i, spec.num_heads, spec.num_kv_heads))
    todo = [n for n, p in plan.items() if p.format == "int4" and targets.get(n)]
    for name in tqdm(todo, desc="precast awq", disable=not progress):
        stats = calib.stats.get(name)
        if stats is None or len(stats.samples) == 0:
            raise PrecastError(f"calibration recorded no inputs for {name}; cannot search its AWQ scale")
        weight = engine.weights.read(f"{name}.weight").astype(np.float32)
        found[name] = awq.search_scale(weight, stats.samples, stats.mean_abs, plan[name].group_size)
    return found


def fold_awq(name: str, array: np.ndarray, scales: dict[str, awq.AwqScale], q_size: int, kv_size: int) -> np.ndarray:
    """Apply the AWQ scales that touch tensor `name` (x s on a layer's inputs, / s where its input is made)."""
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if not m or not scales:
        return array
    p, rest = f"layers.{m.group(1)}.", m.group(2)

    def s(layer: str) -> np.ndarray | None:
        found = scales.get(p + layer)
        return None if found is None else found.scale

    out = array.astype(np.float32, copy=True)
    if rest.endswith(".weight") and rest[: -len(".weight")] in ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down"):
        own = s(rest[: -len(".weight")])
        if own is not None:
            out *= own[None, :]
    if rest == "attn_norm.weight" and s("attn.qkv") is not None:
        out /= s("attn.qkv")
    if rest == "mlp_norm.weight" and s("mlp.gate_up") is not None:
        out /= s("mlp.gate_up")
    if rest in ("attn.qkv.weight", "attn.qkv.bias") and s("attn.o") is not None:
        v = slice(q_size + kv_size, q_size + 2 * kv_size)
        out[v] /= s("attn.o")[:, None] if out.ndim == 2 else s("attn.o")
    if rest == "mlp.gate_up.weight" and s("mlp.down") is not None:
        inter = out.shape[0] // 2
        out[inter:] /= s("mlp.down")[:, None]
    return out


def _calibrated_scale(calib: CalibrationResult | None, name: str, maximum: float) -> float:
    """Per-tensor scale of an activation (or K / V) from its calibrated amax."""
    stats = calib.stats.get(name) if calib else None
    if stats is None:
        raise PrecastError(f"calibration recorded no inputs for {name}")
    return per_tensor_scale(stats.tensor_amax, maximum)


def quantize_layer(name: str, plan: LayerPlan, weight: np.ndarray, calib: CalibrationResult | None, entry: dict[str, Any]) -> dict[str, np.ndarray]:
    """Quantize one layer's weight; fills `entry` (the config) with its per-tensor scales."""
    if plan.format == "fp8":
        q = quantize_fp8(weight)
        entry.update(weight_scale=q.scale, input_scale=_calibrated_scale(calib, name, FP8_MAX))
        return {f"{name}.weight": q.values}
    if plan.format == "nvfp4":
        q4 = quantize_nvfp4(weight)
        entry.update(weight_global_scale=q4.global_scale, input_global_scale=_calibrated_scale(calib, name, FP4_MAX * FP8_MAX))
        return {f"{name}.weight": q4.packed, f"{name}.weight_scale": q4.block_scales}
    qi = quantize_int4(weight, plan.group_size)
    return {f"{name}.weight": qi.packed, f"{name}.weight_scale": qi.scales}


def write_quantized_weights(
    engine: Engine,
    out_dir: Path,
    quant: dict[str, Any],
    expected: dict[str, tuple[tuple[int, ...], str]],
    plan: dict[str, LayerPlan],
    calib: CalibrationResult | None,
    scales: dict[str, awq.AwqScale],
    progress: bool,
) -> int:
    """Write weights.safetensors for `quant` (filled in place with scales). Returns bytes written."""
    spec = engine.config.model
    matrix_dtype = numpy_dtype(engine.config.dtype)
    layout = [(n, DTYPES[dt], shape) for n, (shape, dt) in expected.items()]
    total = sum(math.prod(shape) * np.dtype(dt).itemsize for _, dt, shape in layout)
    pending: dict[str, np.ndarray] = {}  # scales produced with their weight, written right after it
    with open(out_dir / WEIGHTS_FILE, "wb") as f, tqdm(total=total, unit="B", unit_scale=True, desc="precast quantize", disable=not progress) as bar:
        writer = SafetensorsWriter(f, layout, metadata={"format": "precast"})
        for name, _, _ in layout:
            if name in pending:
                array = pending.pop(name)
            else:
                source = fold_awq(name, engine.weights.read(name), scales, spec.q_size, spec.kv_size)
                layer = name[: -len(".weight")] if name.endswith(".weight") else None
                if layer in plan:
                    pending = quantize_layer(layer, plan[layer], source.astype(np.float32), calib, quant["layers"][layer])
                    if layer in scales:
                        quant["layers"][layer].update(awq=True, awq_alpha=scales[layer].alpha)
                    elif plan[layer].format == "int4":
                        quant["layers"][layer]["awq"] = False
                    array = pending.pop(name)
                else:
                    array = source.astype(np.float32 if source.ndim == 1 else matrix_dtype)
                    if not np.isfinite(array).all():
                        raise PrecastError(f"{name} has values beyond {engine.config.dtype}'s range after AWQ scaling; build with --dtype float32")
            writer.write(name, array)
            bar.update(array.nbytes)
        writer.finish()
    return total


def kv_cache_scales(calib: CalibrationResult, num_layers: int) -> dict[str, list[float]]:
    return {
        "k_scales": [_calibrated_scale(calib, f"layers.{i}.attn.k", FP8_MAX) for i in range(num_layers)],
        "v_scales": [_calibrated_scale(calib, f"layers.{i}.attn.v", FP8_MAX) for i in range(num_layers)],
    }
