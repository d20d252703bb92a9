"""ModelSpec: the complete, backend-neutral description of a decoder-only transformer.

Every backend (CPU runner, TensorRT lowering) builds the same generic decoder from this
one object. It holds only what a supported, tested architecture uses; a new field comes
with the first architecture that needs it.

The decoder it describes, per layer (pre-norm, residual):

    h = x + post?(o_proj(attention(rope(q_norm?(q)), rope(k_norm?(k)), v)))   q,k,v = qkv(rms_norm(x))
        (rope rotates the first rotary_dim dims of each head; rope.py)
    x = h + post?(down(act(gate(rms_norm(h))) * up(rms_norm(h))))

with x = embedding * embedding_multiplier on entry, then a final RMSNorm, the LM head (the embedding
matrix itself when tied) and optional logit soft-capping. `post?` are the sandwich norms (Gemma 2/3).
In the layers listed in moe_layers the MLP is a mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE):

    p = softmax(router(h')), h' = rms_norm(h); the experts_per_token largest p_e (renormalised to sum 1 when
    moe_renormalize) weight their experts: mlp = sum_e p_e down_e(act(gate_e(h')) * up_e(h'))
    (+ sigmoid(shared_gate(h')) * shared_down(act(shared_gate_proj(h')) * shared_up(h')) with a shared expert)
Attention scores are q.k * attention_scale, soft-capped when attn_logit_softcap is set.
Gemma's RMSNorm multiplies by (1 + w); the builder stores 1 + w, so every norm here is x / rms * w.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
ACTIVATIONS = ("silu", "gelu_tanh")  # the gated MLP's gate activation; gelu_tanh: GELU's tanh approximation (Gemma)


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency scaling scheme, with exactly the parameters its type reads.

    linear: every frequency divided by `factor`.
    llama3: low frequencies divided by `factor`, high ones kept, a smooth ramp between
            (`low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`).
    yarn:   NTK-by-parts interpolation between `beta_fast` and `beta_slow` rotations, and an
            attention scale (`attention_factor`, derived from `factor` when absent).
    longrope (Phi-3, "su"): per-frequency divisors, `short_factor` for engines whose max_seq_len fits in
            `original_max_position_embeddings`, `long_factor` beyond it; attention scale derived from `factor`
            (max_position_embeddings / original) when absent.
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None


_OMITTED_WHEN_DEFAULT = (
    "embedding_multiplier",
    "sandwich_norms",
    "query_scale",
    "attn_logit_softcap",
    "final_logit_softcap",
    "local_rope_theta",
    "num_experts",
    "experts_per_token",
    "moe_intermediate_size",
    "moe_layers",
    "moe_renormalize",
    "shared_expert_intermediate_size",
)


@dataclass(frozen=True)
class ModelSpec:
    architecture: str  # the translator that made it: llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3, mixtral, qwen2_moe, qwen3_moe
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float  # every supported family uses RMSNorm
    activation: str  # gate activation of the gated MLP: one of ACTIVATIONS
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    qkv_bias: bool  # qwen2: q/k/v projections carry biases
    qk_norm: bool  # qwen3: per-head RMSNorm on q and k before RoPE
    sliding_window: int | None  # window size in tokens, for the layers listed below
    sliding_window_layers: tuple[int, ...]  # indices of layers that use the window
    tie_word_embeddings: bool
    # Leading dimensions of each q/k head that RoPE rotates (Phi-4-mini: 3/4 of head_dim); the rest pass through.
    # The builder stores q/k rows so that rotary pairs (j, j + rotary_dim/2) sit at (j, j + head_dim/2): see rope.py.
    rotary_dim: int = 0  # 0: head_dim
    # Gemma: input embeddings scaled by sqrt(hidden_size). transformers multiplies in the weights' dtype, so a
    # backend rounds it to the engine dtype first (embedding_scale below).
    embedding_multiplier: float = 1.0
    sandwich_norms: bool = False  # Gemma 2/3: post_attn_norm / post_mlp_norm on each block's output
    query_scale: float | None = None  # scores scale instead of 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar^-0.5)
    attn_logit_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap), after scaling
    final_logit_softcap: float | None = None  # Gemma 2: logits = cap * tanh(logits / cap)
    # Gemma 3: the sliding-window layers' RoPE base (default RoPE, no scaling); None: every layer uses rope_theta.
    local_rope_theta: float | None = None
    # Mixture of experts (see the module docstring); num_experts = 0: every layer is dense.
    num_experts: int = 0
    experts_per_token: int = 0  # top-k
    moe_intermediate_size: int = 0  # each expert's
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is the mixture (Qwen2-MoE may keep some dense)
    moe_renormalize: bool = False  # the top-k probabilities divided by their sum (Mixtral, most Qwen3-MoE)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert; 0: none

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim must be even and at most head_dim ({self.head_dim}), got {self.rotary_dim}")
        s = self.rope_scaling
        if s is not None and s.rope_type == "longrope":
            for name, factors in (("short_factor", s.short_factor), ("long_factor", s.long_factor)):
                if factors is None or len(factors) != self.rotary_dim // 2:
                    got = "none" if factors is None else len(factors)
                    raise ValueError(f"longrope {name} needs rotary_dim / 2 = {self.rotary_dim // 2} values, got {got}")
        if (self.sliding_window is None) != (len(self.sliding_window_layers) == 0):
            raise ValueError("sliding_window and sliding_window_layers must be set together")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        for name in ("query_scale", "attn_logit_softcap", "final_logit_softcap", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive when set, got {value}")
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts or self.moe_intermediate_size < 1:
                raise ValueError(
                    f"a mixture of {self.num_experts} experts needs 1 <= experts_per_token <= num_experts (got "
                    f"{self.experts_per_token}) and moe_intermediate_size > 0 (got {self.moe_intermediate_size})"
                )
            if not self.moe_layers or not all(0 <= i < self.num_layers for i in self.moe_layers):
                raise ValueError(f"moe_layers must name layers 0..{self.num_layers - 1}, got {list(self.moe_layers)}")
        elif self.moe_layers or self.shared_expert_intermediate_size or self.experts_per_token:
            raise ValueError("moe_layers, experts_per_token and a shared expert need num_experts > 0")
        if not self.embedding_multiplier > 0:
            raise ValueError(f"embedding_multiplier must be positive, got {self.embedding_multiplier}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    def embedding_scale(self, weight_dtype: np.dtype) -> float:
        """embedding_multiplier as transformers applies it to weights of `weight_dtype` (rounded to it); an engine's
        is EngineConfig.embedding_scale."""
        return float(np.asarray(self.embedding_multiplier, np.float32).astype(weight_dtype).astype(np.float32))

    def to_dict(self) -> dict[str, Any]:
        """Every field, except the Gemma and mixture-of-experts ones while they are off: engines of other families
        stay readable by precast versions that predate those fields."""
        data = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if f.name in _OMITTED_WHEN_DEFAULT and data[f.name] == f.default:
                del data[f.name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        fields = {f.name for f in dataclasses.fields(cls)}
        # Engines written before a field existed: rotary_dim rotated all of head_dim; Gemma and MoE fields were off.
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        data = {**defaults, "rotary_dim": data.get("head_dim", 0), **data}
        unknown = set(data) - fields
        missing = fields - set(data)
        if unknown or missing:
            raise ValueError(f"model spec fields do not match: unknown {sorted(unknown)}, missing {sorted(missing)}")
        values = dict(data)
        if values["rope_scaling"] is not None:
            rope = dict(values["rope_scaling"])
            for key in ("short_factor", "long_factor"):
                rope[key] = None if rope.get(key) is None else tuple(rope[key])
            values["rope_scaling"] = RopeScaling(**rope)
        values["sliding_window_layers"] = tuple(values["sliding_window_layers"])
        values["moe_layers"] = tuple(values["moe_layers"])
        return cls(**values)

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def num_parameters(self, active: bool = False) -> int:
        """Parameters of the model this spec describes (the tied LM head counted once); `active`: those one token
        uses (experts_per_token of each mixture's experts)."""
        h, total = self.hidden_size, 0
        for i in range(self.num_layers):
            layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h  # qkv, o
            layer += (self.q_size + 2 * self.kv_size) if self.qkv_bias else 0
            layer += 2 * self.head_dim if self.qk_norm else 0
            layer += (4 if self.sandwich_norms else 2) * h  # norms
            if self.is_moe_layer(i):
                experts = self.experts_per_token if active else self.num_experts
                layer += self.num_experts * h + experts * 3 * h * self.moe_intermediate_size  # router, experts
                if self.shared_expert_intermediate_size:
                    layer += 3 * h * self.shared_expert_intermediate_size + h  # shared expert and its gate
            else:
                layer += 3 * h * self.intermediate_size  # gate, up, down
            total += layer
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + total + h + head
