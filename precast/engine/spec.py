"""ModelSpec: the complete, backend-neutral description of a decoder-only transformer.

Every backend (CPU runner, TensorRT lowering) builds the same generic decoder from this
one object. It holds only what a supported, tested architecture uses; a new field comes
with the first architecture that needs it.

The decoder it describes, per layer (pre-norm, residual):

    h = x + o_proj(attention(rope(q_norm?(q)), rope(k_norm?(k)), v))   q,k,v = qkv(rms_norm(x))
        (rope rotates the first rotary_dim dims of each head; rope.py)
    x = h + down(silu(gate(rms_norm(h))) * up(rms_norm(h)))

then a final RMSNorm and the LM head (the embedding matrix itself when tied).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


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


@dataclass(frozen=True)
class ModelSpec:
    architecture: str  # the translator that made it: llama, mistral, qwen2, qwen3, phi3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float  # every supported family uses RMSNorm
    activation: str  # gate activation of the gated MLP; "silu" in every supported family
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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        fields = {f.name for f in dataclasses.fields(cls)}
        data = {"rotary_dim": data.get("head_dim", 0), **data}  # engines written before rotary_dim rotate all of head_dim
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
        return cls(**values)

    def num_parameters(self) -> int:
        """Parameters of the model this spec describes (the tied LM head counted once)."""
        h, layer = self.hidden_size, 0
        layer += h * (self.q_size + 2 * self.kv_size) + self.q_size * h  # qkv, o
        layer += (self.q_size + 2 * self.kv_size) if self.qkv_bias else 0
        layer += 2 * self.head_dim if self.qk_norm else 0
        layer += 3 * h * self.intermediate_size + 2 * h  # gate, up, down; two norms
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head
