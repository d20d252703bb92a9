"""Llama (and Llama-shaped models such as SmolLM2): GQA, RMSNorm, SwiGLU, RoPE incl. llama3/linear/yarn scaling."""

from __future__ import annotations

from typing import Any

from precast.builder.architectures.common import DECODER_WEIGHT_NAMES, Architecture, decoder_spec, refuse_if
from precast.engine.spec import ModelSpec


def llama_spec(config: dict[str, Any]) -> ModelSpec:
    # Llama's attention_bias puts biases on q, k, v *and* o; no released Llama uses it.
    refuse_if(bool(config.get("attention_bias")), "llama", "attention_bias=True")
    refuse_if(bool(config.get("mlp_bias")), "llama", "mlp_bias=True")
    refuse_if(config.get("pretraining_tp", 1) not in (1, None), "llama", "pretraining_tp > 1")
    return decoder_spec(config, "llama")


ARCHITECTURE = Architecture("llama", ("LlamaForCausalLM",), llama_spec, DECODER_WEIGHT_NAMES)
