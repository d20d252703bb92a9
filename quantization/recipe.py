"""Quantization recipes: what each `--quant` means and which layers it covers (docs/quantization.md).

Layers are named by their engine tensor without ".weight" (engine/tensors.py): `layers.{i}.attn.qkv`,
`layers.{i}.attn.o`, `layers.{i}.mlp.gate_up`, `layers.{i}.mlp.down`, and `lm_head` (`embed` when the
head is tied to the embeddings). `--exclude` patterns (fnmatch) match these names. What a quantized
engine records is engine/quant.py's QuantSection.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from precast.engine.limits import KV_CACHE_DTYPES
from precast.engine.quant import INPUT_SCALES, RECIPE_FORMATS, RECIPES, Fp8Layer, Int4Layer, LayerQuant
from precast.engine.spec import ModelSpec
from precast.engine.tensors import head_name, linear_shapes
from precast.errors import PrecastError


@dataclass(frozen=True)
class QuantOptions:
    """What the user asked for (`precast build --quant ...`)."""

    recipe: str = "none"
    kv_cache_dtype: str = "auto"
    quantize_lm_head: bool = False
    exclude: tuple[str, ...] = ()
    group_size: int | None = None  # int4_awq: None = 64, or 32 where 64 does not divide the input
    scale_search: bool = True  # int4_awq / nvfp4: search each group's (block's) scale instead of rounding from its max
    asymmetric: bool = True  # int4_awq: a float32 offset per group beside its scale (False: --symmetric)
    activation_scales: str = "static"  # fp8: "static" (calibrated, per tensor) or "dynamic" (per token at run time)
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
        if self.activation_scales not in INPUT_SCALES:
            raise PrecastError(f"--activation-scales {self.activation_scales!r}: choose from {', '.join(INPUT_SCALES)}")
        if self.activation_scales != "static" and self.recipe != "fp8":
            raise PrecastError("--activation-scales dynamic applies to --quant fp8 only (nvfp4 scales each 16 inputs at run time)")
        if not self.asymmetric and self.recipe != "int4_awq":
            raise PrecastError("--symmetric applies to --quant int4_awq only")
        if not self.scale_search and self.recipe not in ("int4_awq", "nvfp4"):
            raise PrecastError("--no-scale-search applies to --quant int4_awq and nvfp4 only")
        if self.quantize_lm_head and self.recipe == "none":
            raise PrecastError("--quantize-lm-head needs a --quant recipe")
        if self.calib_samples < 1 or self.calib_seq_len < 2:
            raise PrecastError("--calib-samples must be >= 1 and --calib-seq-len >= 2")
        if self.calib_text is not None and not Path(self.calib_text).is_file():
            raise PrecastError(f"--calib-text {self.calib_text} does not exist or is not a file")


# Named variants of the recipes ("RECIPE:VARIANT" in benchmarks/ and the tests): the QuantOptions fields they set.
RECIPE_VARIANTS: dict[str, dict[str, Any]] = {
    "fp8:dynamic": {"activation_scales": "dynamic"},  # per-token activation scales instead of static per-tensor
    "int4_awq:no-search": {"scale_search": False},  # group scales and offsets from the groups' extremes
    "int4_awq:symmetric": {"asymmetric": False},  # groups centred on zero, a scale each (no offset)
    "int4_awq:symmetric-no-search": {"asymmetric": False, "scale_search": False},  # max|group| / 7, the first recipe
    "int4_awq:g32": {"group_size": 32},
    "int4_awq:g128": {"group_size": 128},  # the default before bf16 group scales
    "int4_awq:g32-no-search": {"group_size": 32, "scale_search": False},
    "int4_awq:g32-symmetric": {"group_size": 32, "asymmetric": False},
    "nvfp4:no-search": {"scale_search": False},  # block scales e4m3(max|block| / (6 x global)), as before the search
}


def parse_recipe_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """'fp8' -> ('fp8', {}); 'fp8:dynamic' -> ('fp8', {'activation_scales': 'dynamic'}): the recipe and the
    QuantOptions fields of a named variant."""
    if ":" not in spec:
        return spec, {}
    if spec not in RECIPE_VARIANTS:
        raise PrecastError(f"unknown recipe variant {spec!r}; known: {', '.join(RECIPE_VARIANTS)}")
    return spec.split(":")[0], dict(RECIPE_VARIANTS[spec])


def plan_layers(spec: ModelSpec, options: QuantOptions) -> dict[str, LayerQuant]:
    """The layers the recipe quantizes, each checked against what its format can take: name -> the
    layer's record before calibration (its scales still None)."""
    if options.recipe == "none":
        return {}
    fmt = RECIPE_FORMATS[options.recipe]
    shapes = linear_shapes(spec)
    head = head_name(spec)
    names = [n for n in shapes if n != head or options.quantize_lm_head]
    unmatched = [p for p in options.exclude if not any(fnmatch.fnmatchcase(n, p) for n in shapes)]
    if unmatched:
        raise PrecastError(
            f"--exclude {', '.join(unmatched)} matches no layer; layer names look like "
            f"layers.0.attn.qkv, layers.3.mlp.down, {head} (fnmatch patterns, e.g. 'layers.0.*' or '*.mlp.down')"
        )
    plan: dict[str, LayerQuant] = {}
    for name in names:
        if any(fnmatch.fnmatchcase(name, p) for p in options.exclude):
            continue
        rows, cols = shapes[name]
        record, problem = fmt.plan(cols, options.group_size)
        if record is None:
            if options.skip_unsupported:
                continue
            raise PrecastError(
                f"layer {name} ({rows}x{cols}) cannot be stored as {fmt.format}: {problem}; "
                f"pass --exclude {name} (or --skip-unsupported) to keep it in full precision"
            )
        if isinstance(record, Fp8Layer) and options.activation_scales == "dynamic":
            record = dataclasses.replace(record, input_scales="dynamic")
        if isinstance(record, Int4Layer):
            record = dataclasses.replace(record, asymmetric=options.asymmetric)
        plan[name] = record
    return plan
