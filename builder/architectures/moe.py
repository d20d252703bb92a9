"""Mixture-of-experts families: Mixtral, Qwen2-MoE, Qwen3-MoE.

Each is its dense sibling's attention (Mistral's, Qwen2's with q/k/v biases, Qwen3's with qk-norm) and, in the layers
the config makes sparse, a router over per-expert gated MLPs (ModelSpec's num_experts ...). Routing is what
transformers computes: softmax over every expert's logit in float32, the top experts_per_token probabilities, divided
by their sum when the family renormalises (Mixtral always, Qwen by norm_topk_prob). Qwen2-MoE adds a shared expert
scaled by sigmoid(shared_expert_gate . x). Configs asking for another routing rule (grouped top-k, sigmoid scores,
a routed scaling factor) are refused, not approximated.
"""

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
from precast.errors import PrecastError

# Keys of routing rules other families use; any of them set means a rule precast does not implement.
_OTHER_ROUTING = ("n_group", "topk_group", "topk_method", "scoring_func", "routed_scaling_factor", "num_experts_per_group")


def _experts(config: dict[str, Any], arch: str, count_key: str) -> dict[str, Any]:
    for key in _OTHER_ROUTING:
        value = config.get(key)
        refuse_if(value not in (None, "softmax", "greedy", 1, 1.0), arch, f"routing rule {key}={value!r} (top-k of a softmax only)")
    num_experts = config.get(count_key) or config.get("num_local_experts") or config.get("num_experts")
    if not num_experts:
        raise PrecastError(f"{arch} config.json lacks {count_key!r}; the checkpoint's config is incomplete")
    top_k = config.get("num_experts_per_tok")
    if not top_k:
        raise PrecastError(f"{arch} config.json lacks 'num_experts_per_tok'; the checkpoint's config is incomplete")
    return dict(num_experts=int(num_experts), experts_per_token=int(top_k))


def _sparse_layers(config: dict[str, Any], arch: str) -> tuple[int, ...]:
    """Qwen's rule: layer i is sparse unless listed in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0."""
    n = int(config["num_hidden_layers"])
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or [])
    layers = tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)
    refuse_if(not layers, arch, "a mixture-of-experts config whose every layer is dense (mlp_only_layers / decoder_sparse_step)")
    return layers


def mixtral_spec(config: dict[str, Any]) -> ModelSpec:
    window = config.get("sliding_window")
    n = int(config["num_hidden_layers"])
    return decoder_spec(
        config,
        "mixtral",
        **_experts(config, "mixtral", "num_local_experts"),
        moe_intermediate_size=int(config["intermediate_size"]),
        moe_layers=tuple(range(n)),
        moe_renormalize=True,
        sliding_window=int(window) if window else None,
        sliding_window_layers=tuple(range(n)) if window else (),
    )


def _qwen_moe(config: dict[str, Any], arch: str, **fields: Any) -> ModelSpec:
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    window, layers = sliding_layers_from_layer_types(config, window)
    if not config.get("moe_intermediate_size"):
        raise PrecastError(f"{arch} config.json lacks 'moe_intermediate_size'; the checkpoint's config is incomplete")
    return decoder_spec(
        config,
        arch,
        **_experts(config, arch, "num_experts"),
        moe_intermediate_size=int(config["moe_intermediate_size"]),
        moe_layers=_sparse_layers(config, arch),
        moe_renormalize=bool(config.get("norm_topk_prob", False)),
        sliding_window=window,
        sliding_window_layers=layers,
        **fields,
    )


def qwen2_moe_spec(config: dict[str, Any]) -> ModelSpec:
    shared = int(config.get("shared_expert_intermediate_size") or 0)
    refuse_if(shared == 0, "qwen2_moe", "shared_expert_intermediate_size=0 (Qwen2-MoE checkpoints carry a shared expert)")
    return _qwen_moe(config, "qwen2_moe", qkv_bias=bool(config.get("qkv_bias", True)), shared_expert_intermediate_size=shared)


def qwen3_moe_spec(config: dict[str, Any]) -> ModelSpec:
    refuse_if(bool(config.get("attention_bias")), "qwen3_moe", "attention_bias=True")
    return _qwen_moe(config, "qwen3_moe", qk_norm=True)


def _expert_names(block: str, gate: str, up: str, down: str, router: str) -> dict[str, tuple[str, ...]]:
    p = "model.layers.{i}." + block
    return {
        "layers.{i}.moe.router.weight": (f"{p}.{router}.weight",),
        "layers.{i}.moe.experts.{e}.gate_up.weight": (f"{p}.experts.{{e}}.{gate}.weight", f"{p}.experts.{{e}}.{up}.weight"),
        "layers.{i}.moe.experts.{e}.down.weight": (f"{p}.experts.{{e}}.{down}.weight",),
    }


MIXTRAL_WEIGHT_NAMES = {**DECODER_WEIGHT_NAMES, **_expert_names("block_sparse_moe", "w1", "w3", "w2", "gate")}
QWEN_MOE_WEIGHT_NAMES = {
    **DECODER_WEIGHT_NAMES,
    **_expert_names("mlp", "gate_proj", "up_proj", "down_proj", "gate"),
    "layers.{i}.moe.shared.gate_up.weight": (
        "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
        "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    ),
    "layers.{i}.moe.shared.down.weight": ("model.layers.{i}.mlp.shared_expert.down_proj.weight",),
    "layers.{i}.moe.shared_gate.weight": ("model.layers.{i}.mlp.shared_expert_gate.weight",),
}

MIXTRAL = Architecture("mixtral", ("MixtralForCausalLM",), mixtral_spec, MIXTRAL_WEIGHT_NAMES)
QWEN2_MOE = Architecture("qwen2_moe", ("Qwen2MoeForCausalLM",), qwen2_moe_spec, QWEN_MOE_WEIGHT_NAMES)
QWEN3_MOE = Architecture("qwen3_moe", ("Qwen3MoeForCausalLM",), qwen3_moe_spec, QWEN_MOE_WEIGHT_NAMES)
