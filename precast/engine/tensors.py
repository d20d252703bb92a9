"""The engine's canonical tensor table: every tensor's name, shape and dtype, per layer and per format.

Canonical names and layouts (row-major, `out x in` for matrices, as HF stores them):

    embed.weight                      [vocab, hidden]
    layers.{i}.attn_norm.weight       [hidden]
    layers.{i}.attn.qkv.weight        [q + 2 kv, hidden]     rows: q heads | k heads | v heads
    layers.{i}.attn.qkv.bias          [q + 2 kv]             (qkv_bias)
    layers.{i}.attn.q_norm.weight     [head_dim]             (qk_norm)
    layers.{i}.attn.k_norm.weight     [head_dim]             (qk_norm)
    layers.{i}.attn.o.weight          [hidden, q]
    layers.{i}.post_attn_norm.weight  [hidden]               (sandwich_norms)
    layers.{i}.mlp_norm.weight        [hidden]
    layers.{i}.mlp.gate_up.weight     [2 x intermediate, hidden]   rows: gate | up
    layers.{i}.mlp.down.weight        [hidden, intermediate]
    layers.{i}.post_mlp_norm.weight   [hidden]               (sandwich_norms)
  in the layers of spec.moe_layers, instead of mlp.gate_up / mlp.down (mi: moe_intermediate_size, si: the shared
  expert's; e: 0 .. num_experts - 1):
    layers.{i}.moe.router.weight             [num_experts, hidden]   never quantized
    layers.{i}.moe.experts.{e}.gate_up.weight [2 x mi, hidden]       rows: gate | up
    layers.{i}.moe.experts.{e}.down.weight   [hidden, mi]
    layers.{i}.moe.shared.gate_up.weight     [2 x si, hidden]        (shared expert)
    layers.{i}.moe.shared.down.weight        [hidden, si]            (shared expert)
    layers.{i}.moe.shared_gate.weight        [1, hidden]             (shared expert) never quantized
    final_norm.weight                 [hidden]
    lm_head.weight                    [vocab, hidden]        (absent when tied to embed.weight)

q = num_heads x head_dim, kv = num_kv_heads x head_dim. Fusing q|k|v and gate|up lets
every backend run one matmul where HF runs three (or two), reading the input once.

Matrices are stored in the engine dtype, 1-D tensors (norms, biases) in float32. A quantized
layer (engine/quant.py) replaces its `{layer}.weight` with the tensors its format stores.
"Layers" are the linear layers, named by their weight without ".weight" (`layers.3.mlp.down`,
`layers.3.moe.experts.7.gate_up`; the head is `lm_head`, or `embed` when tied); a mixture's router and shared-expert
gate are not among them (they stay in the engine dtype: routing decisions are not quantized).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from precast.engine.spec import ModelSpec

Shape = tuple[int, ...]
TensorLayout = dict[str, tuple[Shape, str]]  # engine tensor name -> (shape, safetensors dtype)
# The per-layer linear layers of a dense layer, in order; a mixture layer has attn.qkv, attn.o, then its experts'
# gate_up and down in expert order, then the shared expert's (linear_shapes).
LINEAR_KINDS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
_LINEAR_KIND = re.compile(r"attn\.qkv|attn\.o|mlp\.(gate_up|down)|moe\.experts\.\d+\.(gate_up|down)|moe\.shared\.(gate_up|down)")


def is_linear_kind(kind: str) -> bool:
    """Whether a layer's tensor stem (`attn.qkv`, `moe.experts.3.down`, ...) is a linear layer."""
    return _LINEAR_KIND.fullmatch(kind) is not None


class EngineTensor(NamedTuple):
    name: str  # concrete: layers.3.moe.experts.7.down.weight
    template: str  # layers.{i}.moe.experts.{e}.down.weight
    layer: int | None
    expert: int | None


def engine_layout(spec: ModelSpec) -> dict[str, tuple[Shape, ...]]:
    """Canonical name template -> the shapes of the parts concatenated (along dim 0) into it."""
    h, q, kv, d, inter = spec.hidden_size, spec.q_size, spec.kv_size, spec.head_dim, spec.intermediate_size
    layout: dict[str, tuple[Shape, ...]] = {"embed.weight": ((spec.vocab_size, h),)}
    layout["layers.{i}.attn_norm.weight"] = ((h,),)
    layout["layers.{i}.attn.qkv.weight"] = ((q, h), (kv, h), (kv, h))
    if spec.qkv_bias:
        layout["layers.{i}.attn.qkv.bias"] = ((q,), (kv,), (kv,))
    if spec.qk_norm:
        layout["layers.{i}.attn.q_norm.weight"] = ((d,),)
        layout["layers.{i}.attn.k_norm.weight"] = ((d,),)
    layout["layers.{i}.attn.o.weight"] = ((h, q),)
    if spec.sandwich_norms:
        layout["layers.{i}.post_attn_norm.weight"] = ((h,),)
    layout["layers.{i}.mlp_norm.weight"] = ((h,),)
    if len(spec.moe_layers) < spec.num_layers:
        layout["layers.{i}.mlp.gate_up.weight"] = ((inter, h), (inter, h))
        layout["layers.{i}.mlp.down.weight"] = ((h, inter),)
    if spec.num_experts:
        mi, si = spec.moe_intermediate_size, spec.shared_expert_intermediate_size
        layout["layers.{i}.moe.router.weight"] = ((spec.num_experts, h),)
        layout["layers.{i}.moe.experts.{e}.gate_up.weight"] = ((mi, h), (mi, h))
        layout["layers.{i}.moe.experts.{e}.down.weight"] = ((h, mi),)
        if si:
            layout["layers.{i}.moe.shared.gate_up.weight"] = ((si, h), (si, h))
            layout["layers.{i}.moe.shared.down.weight"] = ((h, si),)
            layout["layers.{i}.moe.shared_gate.weight"] = ((1, h),)
    if spec.sandwich_norms:
        layout["layers.{i}.post_mlp_norm.weight"] = ((h,),)
    layout["final_norm.weight"] = ((h,),)
    if not spec.tie_word_embeddings:
        layout["lm_head.weight"] = ((spec.vocab_size, h),)
    return layout


def full_shape(parts: tuple[Shape, ...]) -> Shape:
    """The shape of parts concatenated along dim 0."""
    return (sum(p[0] for p in parts), *parts[0][1:])


def _in_layer(spec: ModelSpec, template: str, layer: int) -> bool:
    """A mixture layer has moe.* tensors and no mlp.gate_up / mlp.down; a dense layer the reverse."""
    if template.startswith("layers.{i}.moe."):
        return spec.is_moe_layer(layer)
    if template.startswith("layers.{i}.mlp."):
        return not spec.is_moe_layer(layer)
    return True


def tensor_names(spec: ModelSpec) -> list[EngineTensor]:
    """Every engine tensor in file order: embedding, layer 0's tensors (experts in order), layer 1's, ..., head."""
    layout = engine_layout(spec)
    per_layer = [t for t in layout if "{i}" in t]
    names = [EngineTensor("embed.weight", "embed.weight", None, None)]
    for i in range(spec.num_layers):
        for t in per_layer:
            if not _in_layer(spec, t, i):
                continue
            experts = range(spec.num_experts) if "{e}" in t else (None,)
            names += [EngineTensor(t.format(i=i, e=e), t, i, e) for e in experts]
    names += [EngineTensor(t, t, None, None) for t in layout if "{i}" not in t and t != "embed.weight"]
    return names


def engine_tensor_shapes(spec: ModelSpec) -> dict[str, Shape]:
    """Every concrete engine tensor name with its full shape, in build order."""
    layout = engine_layout(spec)
    return {t.name: full_shape(layout[t.template]) for t in tensor_names(spec)}


def head_name(spec: ModelSpec) -> str:
    """The LM head's layer name: the embedding itself when tied."""
    return "embed" if spec.tie_word_embeddings else "lm_head"


def layer_linear_kinds(spec: ModelSpec, layer: int) -> list[str]:
    """The linear layers of decoder layer `layer`, in execution order (names without `layers.{i}.`)."""
    if not spec.is_moe_layer(layer):
        return list(LINEAR_KINDS)
    kinds = ["attn.qkv", "attn.o"]
    kinds += [f"moe.experts.{e}.{part}" for e in range(spec.num_experts) for part in ("gate_up", "down")]
    if spec.shared_expert_intermediate_size:
        kinds += ["moe.shared.gate_up", "moe.shared.down"]
    return kinds


def linear_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """Every linear layer (layer name -> (out, in)), per layer in execution order, head last."""
    shapes = engine_tensor_shapes(spec)
    out: dict[str, tuple[int, int]] = {}
    for i in range(spec.num_layers):
        for kind in layer_linear_kinds(spec, i):
            rows, cols = shapes[f"layers.{i}.{kind}.weight"]
            out[f"layers.{i}.{kind}"] = (rows, cols)
    rows, cols = shapes[f"{head_name(spec)}.weight"]
    out[head_name(spec)] = (rows, cols)
    return out
