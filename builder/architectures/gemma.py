"""Gemma 2 and Gemma 3 (text): Gemma's block on the shared decoder.

What differs from Llama, each a ModelSpec field: RMSNorm multiplies by (1 + w) (the builder stores 1 + w), input
embeddings are scaled by sqrt(hidden_size), the gated MLP uses GELU's tanh approximation, every block's output is
normed again before its residual add (sandwich norms: input / post_attention / pre_feedforward / post_feedforward),
scores are scaled by query_pre_attn_scalar^-0.5. Gemma 2 soft-caps attention scores and final logits and alternates
sliding-window and global layers; Gemma 3 instead has qk-norm, five sliding layers per global one and a separate
RoPE base for the sliding layers (rope_local_base_freq, unscaled), the global layers' RoPE possibly scaled.

Gemma 3's image-text checkpoints (Gemma3ForConditionalGeneration: 4B and up) hold the same decoder under
`language_model` beside a vision tower and projector; precast builds the decoder (text in, text out) and leaves
the vision half out.
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


# Gemma3TextConfig's defaults (transformers), for the keys an image-text checkpoint's text_config leaves out: the
# hub's configs list only what differs from them (the 4B: hidden, intermediate, layers, RoPE scaling, window).
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
}


def gemma3_image_text_spec(config: dict[str, Any]) -> ModelSpec:
    """Gemma3ForConditionalGeneration: the decoder its text_config describes (Gemma 3's), tied like the whole model."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise PrecastError("Gemma3ForConditionalGeneration config.json lacks text_config; the checkpoint's config is incomplete")
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))  # the whole model's setting rules
    return gemma3_spec(GEMMA3_TEXT_DEFAULTS | text | {"tie_word_embeddings": tied})


GEMMA2 = Architecture("gemma2", ("Gemma2ForCausalLM",), gemma2_spec, GEMMA_WEIGHT_NAMES, norm_weight_offset=1.0)
GEMMA3 = Architecture("gemma3", ("Gemma3ForCausalLM",), gemma3_spec, GEMMA_WEIGHT_NAMES, norm_weight_offset=1.0)
GEMMA3_IMAGE_TEXT = Architecture(
    "gemma3_image_text",
    ("Gemma3ForConditionalGeneration",),
    gemma3_image_text_spec,
    GEMMA_WEIGHT_NAMES,
    norm_weight_offset=1.0,
    # transformers >= 5 saves model.language_model.*; the hub's files (transformers 4.5x) language_model.model.*
    renamed_prefixes=(("model.language_model.", "model."), ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
    ignored_prefixes=("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector."),
)
