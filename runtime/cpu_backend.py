"""The CPU backend: an engine's weights loaded into precast._C.CpuRunner."""

from __future__ import annotations

import os

import numpy as np

from precast import _C
from precast.engine.directory import Engine
from precast.engine.rope import rope_parameters
from precast.engine.tensors import linear_shapes

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
    if engine.config.quant.kv_cache is not None:
        engine.config.quant.kv_cache.load_cpu(c)
    c.num_threads = num_threads or default_num_threads()
    runner = _C.CpuRunner(c)
    layers = engine.config.quant.layers
    shapes = linear_shapes(spec)
    for name in engine.weights.tensors:
        if name.endswith(".weight_scale"):
            continue  # read with its weight
        layer = name[: -len(".weight")]
        if layer in layers:  # the format loads its own stored tensors
            layers[layer].load_cpu(runner, layer, engine.weights.read, *shapes[layer], quantize_activations)
            continue
        array = engine.weights.read(name)
        # bfloat16/float16 travel as their raw 16-bit patterns; the kernels widen them.
        raw = array.view(np.uint16) if array.dtype.itemsize == 2 else array
        runner.set_weight(name, np.ascontiguousarray(raw))
    runner.finalize()
    return runner
