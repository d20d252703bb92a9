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
    final_norm.weight                 [hidden]
    lm_head.weight                    [vocab, hidden]        (absent when tied to embed.weight)

q = num_heads x head_dim, kv = num_kv_heads x head_dim. Fusing q|k|v and gate|up lets
every backend run one matmul where HF runs three (or two), reading the input once.

Matrices are stored in the engine dtype, 1-D tensors (norms, biases) in float32. A quantized
layer (engine/quant.py) replaces its `{layer}.weight` with the tensors its format stores.
"Layers" are the linear layers, named by their weight without ".weight" (`layers.3.mlp.down`;
the head is `lm_head`, or `embed` when tied).
"""

from __future__ import annotations

from precast.engine.spec import ModelSpec

Shape = tuple[int, ...]
TensorLayout = dict[str, tuple[Shape, str]]  # engine tensor name -> (shape, safetensors dtype)
LINEAR_KINDS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")  # the per-layer linear layers, in order


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
    layout["layers.{i}.mlp.gate_up.weight"] = ((inter, h), (inter, h))
    layout["layers.{i}.mlp.down.weight"] = ((h, inter),)
    if spec.sandwich_norms:
        layout["layers.{i}.post_mlp_norm.weight"] = ((h,),)
    layout["final_norm.weight"] = ((h,),)
    if not spec.tie_word_embeddings:
        layout["lm_head.weight"] = ((spec.vocab_size, h),)
    return layout


def full_shape(parts: tuple[Shape, ...]) -> Shape:
    """The shape of parts concatenated along dim 0."""
    return (sum(p[0] for p in parts), *parts[0][1:])


def tensor_names(spec: ModelSpec) -> list[tuple[str, str, int | None]]:
    """(name, template, layer index) in file order: embedding, layer 0's tensors, layer 1's, ..., head."""
    layout = engine_layout(spec)
    per_layer = [t for t in layout if "{i}" in t]
    names: list[tuple[str, str, int | None]] = [("embed.weight", "embed.weight", None)]
    names += [(t.format(i=i), t, i) for i in range(spec.num_layers) for t in per_layer]
    names += [(t, t, None) for t in layout if "{i}" not in t and t != "embed.weight"]
    return names


def engine_tensor_shapes(spec: ModelSpec) -> dict[str, Shape]:
    """Every concrete engine tensor name with its full shape, in build order."""
    layout = engine_layout(spec)
    return {name: full_shape(layout[template]) for name, template, _ in tensor_names(spec)}


def head_name(spec: ModelSpec) -> str:
    """The LM head's layer name: the embedding itself when tied."""
    return "embed" if spec.tie_word_embeddings else "lm_head"


def linear_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """Every linear layer (layer name -> (out, in)), per layer in LINEAR_KINDS order, head last."""
    shapes = engine_tensor_shapes(spec)
    out: dict[str, tuple[int, int]] = {}
    for i in range(spec.num_layers):
        for kind in LINEAR_KINDS:
            rows, cols = shapes[f"layers.{i}.{kind}.weight"]
            out[f"layers.{i}.{kind}"] = (rows, cols)
    rows, cols = shapes[f"{head_name(spec)}.weight"]
    out[head_name(spec)] = (rows, cols)
    return out
