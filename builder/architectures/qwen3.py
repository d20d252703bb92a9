"""Qwen3: per-head RMSNorm on q and k (qk-norm), explicit head_dim, no q/k/v biases by default."""

from __future__ import annotations

from typing import Any

from precast.builder.architectures.common import (
    DECODER_WEIGHT_NAMES,
    Architecture,
    decoder_spec,
    refuse_if,
    sliding_layers_from_layer_types,
)
from precast.engine.spec import ModelSpec


def qwen3_spec(config: dict[str, Any]) -> ModelSpec:
    # Qwen3's attention_bias would add an o_proj bias too, which no released Qwen3 has.
    refuse_if(bool(config.get("attention_bias")), "qwen3", "attention_bias=True")
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    window, layers = sliding_layers_from_layer_types(config, window)
    return decoder_spec(config, "qwen3", qk_norm=True, sliding_window=window, sliding_window_layers=layers)


ARCHITECTURE = Architecture("qwen3", ("Qwen3ForCausalLM",), qwen3_spec, DECODER_WEIGHT_NAMES)
