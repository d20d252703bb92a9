"""Gemma 2 and Gemma 3 (text): Gemma's block on the shared decoder.

What differs from Llama, each a ModelSpec field: RMSNorm multiplies by (1 + w) (the builder stores 1 + w), input
embeddings are scaled by sqrt(hidden_size), the gated MLP uses GELU's tanh approximation, every block's output is
normed again before its residual add (sandwich norms: input / post_attention / pre_feedforward / post_feedforward),
scores are scaled by query_pre_attn_scalar^-0.5. Gemma 2 soft-caps attention scores and final logits and alternates
sliding-window and global layers; Gemma 3 instead has qk-norm, five sliding layers per global one and a separate
RoPE base for the sliding layers (rope_local_base_freq, unscaled), the global layers' RoPE possibly scaled.
"""

from __future__ import annotations

from typing import Any

from precast.builder.architectures.common import (
    DECODER_WEIGHT_NAMES,
    Architecture,
    check_activation,
    decoder_spec,
    refuse_if,
    rope_from_config,
)
from precast.engine.spec import ModelSpec
from precast.errors import PrecastError

GEMMA_WEIGHT_NAMES = {
    **DECODER_WEIGHT_NAMES,
    "layers.{i}.post_attn_norm.weight": ("model.layers.{i}.post_attention_layernorm.weight",),
    "layers.{i}.mlp_norm.weight": ("model.layers.{i}.pre_feedforward_layernorm.weight",),
    "layers.{i}.post_mlp_norm.weight": ("model.layers.{i}.post_feedforward_layernorm.weight",),
}


def _common(config: dict[str, Any], arch: str) -> dict[str, Any]:
    """The fields both generations read the same way."""
    refuse_if(bool(config.get("attention_bias")), arch, "attention_bias=True")
    refuse_if(bool(config.get("use_bidirectional_attention")), arch, "use_bidirectional_attention=True (an encoder, not a decoder)")
    # Defaults are transformers' for a key the config.json leaves out.
    window = config.get("sliding_window", 4096)
    layer_types = config.get("layer_types") or []
    num_layers = int(config.get("num_hidden_layers", 0))
    if layer_types and len(layer_types) != num_layers:
        raise PrecastError(f"{arch}: layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    refuse_if(bool(unknown), arch, f"layer_types {unknown}")
    sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention") if window else ()
    scalar = config.get("query_pre_attn_scalar", 256)
    return dict(
        activation=check_activation(config, arch, "hidden_activation"),
        embedding_multiplier=float(int(config["hidden_size"]) ** 0.5),
        sandwich_norms=True,
        query_scale=None if scalar is None else float(scalar) ** -0.5,
        sliding_window=int(window) if sliding else None,
        sliding_window_layers=sliding,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
    )


def _layer_types(config: dict[str, Any], pattern: int) -> dict[str, Any]:
    """Configs written before transformers 5 give a pattern instead of layer_types: every `pattern`-th layer is global."""
    if config.get("layer_types"):
        return config
    n = int(config.get("num_hidden_layers", 0))
    return dict(config, layer_types=["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)])


def gemma2_spec(config: dict[str, Any]) -> ModelSpec:
    config = _layer_types(config, 2)
    fields = _common(config, "gemma2")
    attn_cap, final_cap = config.get("attn_logit_softcapping", 50.0), config.get("final_logit_softcapping", 30.0)
    return decoder_spec(
        config,
        "gemma2",
        **fields,
        attn_logit_softcap=None if attn_cap is None else float(attn_cap),
        final_logit_softcap=None if final_cap is None else float(final_cap),
    )


def gemma3_spec(config: dict[str, Any]) -> ModelSpec:
    config = _layer_types(config, int(config.get("sliding_window_pattern", 6)))
    fields = _common(config, "gemma3")
    refuse_if(config.get("attn_logit_softcapping") is not None, "gemma3", "attn_logit_softcapping")
    final_cap = config.get("final_logit_softcapping")
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # transformers 5: one RoPE per layer type
        global_rope = dict(config, rope_parameters=params["full_attention"])
        local = dict(params.get("sliding_attention") or {})
    else:  # older configs: rope_theta + rope_scaling for the global layers, rope_local_base_freq for the others
        global_rope = dict(config, rope_theta=config.get("rope_theta", 1_000_000.0))
        local = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10_000.0)}
    local_type = local.get("rope_type", "default")
    refuse_if(local_type != "default", "gemma3", f"RoPE scaling {local_type!r} on the sliding-window layers")
    theta, scaling = rope_from_config(global_rope, "gemma3")
    return decoder_spec(
        {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")},
        "gemma3",
        **fields,
        qk_norm=True,
        rope_theta=theta,
        rope_scaling=scaling,
        local_rope_theta=float(local.get("rope_theta", 10_000.0)),
        final_logit_softcap=None if final_cap is None else float(final_cap),
    )


GEMMA2 = Architecture("gemma2", ("Gemma2ForCausalLM",), gemma2_spec, GEMMA_WEIGHT_NAMES, norm_weight_offset=1.0)
GEMMA3 = Architecture("gemma3", ("Gemma3ForCausalLM",), gemma3_spec, GEMMA_WEIGHT_NAMES, norm_weight_offset=1.0)
