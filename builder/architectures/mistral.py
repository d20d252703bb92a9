"""Mistral: Llama's block with a sliding attention window on every layer."""

from __future__ import annotations

from typing import Any

from precast.builder.architectures.common import DECODER_WEIGHT_NAMES, Architecture, decoder_spec
from precast.engine.spec import ModelSpec


def mistral_spec(config: dict[str, Any]) -> ModelSpec:
    window = config.get("sliding_window")
    layers = tuple(range(int(config["num_hidden_layers"]))) if window is not None else ()
    return decoder_spec(config, "mistral", sliding_window=None if window is None else int(window), sliding_window_layers=layers)


ARCHITECTURE = Architecture("mistral", ("MistralForCausalLM",), mistral_spec, DECODER_WEIGHT_NAMES)
