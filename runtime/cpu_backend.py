"""The CPU backend: an engine's weights loaded into precast._C.CpuRunner."""

from __future__ import annotations

import os

import numpy as np

from precast import _C
from precast.builder.engine import Engine
from precast.builder.rope import rope_parameters
from precast.quantization.formats import NVFP4_BLOCK
from precast.quantization.recipe import linear_shapes

_WEIGHT_DTYPES = {"float32": _C.WeightDtype.F32, "bfloat16": _C.WeightDtype.BF16, "float16": _C.WeightDtype.F16}


def default_num_threads() -> int:
    """One thread per core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def make_cpu_runner(engine: Engine, num_threads: int | None = None, quantize_activations: bool = True) -> _C.CpuRunner:
    """The engine on the CPU runner. quantize_activations=False runs fp8 / nvfp4 layers weight-only: a
    diagnostic (benchmarks/quality.py --weights-only) that is not the recipe; serving never sets it."""
    spec = engine.config.model
    inv_freq, attention_factor = rope_parameters(spec)
    c = _C.CpuModelConfig()
    c.vocab_size = spec.vocab_size
    c.hidden_size = spec.hidden_size
    c.intermediate_size = spec.intermediate_size
    c.num_layers = spec.num_layers
    c.num_heads = spec.num_heads
    c.num_kv_heads = spec.num_kv_heads
    c.head_dim = spec.head_dim
    c.norm_eps = spec.norm_eps
    c.qkv_bias = spec.qkv_bias
    c.qk_norm = spec.qk_norm
    c.sliding_window = spec.sliding_window or 0
    c.sliding_window_layers = list(spec.sliding_window_layers)
    c.tie_word_embeddings = spec.tie_word_embeddings
    c.inv_freq = inv_freq.tolist()
    c.attention_factor = attention_factor
    c.dtype = _WEIGHT_DTYPES[engine.config.dtype]
    if engine.config.limits.kv_cache_dtype == "fp8":
        c.kv_fp8 = True
        c.k_scales = engine.config.quant["kv_cache"]["k_scales"]
        c.v_scales = engine.config.quant["kv_cache"]["v_scales"]
    c.num_threads = num_threads or default_num_threads()
    runner = _C.CpuRunner(c)
    layers = engine.config.quant.get("layers", {})
    shapes = linear_shapes(spec)
    for name in engine.weights.tensors:
        if name.endswith(".weight_scale"):
            continue  # read with its weight
        layer = name[: -len(".weight")]
        if layer in layers:
            _set_quantized(runner, engine, layer, layers[layer], shapes[layer], quantize_activations)
            continue
        array = engine.weights.read(name)
        # bfloat16/float16 travel as their raw 16-bit patterns; the kernels widen them.
        raw = array.view(np.uint16) if array.dtype.itemsize == 2 else array
        runner.set_weight(name, np.ascontiguousarray(raw))
    runner.finalize()
    return runner


def _set_quantized(runner: _C.CpuRunner, engine: Engine, layer: str, entry: dict, shape: tuple[int, int],
                   quantize_activations: bool) -> None:
    rows, cols = shape
    values = np.ascontiguousarray(engine.weights.read(f"{layer}.weight").view(np.uint8))
    fmt = entry["format"]
    if fmt == "fp8":
        runner.set_quantized_weight(f"{layer}.weight", _C.WeightDtype.FP8, rows, cols, values, None, 0, entry["weight_scale"],
                                    _C.ActQuant.FP8_STATIC if quantize_activations else _C.ActQuant.NONE, entry["input_scale"])
        return
    scales = np.ascontiguousarray(engine.weights.read(f"{layer}.weight_scale"))
    if fmt == "nvfp4":
        runner.set_quantized_weight(f"{layer}.weight", _C.WeightDtype.NVFP4, rows, cols, values, scales.view(np.uint8), NVFP4_BLOCK,
                                    entry["weight_global_scale"], _C.ActQuant.NVFP4_DYNAMIC if quantize_activations else _C.ActQuant.NONE,
                                    entry["input_global_scale"])
    else:  # int4: weight-only (W4A16)
        runner.set_quantized_weight(f"{layer}.weight", _C.WeightDtype.INT4, rows, cols, values, scales, int(entry["group_size"]), 1.0,
                                    _C.ActQuant.NONE, 1.0)
