"""Phi-3 / Phi-3.5 / Phi-4-mini: q|k|v and gate|up stored fused, LongRoPE ("longrope"/"su") scaling, partial rotary
(Phi-4-mini rotates 3/4 of each head), an optional sliding window on every layer."""

from __future__ import annotations

from typing import Any

from precast.builder.architectures.common import DECODER_WEIGHT_NAMES, Architecture, decoder_spec
from precast.engine.spec import ModelSpec

# The checkpoint's fused tensors are already precast's layout (q rows, then k, then v; gate rows, then up).
PHI3_WEIGHT_NAMES = {
    **DECODER_WEIGHT_NAMES,
    "layers.{i}.attn.qkv.weight": ("model.layers.{i}.self_attn.qkv_proj.weight",),
    "layers.{i}.mlp.gate_up.weight": ("model.layers.{i}.mlp.gate_up_proj.weight",),
}


def phi3_spec(config: dict[str, Any]) -> ModelSpec:
    window = config.get("sliding_window")
    num_layers = int(config.get("num_hidden_layers", 0))
    return decoder_spec(
        config,
        "phi3",
        sliding_window=int(window) if window else None,
        sliding_window_layers=tuple(range(num_layers)) if window else (),
    )


ARCHITECTURE = Architecture("phi3", ("Phi3ForCausalLM",), phi3_spec, PHI3_WEIGHT_NAMES)
