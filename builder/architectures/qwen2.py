"""Qwen2 / Qwen2.5: biases on q, k and v; optional sliding window on the upper layers."""

from __future__ import annotations

from typing import Any

from precast.builder.architectures.common import (
    DECODER_WEIGHT_NAMES,
    Architecture,
    decoder_spec,
    sliding_layers_from_layer_types,
)
from precast.engine.spec import ModelSpec


def qwen2_spec(config: dict[str, Any]) -> ModelSpec:
    # Released Qwen2 configs carry a sliding_window value even when use_sliding_window is false.
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    window, layers = sliding_layers_from_layer_types(config, window)
    return decoder_spec(config, "qwen2", qkv_bias=True, sliding_window=window, sliding_window_layers=layers)


ARCHITECTURE = Architecture("qwen2", ("Qwen2ForCausalLM",), qwen2_spec, DECODER_WEIGHT_NAMES)
