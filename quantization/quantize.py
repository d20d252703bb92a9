"""A full-precision engine -> a quantized engine's weights and `quant` section.

Streaming like the build: each tensor is read from the full-precision engine, folded (AWQ),
quantized or cast, and written before the next is read. Each layer's format (engine/quant.py)
quantizes it; per-tensor scales go into its record in the config, block and group scales are
written beside their weights.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import numpy as np
from tqdm import tqdm

from precast.engine.directory import WEIGHTS_FILE, Engine, numpy_dtype
from precast.engine.formats import FP8_MAX, per_tensor_scale
from precast.engine.quant import Int4Layer, KvCacheFp8, LayerQuant, Nvfp4Layer, QuantSection
from precast.engine.safetensors_file import DTYPES, SafetensorsWriter
from precast.engine.tensors import TensorLayout, is_linear_kind
from precast.errors import PrecastError
from precast.quantization import awq
from precast.quantization.calibration import CalibrationResult
from precast.quantization.recipe import QuantOptions


def quant_section(options: QuantOptions, plan: dict[str, LayerQuant]) -> QuantSection:
    """The section before any scale is known (enough to lay out the weights file)."""
    return QuantSection(recipe=options.recipe, lm_head=options.quantize_lm_head, exclude=tuple(options.exclude), layers=dict(plan))


def awq_scales(engine: Engine, plan: dict[str, LayerQuant], calib: CalibrationResult, progress: bool) -> dict[str, awq.AwqScale]:
    """Search a scale for every int4 layer whose 1 / s can be folded into what feeds it."""
    spec = engine.config.model
    found: dict[str, awq.AwqScale] = {}
    targets = {}
    for i in range(spec.num_layers):
        targets.update(awq.fold_targets(spec, i))
    todo = [n for n, p in plan.items() if isinstance(p, Int4Layer) and targets.get(n)]
    for name in tqdm(todo, desc="precast awq", disable=not progress):
        stats = calib.stats.get(name)
        if (stats is None or len(stats.samples) == 0) and _EXPERT.fullmatch(name):
            continue  # no calibration token was routed to this expert: plain round-to-nearest int4
        if stats is None or len(stats.samples) == 0:
            raise PrecastError(f"calibration recorded no inputs for {name}; cannot search its AWQ scale")
        weight = engine.weights.read(f"{name}.weight").astype(np.float32)
        record = plan[name]
        assert isinstance(record, Int4Layer)
        found[name] = awq.search_scale(weight, stats.samples, stats.mean_abs, record.group_size, asymmetric=bool(record.asymmetric))
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
    if rest.endswith(".weight") and is_linear_kind(rest[: -len(".weight")]):
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
    if rest.endswith(".gate_up.weight"):  # mlp, an expert, or the shared expert: its down's 1 / s goes to its up rows
        down = s(rest[: -len("gate_up.weight")] + "down")
        if down is not None:
            inter = out.shape[0] // 2
            out[inter:] /= down[:, None]
    return out


_EXPERT = re.compile(r"(layers\.\d+\.moe\.experts\.)\d+(\.gate_up|\.down)")


def _input_amax(calib: CalibrationResult | None, name: str) -> float:
    """The calibrated max |x| of a layer's input (or of K / V: "layers.{i}.attn.k|v"). An expert that no calibration
    token was routed to takes the largest of its layer's other experts' (same kind): their inputs are the same
    normed hidden states (gate_up) or come from the same kind of projection (down)."""
    stats = calib.stats.get(name) if calib else None
    if stats is not None:
        return stats.tensor_amax
    expert = _EXPERT.fullmatch(name)
    if calib and expert:
        siblings = [st.tensor_amax for n, st in calib.stats.items() if (m := _EXPERT.fullmatch(n)) and m.groups() == expert.groups()]
        if siblings:
            return max(siblings)
    raise PrecastError(f"calibration recorded no inputs for {name}")


def quantize_layer(
    name: str,
    record: LayerQuant,
    weight: np.ndarray,
    calib: CalibrationResult | None,
    awq_scale: awq.AwqScale | None = None,
    scale_search: bool = False,
) -> tuple[dict[str, np.ndarray], LayerQuant]:
    """One layer's stored tensors by engine name, and its completed record. `weight` is as stored (AWQ's scale
    folded in); an int4 or nvfp4 layer with calibration rows gets searched group / block scales (and asymmetric int4
    offsets) when `scale_search`."""
    amax = _input_amax(calib, name) if record.quantizes_inputs else None
    stats = calib.stats.get(name) if calib else None
    searchable = isinstance(record, (Int4Layer, Nvfp4Layer)) and scale_search and stats is not None and len(stats.samples) > 0
    if searchable:
        inputs = stats.samples if awq_scale is None else stats.samples / awq_scale.scale  # what feeds the stored weight
        if isinstance(record, Int4Layer):
            scales, offsets = awq.search_group_scales(weight, inputs, record.group_size, bool(record.asymmetric))
            arrays, done = record.quantize(weight, amax, scales, offsets)
        else:
            assert isinstance(record, Nvfp4Layer)
            arrays, done = record.quantize(weight, amax, awq.search_nvfp4_block_scales(weight, inputs))
    else:
        arrays, done = record.quantize(weight, amax)
    return {f"{name}.{suffix}": array for suffix, array in arrays.items()}, done


def write_quantized_weights(
    engine: Engine,
    out_dir: Path,
    expected: TensorLayout,
    plan: dict[str, LayerQuant],
    calib: CalibrationResult | None,
    scales: dict[str, awq.AwqScale],
    progress: bool,
    scale_search: bool = False,
) -> tuple[int, dict[str, LayerQuant]]:
    """Write weights.safetensors laid out as `expected`. Returns the bytes written and every layer's completed record.
    `scale_search`: int4 group and nvfp4 block scales searched on the calibration rows (quantize_layer)."""
    spec = engine.config.model
    matrix_dtype = numpy_dtype(engine.config.dtype)
    layout = [(n, DTYPES[dt], shape) for n, (shape, dt) in expected.items()]
    total = sum(math.prod(shape) * np.dtype(dt).itemsize for _, dt, shape in layout)
    pending: dict[str, np.ndarray] = {}  # scales produced with their weight, written right after it
    records: dict[str, LayerQuant] = {}
    with (
        open(out_dir / WEIGHTS_FILE, "wb") as f,
        tqdm(total=total, unit="B", unit_scale=True, desc="precast quantize", disable=not progress) as bar,
    ):
        writer = SafetensorsWriter(f, layout, metadata={"format": "precast"})
        for name, _, _ in layout:
            if name in pending:
                array = pending.pop(name)
            else:
                source = fold_awq(name, engine.weights.read(name), scales, spec.q_size, spec.kv_size)
                layer = name[: -len(".weight")] if name.endswith(".weight") else None
                if layer in plan:
                    pending, records[layer] = quantize_layer(
                        layer, plan[layer], source.astype(np.float32), calib, scales.get(layer), scale_search
                    )
                    if layer in scales:
                        records[layer] = dataclasses.replace(records[layer], awq=True, awq_alpha=scales[layer].alpha)
                    array = pending.pop(name)
                else:
                    array = source.astype(np.float32 if source.ndim == 1 else matrix_dtype)
                    if not np.isfinite(array).all():
                        raise PrecastError(
                            f"{name} has values beyond {engine.config.dtype}'s range after AWQ scaling; build with --dtype float32"
                        )
            writer.write(name, array)
            bar.update(array.nbytes)
        writer.finish()
    return total, records


def kv_cache_scales(calib: CalibrationResult, num_layers: int) -> KvCacheFp8:
    def scale(name: str) -> float:
        return per_tensor_scale(_input_amax(calib, name), FP8_MAX)

    return KvCacheFp8(
        tuple(scale(f"layers.{i}.attn.k") for i in range(num_layers)), tuple(scale(f"layers.{i}.attn.v") for i in range(num_layers))
    )
