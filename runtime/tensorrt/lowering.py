"""The decoder, lowered once against the op interface (ops.py): a TensorRT network or a numpy run.

The network runs one step of in-flight batching over `max_batch_size` slots (slot mode: each
running request owns one slot's linear KV-cache region). A step is padded: every slot gets
`step` query rows, its new tokens first and filler after (TensorRT-RTX has no fused kernel for
packed queries, and its attention has no decomposition for them, so queries are padded):

  inputs   input_ids [S, step] int32      each slot's new tokens, then filler (any valid id)
           position_ids [S, step] int64   their positions (filler: any position < cache_len)
           write_indices [S] int32        positions cached per slot before this step
           kv_lengths [S] int32           write_indices + step (see below)
           last_token_ids [N] int32       row (slot * step + its last new token) of each sampled slot
           k_cache.{i}, v_cache.{i}       [S, num_kv_heads, cache_len, head_dim] per layer,
                                          cache_len = max_seq_len + max_num_tokens
  outputs  logits [N, vocab] float32; k_cache_out.{i}, v_cache_out.{i} (in place: the same memory)

Why it is exact: the KV-cache update writes all `step` rows of a slot at write_indices, so new
tokens land at their positions and filler right after them, beyond what is attended yet (later
tokens overwrite it; the extra max_num_tokens positions give it room). Attention's causal mask
anchored lower right lets query row r see keys j <= r + kv_length - step = write_index + r: each
new token sees the cache and the new tokens up to itself, and never the filler.

Per layer: RMSNorm, q/k/v projections (the fused qkv weight split by rows; quantized layers
dequantize their weights and quantize their input, fp8 static or nvfp4 dynamic), optional qkv
bias and q/k RMSNorm, native rotary embedding (sliding-window layers with their own tables where
the spec gives them a RoPE base of their own), Q scaled by the spec's attention scale, native KV-cache
updates, native attention, output projection, (post-norm,) residual, RMSNorm, gated SiLU or
GELU-tanh MLP, (post-norm,) residual. Then the last token of each sampled slot is gathered, normed
and projected to logits (soft-capped where the spec says).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from precast.engine.directory import Engine, EngineConfig
from precast.engine.quant import LayerQuant
from precast.engine.rope import has_local_rope, rope_tables
from precast.engine.spec import ModelSpec
from precast.engine.tensors import head_name
from precast.errors import PrecastError
from precast.runtime.tensorrt.ops import ACTIVATION_DTYPES, Ops

FP8_KV_REFUSAL = (
    "--kv-cache-dtype fp8 cannot be lowered to TensorRT: its KV-cache update layer takes float32/float16/bfloat16 caches "
    "only; build --target tensorrt with --kv-cache-dtype auto (or keep --target cpu for an fp8 KV cache)"
)


@dataclass(frozen=True)
class NetworkShape:
    """Sizes the network is built for (from the engine's build limits)."""

    max_batch_size: int  # slots
    max_seq_len: int
    max_num_tokens: int

    @property
    def cache_len(self) -> int:
        """Positions per slot: a padded step may write up to max_num_tokens rows past a slot's tokens."""
        return self.max_seq_len + self.max_num_tokens

    @classmethod
    def of(cls, config: EngineConfig) -> NetworkShape:
        limits = config.limits
        return cls(limits.max_batch_size, limits.max_seq_len, limits.max_num_tokens)

    def kv_cache_shape(self, spec: ModelSpec) -> tuple[int, int, int, int]:
        """One layer's K (or V) cache, every slot: [slots, num_kv_heads, cache_len, head_dim]."""
        return (self.max_batch_size, spec.num_kv_heads, self.cache_len, spec.head_dim)


def check_supported(config: EngineConfig, act_dtype: str) -> None:
    """What the TensorRT target cannot express, refused before any work (naming the layer and precision)."""
    spec, limits = config.model, config.limits
    if act_dtype not in ACTIVATION_DTYPES:
        raise PrecastError(f"TensorRT activations must be one of {', '.join(ACTIVATION_DTYPES)}, got {act_dtype!r}")
    if limits.kv_cache_dtype == "fp8":
        raise PrecastError(FP8_KV_REFUSAL)
    if spec.num_experts:
        raise PrecastError(
            f"{spec.architecture} is a mixture of experts ({spec.num_experts} experts, top {spec.experts_per_token}); the "
            "TensorRT lowering has no routed-expert layers yet; build it with --target cpu"
        )
    if spec.attn_logit_softcap is not None:
        raise PrecastError(
            f"{spec.architecture} soft-caps attention scores (attn_logit_softcapping={spec.attn_logit_softcap}), which "
            "TensorRT's attention layer cannot express; build this model with --target cpu"
        )
    if spec.sliding_window and spec.sliding_window < limits.max_seq_len:
        raise PrecastError(
            f"layers {list(spec.sliding_window_layers)} use a {spec.sliding_window}-token sliding window, which TensorRT's "
            f"causal attention layer cannot express; build with --max-seq-len {spec.sliding_window} or less for "
            "--target tensorrt (the window then never applies), or use --target cpu"
        )


class DecoderLowering:
    def __init__(self, ops: Ops, engine: Engine, act_dtype: str | None = None):
        self.ops = ops
        self.engine = engine
        self.spec = engine.config.model
        self.act = act_dtype or engine.config.dtype
        self.quant_layers: dict[str, LayerQuant] = engine.config.quant.layers
        self.shape = NetworkShape.of(engine.config)
        self._weights: dict[tuple[str, int, int], Any] = {}
        self._scalars: dict[tuple[float, str, int], Any] = {}

    # --- small helpers on top of the primitives -------------------------------------------------
    def const(self, name: str, values: np.ndarray, dtype: str | None = None) -> Any:
        return self.ops.constant(name, np.asarray(values, dtype=np.float32), dtype or self.act)

    def scalar(self, value: float, dtype: str, rank: int) -> Any:
        """A float constant shaped [1] * rank (TensorRT broadcasts between equal ranks only)."""
        key = (float(value), dtype, rank)
        if key not in self._scalars:
            self._scalars[key] = self.const(f"scalar_{value}", np.full((1,) * rank, value, np.float32), dtype)
        return self._scalars[key]

    def rms_norm(self, x: Any, weight: np.ndarray, name: str) -> Any:
        ops, rank = self.ops, len(x.shape)
        mean_sq = ops.reduce_mean(ops.elementwise("prod", x, x), axis=-1)
        rms = ops.unary("sqrt", ops.elementwise("sum", mean_sq, self.scalar(self.spec.norm_eps, self.act, rank)))
        w = self.const(name, weight.reshape((1,) * (rank - 1) + (-1,)))
        return ops.elementwise("prod", ops.elementwise("div", x, rms), w)

    def soft_cap(self, x: Any, cap: float) -> Any:
        """cap * tanh(x / cap)."""
        rank, ops = len(x.shape), self.ops
        return ops.elementwise(
            "prod", ops.unary("tanh", ops.elementwise("div", x, self.scalar(cap, self.act, rank))), self.scalar(cap, self.act, rank)
        )

    def gated_activation(self, gate: Any, up: Any) -> Any:
        """act(gate) * up; both activations are gate * sigmoid(a): a = gate (silu), a = 2 sqrt(2/pi) (gate +
        0.044715 gate^3) (gelu_tanh: 0.5 (1 + tanh(z)) = sigmoid(2z))."""
        ops, rank = self.ops, len(gate.shape)
        arg = gate
        if self.spec.activation == "gelu_tanh":
            cube = ops.elementwise("prod", ops.elementwise("prod", gate, gate), gate)
            inner = ops.elementwise("sum", gate, ops.elementwise("prod", cube, self.scalar(0.044715, self.act, rank)))
            arg = ops.elementwise("prod", inner, self.scalar(2.0 * math.sqrt(2.0 / math.pi), self.act, rank))
        return ops.elementwise("prod", ops.elementwise("prod", gate, ops.sigmoid(arg)), up)

    def rope_tables(self, local: bool) -> tuple[Any, Any]:
        """cos and sin [cache_len, head_dim / 2] for every position (float32 angles, as the CPU runner)."""
        cos_table, sin_table = rope_tables(self.spec, self.engine.config.limits.max_seq_len, self.shape.cache_len, local=local)
        tag = "rope.local" if local else "rope"
        return self.const(f"{tag}.cos", cos_table), self.const(f"{tag}.sin", sin_table)

    def weight(self, layer: str, rows: slice) -> Any:
        """W[rows] of an engine layer in activation dtype: a constant, or the dequantized stored values
        (made once: a tied embedding serves both the gather and the LM head)."""
        key = (layer, rows.start, rows.stop)
        if key not in self._weights:
            self._weights[key] = self._make_weight(layer, rows)
        return self._weights[key]

    def _make_weight(self, layer: str, rows: slice) -> Any:
        record, tag = self.quant_layers.get(layer), f"{layer}[{rows.start}:{rows.stop}]"
        if record is None:
            return self.const(f"{tag}.weight", self.engine.weights.read(f"{layer}.weight")[rows].astype(np.float32))
        return record.lower_weight(self, layer, rows, tag)  # the format dequantizes its stored tensors

    def quantized_input(self, x: Any, layer: str) -> Any:
        """The layer's input as its recipe quantizes it (fp8 static, nvfp4 dynamic per 16), dequantized."""
        record = self.quant_layers.get(layer)
        return x if record is None else record.lower_input(self, x, layer)

    def linear(self, x: Any, layer: str, row_blocks: list[slice]) -> list[Any]:
        """x @ W[rows].T for each row block of the layer's (possibly fused) weight; the input is
        quantized once and shared by the blocks."""
        xq = self.quantized_input(x, layer)
        return [self.ops.matmul(xq, self.weight(layer, rows), transpose_b=True) for rows in row_blocks]

    # --- the network ------------------------------------------------------------------------------
    def build(self) -> None:
        ops, spec, shape, act = self.ops, self.spec, self.shape, self.act
        H, KVH, D, hidden = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
        S, step = shape.max_batch_size, -1
        input_ids = ops.input("input_ids", "int32", (S, step))
        position_ids = ops.input("position_ids", "int64", (S, step))
        write_indices = ops.input("write_indices", "int32", (S,))
        kv_lengths = ops.input("kv_lengths", "int32", (S,))
        last_token_ids = ops.input("last_token_ids", "int32", (-1,))

        rope = {False: self.rope_tables(local=False)}
        if has_local_rope(spec):
            rope[True] = self.rope_tables(local=True)
        q_scale = self.scalar(spec.attention_scale, act, 4)
        read = self.engine.weights.read

        def heads(t: Any, n: int) -> Any:  # [S * step, n * D] -> [S, n, step, D]
            return ops.transpose(ops.reshape(t, (S, -1, n, D)), (0, 2, 1, 3))

        # The residual stream is 2-D, [S * step, hidden]: every linear layer is one matrix product.
        x = ops.gather(self.weight("embed", slice(0, spec.vocab_size)), ops.reshape(input_ids, (-1,)), axis=0)
        if spec.embedding_multiplier != 1.0:
            x = ops.elementwise("prod", x, self.scalar(self.engine.config.embedding_scale, act, 2))
        q_rows, kv_rows = spec.q_size, spec.kv_size
        for i in range(spec.num_layers):
            p = f"layers.{i}."
            h = self.rms_norm(x, read(p + "attn_norm.weight"), p + "attn_norm")
            parts = {"q": slice(0, q_rows), "k": slice(q_rows, q_rows + kv_rows), "v": slice(q_rows + kv_rows, q_rows + 2 * kv_rows)}
            qkv = dict(zip(parts, self.linear(h, p + "attn.qkv", list(parts.values()))))
            if spec.qkv_bias:
                bias = read(p + "attn.qkv.bias")
                qkv = {n: ops.elementwise("sum", t, self.const(f"{p}attn.{n}.bias", bias[parts[n]][None, :])) for n, t in qkv.items()}
            if spec.qk_norm:  # per head: [rows, n, D] normed over D
                for n, count in (("q", H), ("k", KVH)):
                    normed = self.rms_norm(ops.reshape(qkv[n], (0, count, D)), read(f"{p}attn.{n}_norm.weight"), f"{p}attn.{n}_norm")
                    qkv[n] = ops.reshape(normed, (0, count * D))
            cos, sin = rope[i in spec.sliding_window_layers and has_local_rope(spec)]
            q = ops.elementwise("prod", ops.rotary(heads(qkv["q"], H), cos, sin, position_ids), q_scale)
            new = {"k": ops.rotary(heads(qkv["k"], KVH), cos, sin, position_ids), "v": heads(qkv["v"], KVH)}
            caches = {}
            for kind in ("k", "v"):
                cache = ops.input(f"{kind}_cache.{i}", act, shape.kv_cache_shape(spec))
                caches[kind] = ops.kv_cache_update(cache, new[kind], write_indices)
                ops.output(f"{kind}_cache_out.{i}", caches[kind])
            attn = ops.attention(q, caches["k"], caches["v"], kv_lengths)  # [S, H, step, D]
            attn = ops.reshape(ops.transpose(attn, (0, 2, 1, 3)), (-1, H * D))
            out = self.linear(attn, p + "attn.o", [slice(0, hidden)])[0]
            if spec.sandwich_norms:
                out = self.rms_norm(out, read(p + "post_attn_norm.weight"), p + "post_attn_norm")
            x = ops.elementwise("sum", x, out)
            h = self.rms_norm(x, read(p + "mlp_norm.weight"), p + "mlp_norm")
            inter = spec.intermediate_size
            gate, up = self.linear(h, p + "mlp.gate_up", [slice(0, inter), slice(inter, 2 * inter)])
            out = self.linear(self.gated_activation(gate, up), p + "mlp.down", [slice(0, hidden)])[0]
            if spec.sandwich_norms:
                out = self.rms_norm(out, read(p + "post_mlp_norm.weight"), p + "post_mlp_norm")
            x = ops.elementwise("sum", x, out)

        last = ops.gather(x, last_token_ids, axis=0)  # [N, hidden]
        normed = self.rms_norm(last, read("final_norm.weight"), "final_norm")
        logits = self.linear(normed, head_name(spec), [slice(0, spec.vocab_size)])[0]
        if spec.final_logit_softcap is not None:
            logits = self.soft_cap(logits, spec.final_logit_softcap)
        ops.output("logits", logits if act == "float32" else ops.cast(logits, "float32"))


def lower(ops: Ops, engine: Engine, act_dtype: str | None = None) -> DecoderLowering:
    act = act_dtype or engine.config.dtype
    check_supported(engine.config, act)
    lowering = DecoderLowering(ops, engine, act)
    lowering.build()
    return lowering
