"""The CPU backend: an engine's weights loaded into precast._C.CpuRunner."""

from __future__ import annotations

import os

import numpy as np

from precast import _C
from precast.engine.directory import Engine
from precast.engine.quant import SIDE_TENSOR_SUFFIXES
from precast.engine.rope import has_local_rope, rope_parameters
from precast.engine.tensors import linear_shapes
from precast.errors import PrecastError
from precast.runtime.precision import check_matmul_precision

_WEIGHT_DTYPES = {"float32": _C.WeightDtype.F32, "bfloat16": _C.WeightDtype.BF16, "float16": _C.WeightDtype.F16}
_ACTIVATIONS = {"silu": _C.Activation.SILU, "gelu_tanh": _C.Activation.GELU_TANH}


def default_num_threads() -> int:
    """One thread per core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def make_cpu_runner(
    engine: Engine,
    num_threads: int | None = None,
    quantize_activations: bool = True,
    layers: range | None = None,
    matmul_precision: str = "weights",
) -> _C.CpuRunner:
    """The engine on the CPU runner, its matrices multiplied at `matmul_precision` (runtime/precision.py).
    quantize_activations=False runs fp8 / nvfp4 layers weight-only: a
    diagnostic (benchmarks/quality.py --weights-only) that is not the recipe; serving never sets it.

    `layers` loads only those decoder layers (and the final norm with the last one) into a layers_only
    runner, whose evaluate_hidden runs hidden states through them: calibration's layer-at-a-time pass."""
    spec = engine.config.model
    if layers is not None and not (layers.step == 1 and 0 <= layers.start < layers.stop <= spec.num_layers):
        raise ValueError(f"layers must be a non-empty range within 0..{spec.num_layers}, got {layers}")
    inv_freq, attention_factor = rope_parameters(spec, engine.config.limits.max_seq_len)
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
    c.rotary_dim = spec.rotary_dim
    c.attention_factor = attention_factor
    if has_local_rope(spec):
        local_inv_freq, c.local_attention_factor = rope_parameters(spec, engine.config.limits.max_seq_len, local=True)
        c.local_inv_freq = local_inv_freq.tolist()
    c.activation = _ACTIVATIONS[spec.activation]
    c.embedding_scale = engine.config.embedding_scale
    c.sandwich_norms = spec.sandwich_norms
    c.attention_scale = spec.attention_scale
    c.attn_logit_softcap = spec.attn_logit_softcap or 0.0
    c.final_logit_softcap = spec.final_logit_softcap or 0.0
    c.num_experts, c.experts_per_token, c.moe_intermediate_size = spec.num_experts, spec.experts_per_token, spec.moe_intermediate_size
    c.moe_layers, c.moe_renormalize = list(spec.moe_layers), spec.moe_renormalize
    c.shared_expert_intermediate_size = spec.shared_expert_intermediate_size
    c.dtype = _WEIGHT_DTYPES[engine.config.dtype]
    if engine.config.quant.kv_cache is not None:
        engine.config.quant.kv_cache.load_cpu(c)
    c.num_threads = num_threads or default_num_threads()
    c.float32_matmuls = check_matmul_precision(matmul_precision) == "float32"
    loaded: tuple[str, ...] = ("",)  # name prefixes of the tensors to load: all of them
    if layers is not None:
        c.layers_only, c.first_layer, c.num_layers = True, layers.start, len(layers)
        if c.kv_fp8:
            c.k_scales, c.v_scales = c.k_scales[layers.start : layers.stop], c.v_scales[layers.start : layers.stop]
        loaded = tuple(f"layers.{i}." for i in layers) + (("final_norm.",) if layers.stop == spec.num_layers else ())
    runner = _C.CpuRunner(c)
    quantized = engine.config.quant.layers
    shapes = linear_shapes(spec)
    for name in engine.weights.tensors:
        if name.endswith(SIDE_TENSOR_SUFFIXES) or not name.startswith(loaded):
            continue  # a scale is read with its weight
        layer = name[: -len(".weight")]
        if layer in quantized:  # the format loads its own stored tensors
            quantized[layer].load_cpu(runner, layer, engine.weights.read, *shapes[layer], quantize_activations)
            continue
        array = engine.weights.read(name)
        # bfloat16/float16 travel as their raw 16-bit patterns; the kernels widen them.
        raw = array.view(np.uint16) if array.dtype.itemsize == 2 else array
        try:
            runner.set_weight(name, np.ascontiguousarray(raw))
        except ValueError as e:  # NaN / Inf or a size the config does not give
            raise PrecastError(f"engine {engine.path}: {e}") from e
    runner.finalize()
    return runner
