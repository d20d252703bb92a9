"""What the supported architectures share: config parsing helpers and the HF weight-name table.

An architecture file only says how its HF config maps onto ModelSpec; the weight names
of llama, mistral, qwen2 and qwen3 checkpoints are the same, so they share one table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from precast.engine.spec import ROPE_TYPES, ModelSpec, RopeScaling
from precast.errors import PrecastError

# Canonical engine tensor name -> HF source tensor name(s). Several sources are concatenated
# along dim 0 (q|k|v into one qkv matrix, gate|up into one). `{i}` is the layer index.
# Only the entries the spec's layout asks for are used; every other checkpoint tensor must
# be listed in `ignored` or the build stops (the leftover check).
DECODER_WEIGHT_NAMES: dict[str, tuple[str, ...]] = {
    "embed.weight": ("model.embed_tokens.weight",),
    "final_norm.weight": ("model.norm.weight",),
    "lm_head.weight": ("lm_head.weight",),
    "layers.{i}.attn_norm.weight": ("model.layers.{i}.input_layernorm.weight",),
    "layers.{i}.attn.qkv.weight": (
        "model.layers.{i}.self_attn.q_proj.weight",
        "model.layers.{i}.self_attn.k_proj.weight",
        "model.layers.{i}.self_attn.v_proj.weight",
    ),
    "layers.{i}.attn.qkv.bias": (
        "model.layers.{i}.self_attn.q_proj.bias",
        "model.layers.{i}.self_attn.k_proj.bias",
        "model.layers.{i}.self_attn.v_proj.bias",
    ),
    "layers.{i}.attn.q_norm.weight": ("model.layers.{i}.self_attn.q_norm.weight",),
    "layers.{i}.attn.k_norm.weight": ("model.layers.{i}.self_attn.k_norm.weight",),
    "layers.{i}.attn.o.weight": ("model.layers.{i}.self_attn.o_proj.weight",),
    "layers.{i}.mlp_norm.weight": ("model.layers.{i}.post_attention_layernorm.weight",),
    "layers.{i}.mlp.gate_up.weight": ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    "layers.{i}.mlp.down.weight": ("model.layers.{i}.mlp.down_proj.weight",),
}

# Tensors some checkpoints carry that the model does not need: older exports saved the
# rotary inverse frequencies (recomputed from the config), and tied models sometimes
# save the LM head although it is the embedding matrix.
IGNORED_ALWAYS = ("model.layers.{i}.self_attn.rotary_emb.inv_freq",)
IGNORED_WHEN_TIED = ("lm_head.weight",)


@dataclass(frozen=True)
class Architecture:
    name: str
    hf_classes: tuple[str, ...]  # config.json "architectures"
    to_spec: Callable[[dict[str, Any]], ModelSpec]
    weight_names: dict[str, tuple[str, ...]]
    # Added to every RMSNorm weight when built (Gemma stores w for a norm that multiplies by 1 + w), so every
    # backend runs one kind of norm: x / rms(x) * weight.
    norm_weight_offset: float = 0.0
    # Checkpoints that wrap the decoder in a larger model (Gemma 3's image-text ones): file-name prefixes read as
    # the decoder's own names (first match wins), and prefixes of tensors the decoder never uses (a vision tower).
    renamed_prefixes: tuple[tuple[str, str], ...] = ()
    ignored_prefixes: tuple[str, ...] = ()

    def decoder_name(self, file_name: str) -> str:
        """A checkpoint tensor's name as the weight-name table spells it."""
        for prefix, decoder in self.renamed_prefixes:
            if file_name.startswith(prefix):
                return decoder + file_name[len(prefix) :]
        return file_name


def require(config: dict[str, Any], key: str, arch: str) -> Any:
    if config.get(key) is None:
        raise PrecastError(f"{arch} config.json lacks {key!r}; the checkpoint's config is incomplete")
    return config[key]


def refuse_if(condition: bool, arch: str, what: str) -> None:
    if condition:
        raise PrecastError(f"{arch}: {what} is not supported by precast yet; the build stops rather than build a wrong model")


# HF activation names -> ModelSpec.activation
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def check_activation(config: dict[str, Any], arch: str, key: str = "hidden_act") -> str:
    act = config.get(key, "silu")
    refuse_if(act not in _ACTIVATIONS, arch, f"{key}={act!r} (supported gate activations: {', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[act]


_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "truncate"},
    "longrope": {"factor", "original_max_position_embeddings", "short_factor", "long_factor", "attention_factor"},
}
_ROPE_ALIASES = {"su": "longrope"}  # Phi-3's first configs


def rope_from_config(config: dict[str, Any], arch: str) -> tuple[float, RopeScaling | None]:
    """RoPE theta and scaling from either config style: transformers 5 writes `rope_parameters`
    (theta inside), older configs write `rope_theta` and `rope_scaling`."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta, scaling = params["rope_theta"], dict(params)
    else:
        theta, scaling = config.get("rope_theta", 10000.0), dict(config.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    rope_type = _ROPE_ALIASES.get(rope_type, rope_type)
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    if rope_type not in ROPE_TYPES:
        raise PrecastError(f"{arch}: RoPE scaling type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    scaling.pop("partial_rotary_factor", None)  # read by rotary_dim_from_config
    if rope_type == "longrope":
        return float(theta), _longrope(config, scaling, arch)
    unknown = set(k for k, v in scaling.items() if v is not None) - _ROPE_KEYS[rope_type]
    refuse_if(bool(unknown), arch, f"RoPE {rope_type} parameters {sorted(unknown)}")
    if rope_type == "default":
        return float(theta), None
    if scaling.get("factor") is None:
        raise PrecastError(f"{arch}: RoPE scaling {rope_type!r} needs a 'factor'")
    original = scaling.get("original_max_position_embeddings")
    if rope_type in ("llama3", "yarn") and original is None:
        if rope_type == "llama3":
            raise PrecastError(f"{arch}: llama3 RoPE scaling needs original_max_position_embeddings")
        original = config.get("max_position_embeddings")
    return float(theta), RopeScaling(
        rope_type=rope_type,
        factor=float(scaling["factor"]),
        original_max_position_embeddings=None if original is None else int(original),
        low_freq_factor=_float_or_none(scaling.get("low_freq_factor")),
        high_freq_factor=_float_or_none(scaling.get("high_freq_factor")),
        beta_fast=_float_or_none(scaling.get("beta_fast")) if rope_type == "yarn" else None,
        beta_slow=_float_or_none(scaling.get("beta_slow")) if rope_type == "yarn" else None,
        attention_factor=_float_or_none(scaling.get("attention_factor")),
        truncate=bool(scaling.get("truncate", True)),
    )


def _longrope(config: dict[str, Any], scaling: dict[str, Any], arch: str) -> RopeScaling:
    unknown = set(k for k, v in scaling.items() if v is not None) - _ROPE_KEYS["longrope"]
    refuse_if(bool(unknown), arch, f"RoPE longrope parameters {sorted(unknown)}")
    original = scaling.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
    if original is None:
        raise PrecastError(f"{arch}: longrope RoPE scaling needs original_max_position_embeddings")
    factors = {}
    for key in ("short_factor", "long_factor"):
        if not isinstance(scaling.get(key), list | tuple):
            raise PrecastError(f"{arch}: longrope RoPE scaling needs a {key} list (one value per rotary frequency)")
        factors[key] = tuple(float(v) for v in scaling[key])
    # transformers: without an explicit factor, the ratio of the extended to the original context
    factor = scaling.get("factor") or int(require(config, "max_position_embeddings", arch)) / int(original)
    return RopeScaling(
        rope_type="longrope",
        factor=float(factor),
        original_max_position_embeddings=int(original),
        attention_factor=_float_or_none(scaling.get("attention_factor")),
        **factors,
    )


def rotary_dim_from_config(config: dict[str, Any], head_dim: int, arch: str) -> int:
    """head_dim x partial_rotary_factor (top level, or inside rope_parameters as transformers 5 writes it)."""
    params = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor")) or 1.0
    dim = int(head_dim * float(factor))
    refuse_if(dim % 2 != 0 or dim <= 0, arch, f"partial_rotary_factor={factor} (rotary dimension {dim} must be even and > 0)")
    return dim


def _float_or_none(v: Any) -> float | None:
    return None if v is None else float(v)


def decoder_spec(config: dict[str, Any], arch: str, **overrides: Any) -> ModelSpec:
    """The fields every supported family reads the same way; families pass what differs."""
    hidden = int(require(config, "hidden_size", arch))
    heads = int(require(config, "num_attention_heads", arch))
    head_dim = int(config.get("head_dim") or hidden // heads)
    theta, scaling = rope_from_config(config, arch)
    fields: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=int(require(config, "vocab_size", arch)),
        hidden_size=hidden,
        intermediate_size=int(require(config, "intermediate_size", arch)),
        num_layers=int(require(config, "num_hidden_layers", arch)),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rotary_dim=rotary_dim_from_config(config, head_dim, arch),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        activation=check_activation(config, arch),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(require(config, "max_position_embeddings", arch)),
        qkv_bias=False,
        qk_norm=False,
        sliding_window=None,
        sliding_window_layers=(),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
    fields.update(overrides)
    try:
        return ModelSpec(**fields)
    except ValueError as e:
        raise PrecastError(f"{arch}: inconsistent config: {e}") from e


def sliding_layers_from_layer_types(config: dict[str, Any], window: int | None) -> tuple[int | None, tuple[int, ...]]:
    """Qwen-style per-layer attention kinds: `layer_types` when the config has it, else
    the older rule (layers from `max_window_layers` on use the window)."""
    if window is None:
        return None, ()
    layer_types = config.get("layer_types")
    num_layers = int(config["num_hidden_layers"])
    if layer_types is None:
        start = int(config.get("max_window_layers", num_layers))
        layers = tuple(range(start, num_layers))
    else:
        layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    return (int(window), layers) if layers else (None, ())
