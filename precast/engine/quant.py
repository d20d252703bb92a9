"""The `quant` section of config.json, typed, and one class per stored format (docs/quantization.md).

    recipe          "none" | "fp8" | "nvfp4" | "int4_awq"
    lm_head         whether the LM head was quantized
    exclude         the --exclude patterns given
    layers          layer name -> the record of its format (below)
    kv_cache        {"k_scales": [per layer], "v_scales": [per layer]}   (limits.kv_cache_dtype "fp8")
    calibration     what calibration ran on and what it cost
    source          how a pre-quantized checkpoint's scales were taken (modelopt exports)

Each layer format is one class, found through FORMATS by its name. It owns everything about the
format: the tensors it stores (layout), how a float32 weight becomes them (quantize), the checks of
a loaded record (validation), how the CPU runner takes it (load_cpu), what the GPU kernels read
(device_arrays: plugins/triton/linear.py) and how the TensorRT lowering dequantizes it (lower_weight,
lower_input). Block and group scales are tensors beside the weights (`{layer}.weight_scale`); every
per-tensor scale is in the record. A record whose scales are still
None is a plan (the layout is known before calibration has run); a loaded engine's records are
complete.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from precast import _C
from precast.engine import formats
from precast.engine.limits import KV_CACHE_DTYPES
from precast.engine.spec import ModelSpec
from precast.engine.tensors import TensorLayout, linear_shapes
from precast.errors import PrecastError

RECIPES = ("none", "fp8", "nvfp4", "int4_awq")
INPUT_SCALES = ("static", "dynamic")  # fp8 activations: one calibrated scale per tensor, or one per token at run time
DYNAMIC_CPU_ONLY = (
    "fp8 with dynamic (per-token) activation scales runs on the CPU backend only so far; the cuda backend and the "
    "TensorRT lowering take static scales: rebuild with --activation-scales static"
)
ReadTensor = Callable[[str], np.ndarray]
# Tensors stored beside a quantized layer's `{layer}.weight` and read with it by its format.
SIDE_TENSOR_SUFFIXES = (".weight_scale", ".weight_offset")


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@dataclass(frozen=True)
class LayerQuant:
    """The record of one quantized linear layer; subclasses are the formats."""

    format: ClassVar[str]
    scale_keys: ClassVar[tuple[str, ...]] = ()  # per-tensor scales the record must hold once built
    quantizes_inputs: ClassVar[bool] = False  # True: needs the calibrated amax of its input (quantize's input_amax)

    @classmethod
    def plan(cls, cols: int, group_size: int | None) -> tuple[LayerQuant | None, str | None]:
        """The record a layer of `cols` inputs gets before any scale is known, or why it cannot take the format."""
        return cls(), None

    def tensors(self, layer: str, rows: int, cols: int) -> TensorLayout:
        raise NotImplementedError

    def problems(self, layer: str, rows: int, cols: int) -> list[str]:
        """What is wrong with a loaded record (empty when it can run)."""
        return [f"layer {layer} has no valid {k} ({getattr(self, k)!r})" for k in self.scale_keys if not _positive(getattr(self, k))]

    def quantize(self, weight: np.ndarray, input_amax: float | None) -> tuple[dict[str, np.ndarray], LayerQuant]:
        """float32 [rows, cols] -> the stored arrays (by suffix: "weight", "weight_scale") and the completed record."""
        raise NotImplementedError

    def load_cpu(self, runner: Any, layer: str, read: ReadTensor, rows: int, cols: int, quantize_activations: bool) -> None:
        raise NotImplementedError

    def device_arrays(self, layer: str, read: ReadTensor) -> dict[str, Any]:
        """The stored arrays and scales as the GPU kernels take them (plugins/triton/linear.py's LinearWeight
        fields: format, values, scales, group_size, weight_scale, input_quant, input_scale), as numpy."""
        raise NotImplementedError

    def lower_weight(self, lowering: Any, layer: str, rows: slice, tag: str) -> Any:
        """W[rows] dequantized in the network's activation dtype (builder/tensorrt lowering)."""
        raise NotImplementedError

    def lower_input(self, lowering: Any, x: Any, layer: str) -> Any:
        """The layer's input as the recipe quantizes it, dequantized (weight-only formats: unchanged)."""
        return x

    def precision(self, act_dtype: str) -> str:
        """One line for the TensorRT build report."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format} | {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @staticmethod
    def from_dict(data: Any, layer: str) -> LayerQuant:
        fmt = data.get("format") if isinstance(data, dict) else None
        if fmt not in FORMATS:
            raise ValueError(f"layer {layer} has unknown format {fmt!r}")
        cls = FORMATS[fmt]
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class Fp8Layer(LayerQuant):
    """E4M3 weights with one per-tensor scale; inputs quantized to E4M3 with a static calibrated scale
    (`input_scales` "static") or with one scale per token computed at run time ("dynamic": max|row| / 448)."""

    format: ClassVar[str] = "fp8"
    scale_keys: ClassVar[tuple[str, ...]] = ("weight_scale", "input_scale")
    quantizes_inputs: ClassVar[bool] = True
    weight_scale: float | None = None
    input_scale: float | None = None  # static only
    input_scales: str | None = None  # None: "static" (engines from before the option say nothing)

    @property
    def dynamic(self) -> bool:
        return self.input_scales == "dynamic"

    def problems(self, layer: str, rows: int, cols: int) -> list[str]:
        if self.input_scales is not None and self.input_scales not in INPUT_SCALES:
            return [f"layer {layer} has unknown input_scales {self.input_scales!r} (known: {', '.join(INPUT_SCALES)})"]
        keys = ("weight_scale",) if self.dynamic else self.scale_keys
        return [f"layer {layer} has no valid {k} ({getattr(self, k)!r})" for k in keys if not _positive(getattr(self, k))]

    def tensors(self, layer: str, rows: int, cols: int) -> TensorLayout:
        return {f"{layer}.weight": ((rows, cols), "F8_E4M3")}

    def quantize(self, weight: np.ndarray, input_amax: float | None) -> tuple[dict[str, np.ndarray], LayerQuant]:
        q = formats.quantize_fp8(weight)
        input_scale = None if self.dynamic else formats.per_tensor_scale(input_amax or 0.0, formats.FP8_MAX)
        return {"weight": q.values}, dataclasses.replace(self, weight_scale=q.scale, input_scale=input_scale)

    def load_cpu(self, runner: Any, layer: str, read: ReadTensor, rows: int, cols: int, quantize_activations: bool) -> None:
        values = np.ascontiguousarray(read(f"{layer}.weight").view(np.uint8))
        act = _C.ActQuant.NONE
        if quantize_activations:
            act = _C.ActQuant.FP8_DYNAMIC if self.dynamic else _C.ActQuant.FP8_STATIC
        runner.set_quantized_weight(
            f"{layer}.weight", _C.WeightDtype.FP8, rows, cols, values, None, 0, self.weight_scale, act, self.input_scale or 1.0
        )

    def device_arrays(self, layer: str, read: ReadTensor) -> dict[str, Any]:
        if self.dynamic:
            raise PrecastError(DYNAMIC_CPU_ONLY)
        values = read(f"{layer}.weight").view(np.uint8)
        return dict(format="fp8", values=values, weight_scale=self.weight_scale, input_quant="fp8", input_scale=self.input_scale)

    def lower_weight(self, lowering: Any, layer: str, rows: slice, tag: str) -> Any:
        scale = lowering.const(f"{layer}.weight_scale", np.float32(self.weight_scale), "float32")
        stored = lowering.ops.constant(f"{tag}.weight", lowering.engine.weights.read(f"{layer}.weight")[rows], "fp8")
        return lowering.ops.dequantize(stored, scale, lowering.act)

    def lower_input(self, lowering: Any, x: Any, layer: str) -> Any:
        if self.dynamic:
            raise PrecastError(DYNAMIC_CPU_ONLY)
        ops = lowering.ops
        s = lowering.const(f"{layer}.input_scale", np.float32(self.input_scale), "float32")
        return ops.dequantize(ops.quantize(x, s, "fp8"), s, lowering.act)

    def precision(self, act_dtype: str) -> str:
        return f"fp8 weights (per-tensor scale), fp8 inputs ({self.input_scales or 'static'} scale)"


@dataclass(frozen=True)
class Nvfp4Layer(LayerQuant):
    """E2M1 weights packed two per byte with E4M3 scales per 16 inputs and a float32 global scale;
    inputs quantized the same way at run time (dynamic per 16, calibrated global scale). `scale_search`: the
    weight's block scales were searched (quantization/awq.py) instead of rounded from max|block|."""

    format: ClassVar[str] = "nvfp4"
    scale_keys: ClassVar[tuple[str, ...]] = ("weight_global_scale", "input_global_scale")
    quantizes_inputs: ClassVar[bool] = True
    weight_global_scale: float | None = None
    input_global_scale: float | None = None
    scale_search: bool | None = None

    @classmethod
    def plan(cls, cols: int, group_size: int | None) -> tuple[LayerQuant | None, str | None]:
        if cols % formats.NVFP4_BLOCK:
            return None, f"its input size {cols} is not a multiple of {formats.NVFP4_BLOCK}"
        return cls(), None

    def tensors(self, layer: str, rows: int, cols: int) -> TensorLayout:
        return {f"{layer}.weight": ((rows, cols // 2), "U8"), f"{layer}.weight_scale": ((rows, cols // formats.NVFP4_BLOCK), "F8_E4M3")}

    def problems(self, layer: str, rows: int, cols: int) -> list[str]:
        problems = super().problems(layer, rows, cols)
        if cols % formats.NVFP4_BLOCK:
            problems.append(f"layer {layer}: nvfp4 needs an input size that is a multiple of {formats.NVFP4_BLOCK}")
        return problems

    def quantize(
        self, weight: np.ndarray, input_amax: float | None, group_scales: np.ndarray | None = None
    ) -> tuple[dict[str, np.ndarray], LayerQuant]:
        q = formats.quantize_nvfp4(weight, block_scales=group_scales)
        input_scale = formats.per_tensor_scale(input_amax or 0.0, formats.FP4_MAX * formats.FP8_MAX)
        searched = group_scales is not None
        record = dataclasses.replace(self, weight_global_scale=q.global_scale, input_global_scale=input_scale, scale_search=searched)
        return {"weight": q.packed, "weight_scale": q.block_scales}, record

    def load_cpu(self, runner: Any, layer: str, read: ReadTensor, rows: int, cols: int, quantize_activations: bool) -> None:
        values = np.ascontiguousarray(read(f"{layer}.weight").view(np.uint8))
        scales = np.ascontiguousarray(read(f"{layer}.weight_scale")).view(np.uint8)
        act = _C.ActQuant.NVFP4_DYNAMIC if quantize_activations else _C.ActQuant.NONE
        runner.set_quantized_weight(
            f"{layer}.weight",
            _C.WeightDtype.NVFP4,
            rows,
            cols,
            values,
            scales,
            formats.NVFP4_BLOCK,
            self.weight_global_scale,
            act,
            self.input_global_scale,
        )

    def device_arrays(self, layer: str, read: ReadTensor) -> dict[str, Any]:
        return dict(
            format="nvfp4",
            values=read(f"{layer}.weight").view(np.uint8),
            scales=read(f"{layer}.weight_scale").view(np.uint8),  # E4M3 bits
            group_size=formats.NVFP4_BLOCK,
            weight_scale=self.weight_global_scale,
            input_quant="nvfp4",
            input_scale=self.input_global_scale,
        )

    def lower_weight(self, lowering: Any, layer: str, rows: slice, tag: str) -> Any:
        # Two levels: E4M3 block scales x the global scale, then the E2M1 values x those (the block scales come out
        # in activation dtype: TensorRT's FP4 dequantize takes its output type's scales).
        ops, read, act = lowering.ops, lowering.engine.weights.read, lowering.act
        global_scale = lowering.const(f"{layer}.weight_global_scale", np.float32(self.weight_global_scale), "float32")
        block = ops.dequantize(ops.constant(f"{tag}.weight_scale", read(f"{layer}.weight_scale")[rows], "fp8"), global_scale, act)
        return ops.dequantize(ops.constant(f"{tag}.weight", formats.unpack_fp4(read(f"{layer}.weight")[rows]), "fp4"), block, act)

    def lower_input(self, lowering: Any, x: Any, layer: str) -> Any:
        ops = lowering.ops
        g = lowering.const(f"{layer}.input_global_scale", np.float32(self.input_global_scale), "float32")
        q, block_scale = ops.dynamic_quantize_fp4(x, g)
        return ops.dequantize(q, ops.dequantize(block_scale, g, lowering.act), lowering.act)

    def precision(self, act_dtype: str) -> str:
        return "nvfp4 weights (E4M3 per 16 x global), nvfp4 inputs (dynamic per 16)"


@dataclass(frozen=True)
class Int4Layer(LayerQuant):
    """Signed 4-bit weights packed two per byte, a scale per group of inputs and, `asymmetric`, an offset per group
    (`{layer}.weight_offset`: w ~ q * scale + offset), both float32 tensors holding bf16 values (formats.quantize_int4;
    engines built before that are rounded to bf16 when the CPU runner loads them); inputs stay in the engine dtype (weight-only,
    W4A16). `awq`: activation-aware scales were folded in; `scale_search`: the group scales (and offsets) were
    searched (quantization/awq.py) instead of taken from the group's extremes."""

    format: ClassVar[str] = "int4"
    group_size: int = 0
    awq: bool | None = None
    awq_alpha: float | None = None
    scale_search: bool | None = None
    asymmetric: bool | None = None  # None: symmetric (engines from before the option say nothing)

    @classmethod
    def plan(cls, cols: int, group_size: int | None) -> tuple[LayerQuant | None, str | None]:
        if group_size is not None:
            if cols % group_size:
                return None, f"--group-size {group_size} does not divide its input size {cols}"
            return cls(group_size=group_size), None
        try:
            return cls(group_size=formats.default_group_size(cols)), None
        except ValueError:
            return None, f"its input size {cols} is not divisible by 32, 64 or 128"

    def tensors(self, layer: str, rows: int, cols: int) -> TensorLayout:
        groups = (rows, cols // self.group_size)
        layout: TensorLayout = {f"{layer}.weight": ((rows, cols // 2), "U8"), f"{layer}.weight_scale": (groups, "F32")}
        if self.asymmetric:
            layout[f"{layer}.weight_offset"] = (groups, "F32")
        return layout

    def problems(self, layer: str, rows: int, cols: int) -> list[str]:
        g = self.group_size
        if not _positive(g) or not isinstance(g, int):
            return [f"layer {layer} has no valid group_size ({g!r})"]
        if cols % g or g % 2:
            return [f"layer {layer}: group size {g} does not divide its input size {cols}"]
        return []

    def quantize(
        self,
        weight: np.ndarray,
        input_amax: float | None,
        group_scales: np.ndarray | None = None,
        group_offsets: np.ndarray | None = None,
    ) -> tuple[dict[str, np.ndarray], LayerQuant]:
        asymmetric = bool(self.asymmetric)
        q = formats.quantize_int4(weight, self.group_size, group_scales, asymmetric, group_offsets)
        arrays = {"weight": q.packed, "weight_scale": q.scales}
        if q.offsets is not None:
            arrays["weight_offset"] = q.offsets
        done = dataclasses.replace(self, awq=bool(self.awq), scale_search=group_scales is not None, asymmetric=asymmetric)
        return arrays, done

    def load_cpu(self, runner: Any, layer: str, read: ReadTensor, rows: int, cols: int, quantize_activations: bool) -> None:
        values = np.ascontiguousarray(read(f"{layer}.weight").view(np.uint8))
        scales = np.ascontiguousarray(read(f"{layer}.weight_scale"))
        offsets = np.ascontiguousarray(read(f"{layer}.weight_offset")) if self.asymmetric else None
        runner.set_quantized_weight(
            f"{layer}.weight", _C.WeightDtype.INT4, rows, cols, values, scales, self.group_size, 1.0, _C.ActQuant.NONE, 1.0, offsets
        )

    def device_arrays(self, layer: str, read: ReadTensor) -> dict[str, Any]:
        scales = read(f"{layer}.weight_scale").astype(np.float32)
        arrays = dict(format="int4", values=read(f"{layer}.weight").view(np.uint8), scales=scales, group_size=self.group_size)
        if self.asymmetric:
            arrays["offsets"] = read(f"{layer}.weight_offset").astype(np.float32)
        return arrays

    def lower_weight(self, lowering: Any, layer: str, rows: slice, tag: str) -> Any:
        ops, read = lowering.ops, lowering.engine.weights.read
        scales = lowering.const(f"{tag}.weight_scale", read(f"{layer}.weight_scale")[rows], lowering.act)
        w = ops.dequantize(ops.constant(f"{tag}.weight", formats.unpack_int4(read(f"{layer}.weight")[rows]), "int4"), scales, lowering.act)
        if not self.asymmetric:
            return w
        # + offset per group: [rows, groups, group] + [rows, groups, 1], broadcast along each group.
        offsets = read(f"{layer}.weight_offset")[rows]
        count, groups = offsets.shape
        grouped = ops.reshape(w, (count, groups, self.group_size))
        shifted = ops.elementwise("sum", grouped, lowering.const(f"{tag}.weight_offset", offsets[:, :, None], lowering.act))
        return ops.reshape(shifted, (count, groups * self.group_size))

    def precision(self, act_dtype: str) -> str:
        kind = "asymmetric int4" if self.asymmetric else "int4"
        return f"{kind} weights (groups of {self.group_size}), {act_dtype} inputs"


FORMATS: dict[str, type[LayerQuant]] = {cls.format: cls for cls in (Fp8Layer, Nvfp4Layer, Int4Layer)}
RECIPE_FORMATS: dict[str, type[LayerQuant]] = {"fp8": Fp8Layer, "nvfp4": Nvfp4Layer, "int4_awq": Int4Layer}


@dataclass(frozen=True)
class KvCacheFp8:
    """The fp8 KV cache (limits.kv_cache_dtype "fp8"): E4M3 pools with one K and one V scale per layer."""

    k_scales: tuple[float, ...]
    v_scales: tuple[float, ...]

    def problems(self, num_layers: int) -> list[str]:
        return [
            f"fp8 KV cache needs {num_layers} positive {key}"
            for key in ("k_scales", "v_scales")
            if len(getattr(self, key)) != num_layers or not all(_positive(v) for v in getattr(self, key))
        ]

    def load_cpu(self, config: Any) -> None:
        config.kv_fp8 = True
        config.k_scales = list(self.k_scales)
        config.v_scales = list(self.v_scales)

    def to_dict(self) -> dict[str, list[float]]:
        return {"k_scales": list(self.k_scales), "v_scales": list(self.v_scales)}


@dataclass(frozen=True)
class QuantSection:
    recipe: str = "none"
    lm_head: bool = False
    exclude: tuple[str, ...] = ()
    layers: dict[str, LayerQuant] = field(default_factory=dict)
    kv_cache: KvCacheFp8 | None = None
    calibration: dict[str, Any] | None = None
    source: str | None = None

    def to_dict(self) -> dict[str, Any]:
        if self.recipe == "none" and not self.layers:
            out: dict[str, Any] = {"recipe": "none"}
        else:
            out = {
                "recipe": self.recipe,
                "lm_head": self.lm_head,
                "exclude": list(self.exclude),
                "layers": {name: layer.to_dict() for name, layer in self.layers.items()},
            }
        if self.kv_cache is not None:
            out["kv_cache"] = self.kv_cache.to_dict()
        if self.calibration is not None:
            out["calibration"] = self.calibration
        if self.source is not None:
            out["source"] = self.source
        return out

    @classmethod
    def from_dict(cls, data: Any, spec: ModelSpec, kv_cache_dtype: str, where: str) -> QuantSection:
        """Read and check a `quant` section, refusing one this precast cannot run and naming what is wrong."""

        def fail(msg: str) -> PrecastError:
            return PrecastError(f"{where}: {msg}; rebuild the engine with this precast")

        if not isinstance(data, dict) or data.get("recipe") not in RECIPES:
            recipe = data.get("recipe") if isinstance(data, dict) else data
            raise fail(f"quantization recipe {recipe!r} is not one this precast runs ({', '.join(RECIPES)})")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise fail(f"KV cache dtype {kv_cache_dtype!r} is not supported")
        shapes = linear_shapes(spec)
        layers: dict[str, LayerQuant] = {}
        for name, entry in (data.get("layers") or {}).items():
            if name not in shapes:
                raise fail(f"quantized layer {name!r} is not a layer of this model")
            try:
                layers[name] = LayerQuant.from_dict(entry, name)
            except (ValueError, TypeError) as e:
                raise fail(str(e)) from e
            problems = layers[name].problems(name, *shapes[name])
            if problems:
                raise fail(problems[0])
        kv_cache = None
        if kv_cache_dtype == "fp8":
            raw = data.get("kv_cache") or {}
            k, v = raw.get("k_scales"), raw.get("v_scales")
            kv_cache = KvCacheFp8(tuple(k) if isinstance(k, list) else (), tuple(v) if isinstance(v, list) else ())
            problems = kv_cache.problems(spec.num_layers)
            if problems:
                raise fail(problems[0])
        return cls(
            recipe=data["recipe"],
            lm_head=bool(data.get("lm_head", False)),
            exclude=tuple(data.get("exclude", ())),
            layers=layers,
            kv_cache=kv_cache,
            calibration=data.get("calibration"),
            source=data.get("source"),
        )
