"""The engine's canonical tensors, and the plan that fills each from checkpoint tensors.

Canonical names and layouts (row-major, `out x in` for matrices, as HF stores them):

    embed.weight                      [vocab, hidden]
    layers.{i}.attn_norm.weight       [hidden]
    layers.{i}.attn.qkv.weight        [q + 2 kv, hidden]     rows: q heads | k heads | v heads
    layers.{i}.attn.qkv.bias          [q + 2 kv]             (qkv_bias)
    layers.{i}.attn.q_norm.weight     [head_dim]             (qk_norm)
    layers.{i}.attn.k_norm.weight     [head_dim]             (qk_norm)
    layers.{i}.attn.o.weight          [hidden, q]
    layers.{i}.mlp_norm.weight        [hidden]
    layers.{i}.mlp.gate_up.weight     [2 x intermediate, hidden]   rows: gate | up
    layers.{i}.mlp.down.weight        [hidden, intermediate]
    final_norm.weight                 [hidden]
    lm_head.weight                    [vocab, hidden]        (absent when tied to embed.weight)

q = num_heads x head_dim, kv = num_kv_heads x head_dim. Fusing q|k|v and gate|up lets
every backend run one matmul where HF runs three (or two), reading the input once.
"""

from __future__ import annotations

from dataclasses import dataclass

from precast.builder.architectures.common import IGNORED_ALWAYS, IGNORED_WHEN_TIED, Architecture
from precast.builder.checkpoint.base import Checkpoint
from precast.builder.spec import ModelSpec
from precast.errors import PrecastError

Shape = tuple[int, ...]


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
    layout["layers.{i}.mlp_norm.weight"] = ((h,),)
    layout["layers.{i}.mlp.gate_up.weight"] = ((inter, h), (inter, h))
    layout["layers.{i}.mlp.down.weight"] = ((h, inter),)
    layout["final_norm.weight"] = ((h,),)
    if not spec.tie_word_embeddings:
        layout["lm_head.weight"] = ((spec.vocab_size, h),)
    return layout


def engine_tensor_shapes(spec: ModelSpec) -> dict[str, Shape]:
    """Every concrete engine tensor name with its full shape, in build order."""
    layout = engine_layout(spec)
    return {name: _full_shape(layout[template]) for name, template, _ in _names(spec, layout)}


@dataclass(frozen=True)
class PlannedTensor:
    name: str  # canonical engine name
    sources: tuple[str, ...]  # checkpoint tensors, concatenated along dim 0 in this order
    shape: Shape


def plan_weights(spec: ModelSpec, arch: Architecture, checkpoint: Checkpoint, also_used: set[str] = frozenset()) -> list[PlannedTensor]:
    """Map every engine tensor to its sources, checking names and shapes before any data is read.

    Fails when a needed tensor is missing, has the wrong shape, or when the checkpoint has a
    tensor nothing uses (a sign that the checkpoint is not the model the config describes).
    """
    available = set(checkpoint.tensor_names())
    plan: list[PlannedTensor] = []
    used: set[str] = set()
    problems: list[str] = []
    layout = engine_layout(spec)
    for name, template, layer in _names(spec, layout):
        parts = layout[template]
        sources = tuple(s.format(i=layer) for s in arch.weight_names[template])
        for source, want in zip(sources, parts):
            if source not in available:
                problems.append(f"missing tensor {source} (needed for {name})")
            elif checkpoint.tensor_shape(source) != want:
                got = list(checkpoint.tensor_shape(source))
                problems.append(f"tensor {source} has shape {got}, the config implies {list(want)}")
        used.update(sources)
        plan.append(PlannedTensor(name, sources, _full_shape(parts)))
    ignored = {s.format(i=i) for s in IGNORED_ALWAYS for i in range(spec.num_layers)}
    if spec.tie_word_embeddings:
        ignored.update(IGNORED_WHEN_TIED)
    unused = sorted(available - used - ignored - also_used)  # also_used: e.g. a pre-quantized checkpoint's scales
    if unused:
        shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
        problems.append(f"{len(unused)} checkpoint tensor(s) that a {spec.architecture} model with this config does not use: {shown}")
    if problems:
        raise PrecastError(f"checkpoint {checkpoint.path} does not match its config:\n  " + "\n  ".join(problems))
    return plan


def _full_shape(parts: tuple[Shape, ...]) -> Shape:
    return (sum(p[0] for p in parts), *parts[0][1:])


def _names(spec: ModelSpec, layout: dict[str, tuple[Shape, ...]]) -> list[tuple[str, str, int | None]]:
    """(name, template, layer) in file order: embedding, layer 0's tensors, layer 1's, ..., head."""
    per_layer = [t for t in layout if "{i}" in t]
    names = [(t, t, None) for t in layout if "{i}" not in t and t == "embed.weight"]
    names += [(t.format(i=i), t, i) for i in range(spec.num_layers) for t in per_layer]
    names += [(t, t, None) for t in layout if "{i}" not in t and t != "embed.weight"]
    return names
