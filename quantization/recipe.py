"""Quantization recipes: what each `--quant` means, which layers it covers, and the `quant` section
of an engine's config.json (docs/quantization.md).

Layers are named by their engine tensor without ".weight": `layers.{i}.attn.qkv`, `layers.{i}.attn.o`,
`layers.{i}.mlp.gate_up`, `layers.{i}.mlp.down`, and `lm_head` (`embed` when the head is tied to the
embeddings). `--exclude` patterns (fnmatch) match these names.

The `quant` section:

    recipe          "none" | "fp8" | "nvfp4" | "int4_awq"
    lm_head         whether the LM head was quantized
    exclude         the patterns given
    layers          name -> {"format": "fp8", "weight_scale", "input_scale"}
                          | {"format": "nvfp4", "weight_global_scale", "input_global_scale"}
                          | {"format": "int4", "group_size", "awq": true}
    kv_cache        {"k_scales": [per layer], "v_scales": [per layer]}   (limits.kv_cache_dtype "fp8")
    calibration     what calibration ran on and what it cost
Block and group scales are tensors beside the weights (`{layer}.weight_scale`); every per-tensor
scale is in the config.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from precast.builder.limits import KV_CACHE_DTYPES
from precast.builder.spec import ModelSpec
from precast.errors import PrecastError
from precast.quantization.formats import NVFP4_BLOCK, default_group_size

RECIPES = ("none", "fp8", "nvfp4", "int4_awq")
LAYER_FORMATS = ("fp8", "nvfp4", "int4")
_RECIPE_FORMAT = {"fp8": "fp8", "nvfp4": "nvfp4", "int4_awq": "int4"}
LINEAR_KINDS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")


@dataclass(frozen=True)
class QuantOptions:
    """What the user asked for (`precast build --quant ...`)."""

    recipe: str = "none"
    kv_cache_dtype: str = "auto"
    quantize_lm_head: bool = False
    exclude: tuple[str, ...] = ()
    group_size: int | None = None  # int4_awq: None = the largest of 128, 64, 32 dividing each layer's input
    skip_unsupported: bool = False  # leave layers the format cannot take in full precision instead of failing
    calib_text: Path | None = None  # None: the text shipped with precast
    calib_samples: int = 16
    calib_seq_len: int = 256
    calib_tokens: tuple[tuple[int, ...], ...] | None = None  # Python API: token sequences instead of text

    @property
    def active(self) -> bool:
        return self.recipe != "none" or self.kv_cache_dtype != "auto"

    def check(self) -> None:
        if self.recipe not in RECIPES:
            raise PrecastError(f"unknown --quant {self.recipe!r}; choose from {', '.join(RECIPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise PrecastError(f"--kv-cache-dtype {self.kv_cache_dtype!r} is not supported; choose from {', '.join(KV_CACHE_DTYPES)}")
        if self.group_size is not None and (self.group_size < 2 or self.group_size % 2):
            raise PrecastError(f"--group-size must be an even number >= 2, got {self.group_size}")
        if self.group_size is not None and self.recipe != "int4_awq":
            raise PrecastError("--group-size applies to --quant int4_awq only")
        if self.quantize_lm_head and self.recipe == "none":
            raise PrecastError("--quantize-lm-head needs a --quant recipe")
        if self.calib_samples < 1 or self.calib_seq_len < 2:
            raise PrecastError("--calib-samples must be >= 1 and --calib-seq-len >= 2")
        if self.calib_text is not None and not Path(self.calib_text).is_file():
            raise PrecastError(f"--calib-text {self.calib_text} does not exist or is not a file")


@dataclass(frozen=True)
class LayerPlan:
    name: str  # layer name (engine tensor without ".weight")
    format: str  # fp8 | nvfp4 | int4
    rows: int
    cols: int
    group_size: int = 0  # int4: the group; nvfp4: 16


def linear_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """Every quantizable matrix (layer name -> (out, in)), head last."""
    h, q, kv, inter = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    shapes: dict[str, tuple[int, int]] = {}
    for i in range(spec.num_layers):
        shapes[f"layers.{i}.attn.qkv"] = (q + 2 * kv, h)
        shapes[f"layers.{i}.attn.o"] = (h, q)
        shapes[f"layers.{i}.mlp.gate_up"] = (2 * inter, h)
        shapes[f"layers.{i}.mlp.down"] = (h, inter)
    shapes[head_name(spec)] = (spec.vocab_size, h)
    return shapes


def head_name(spec: ModelSpec) -> str:
    return "embed" if spec.tie_word_embeddings else "lm_head"


def plan_layers(spec: ModelSpec, options: QuantOptions) -> dict[str, LayerPlan]:
    """The layers the recipe quantizes, each checked against what its format can take."""
    if options.recipe == "none":
        return {}
    fmt = _RECIPE_FORMAT[options.recipe]
    shapes = linear_shapes(spec)
    head = head_name(spec)
    names = [n for n in shapes if n != head or options.quantize_lm_head]
    unmatched = [p for p in options.exclude if not any(fnmatch.fnmatchcase(n, p) for n in shapes)]
    if unmatched:
        raise PrecastError(
            f"--exclude {', '.join(unmatched)} matches no layer; layer names look like "
            f"layers.0.attn.qkv, layers.3.mlp.down, {head} (fnmatch patterns, e.g. 'layers.0.*' or '*.mlp.down')"
        )
    plan: dict[str, LayerPlan] = {}
    for name in names:
        if any(fnmatch.fnmatchcase(name, p) for p in options.exclude):
            continue
        rows, cols = shapes[name]
        problem, group = _shape_problem(fmt, cols, options.group_size)
        if problem:
            if options.skip_unsupported:
                continue
            raise PrecastError(
                f"layer {name} ({rows}x{cols}) cannot be stored as {fmt}: {problem}; "
                f"pass --exclude {name} (or --skip-unsupported) to keep it in full precision"
            )
        plan[name] = LayerPlan(name, fmt, rows, cols, group)
    return plan


def _shape_problem(fmt: str, cols: int, group_size: int | None) -> tuple[str | None, int]:
    if fmt == "nvfp4":
        return (None, NVFP4_BLOCK) if cols % NVFP4_BLOCK == 0 else (f"its input size {cols} is not a multiple of {NVFP4_BLOCK}", 0)
    if fmt == "int4":
        if group_size is not None:
            return (None, group_size) if cols % group_size == 0 else (f"--group-size {group_size} does not divide its input size {cols}", 0)
        try:
            return None, default_group_size(cols)
        except ValueError:
            return f"its input size {cols} is not divisible by 32, 64 or 128", 0
    return None, 0


def quantized_tensor_layout(layer: dict[str, Any], rows: int, cols: int, name: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """The engine tensors (shape, safetensors dtype) of one quantized layer."""
    fmt = layer.get("format")
    if fmt == "fp8":
        return {f"{name}.weight": ((rows, cols), "F8_E4M3")}
    if fmt == "nvfp4":
        return {f"{name}.weight": ((rows, cols // 2), "U8"), f"{name}.weight_scale": ((rows, cols // NVFP4_BLOCK), "F8_E4M3")}
    g = int(layer["group_size"])
    return {f"{name}.weight": ((rows, cols // 2), "U8"), f"{name}.weight_scale": ((rows, cols // g), "F32")}


def check_quant_section(quant: dict[str, Any], spec: ModelSpec, kv_cache_dtype: str, where: str) -> None:
    """Refuse a `quant` section this precast cannot run, naming what is wrong."""

    def fail(msg: str) -> None:
        raise PrecastError(f"{where}: {msg}; rebuild the engine with this precast")

    if not isinstance(quant, dict) or quant.get("recipe") not in RECIPES:
        fail(f"quantization recipe {quant.get('recipe') if isinstance(quant, dict) else quant!r} is not one this precast runs ({', '.join(RECIPES)})")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        fail(f"KV cache dtype {kv_cache_dtype!r} is not supported")
    shapes = linear_shapes(spec)
    for name, layer in quant.get("layers", {}).items():
        if name not in shapes:
            fail(f"quantized layer {name!r} is not a layer of this model")
        fmt = layer.get("format") if isinstance(layer, dict) else None
        if fmt not in LAYER_FORMATS:
            fail(f"layer {name} has unknown format {fmt!r}")
        keys = {"fp8": ("weight_scale", "input_scale"), "nvfp4": ("weight_global_scale", "input_global_scale"), "int4": ("group_size",)}[fmt]
        for key in keys:
            value = layer.get(key)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                fail(f"layer {name} has no valid {key} ({value!r})")
        if fmt == "int4" and (shapes[name][1] % int(layer["group_size"]) or int(layer["group_size"]) % 2):
            fail(f"layer {name}: group size {layer['group_size']} does not divide its input size {shapes[name][1]}")
        if fmt == "nvfp4" and shapes[name][1] % NVFP4_BLOCK:
            fail(f"layer {name}: nvfp4 needs an input size that is a multiple of {NVFP4_BLOCK}")
    if kv_cache_dtype == "fp8":
        kv = quant.get("kv_cache") or {}
        for key in ("k_scales", "v_scales"):
            values = kv.get(key)
            if not isinstance(values, list) or len(values) != spec.num_layers or not all(
                isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values
            ):
                fail(f"fp8 KV cache needs {spec.num_layers} positive {key}")
