"""The plan that fills each canonical engine tensor (engine/tensors.py) from checkpoint tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from precast.builder.architectures.common import IGNORED_ALWAYS, IGNORED_WHEN_TIED, Architecture
from precast.builder.checkpoint.base import Checkpoint
from precast.engine.rope import rotary_row_order
from precast.engine.spec import ModelSpec
from precast.engine.tensors import Shape, engine_layout, full_shape, tensor_names
from precast.errors import PrecastError

MAX_PROBLEMS_SHOWN = 6


@dataclass(frozen=True)
class PlannedTensor:
    name: str  # canonical engine name
    sources: tuple[str, ...]  # checkpoint tensors, concatenated along dim 0 in this order
    shape: Shape
    # Partial rotary only: row i of the engine tensor is row row_order[i] of the concatenated sources (rope.py).
    row_order: np.ndarray | None = field(default=None, compare=False)
    offset: float = 0.0  # added to every value, in float32 (Gemma's norm weights: Architecture.norm_weight_offset)

    def arrange(self, array: np.ndarray) -> np.ndarray:
        array = array if self.row_order is None else array[self.row_order]
        return array if not self.offset else array.astype(np.float32) + np.float32(self.offset)


def _rotary_rows(spec: ModelSpec, template: str) -> np.ndarray | None:
    """Reorder each q and k head's rows so rotary pairs sit head_dim/2 apart; v and everything else as stored."""
    if spec.rotary_dim == spec.head_dim:
        return None
    head = rotary_row_order(spec.head_dim, spec.rotary_dim)
    if template in ("layers.{i}.attn.q_norm.weight", "layers.{i}.attn.k_norm.weight"):
        return head
    if template not in ("layers.{i}.attn.qkv.weight", "layers.{i}.attn.qkv.bias"):
        return None
    qk_heads = spec.num_heads + spec.num_kv_heads
    rows = (np.arange(qk_heads)[:, None] * spec.head_dim + head[None, :]).reshape(-1)
    return np.concatenate([rows, np.arange(qk_heads * spec.head_dim, spec.q_size + 2 * spec.kv_size)])


def plan_weights(spec: ModelSpec, arch: Architecture, checkpoint: Checkpoint, also_used: set[str] = frozenset()) -> list[PlannedTensor]:
    """Map every engine tensor to its sources, checking names and shapes before any data is read.

    Fails when a needed tensor is missing, has the wrong shape, or when the checkpoint has a
    tensor nothing uses (a sign that the checkpoint is not the model the config describes).
    """
    file_names = {arch.decoder_name(n): n for n in checkpoint.tensor_names()}  # the table's name -> the file's
    available = set(file_names)
    plan: list[PlannedTensor] = []
    used: set[str] = set()
    problems: list[str] = []
    layout = engine_layout(spec)
    for name, template, layer, expert in tensor_names(spec):
        parts = layout[template]
        if template not in arch.weight_names:  # a family whose translator gives no names for it (no MoE there)
            raise PrecastError(f"{arch.name} checkpoints have no tensor for {template}; the spec and the translator disagree")
        sources = tuple(s.format(i=layer, e=expert) for s in arch.weight_names[template])
        if len(sources) == 1 and len(parts) > 1:  # the checkpoint stores the fused tensor (Phi-3's qkv_proj)
            parts = (full_shape(parts),)
        for source, want in zip(sources, parts):
            if source not in available:
                problems.append(f"missing tensor {source} (needed for {name})")
            elif checkpoint.tensor_shape(file_names[source]) != want:
                got = list(checkpoint.tensor_shape(file_names[source]))
                problems.append(f"tensor {source} has shape {got}, the config implies {list(want)}")
        used.update(sources)
        offset = arch.norm_weight_offset if template.endswith("norm.weight") else 0.0
        read_as = tuple(file_names.get(s, s) for s in sources)
        plan.append(PlannedTensor(name, read_as, full_shape(parts), _rotary_rows(spec, template), offset))
    ignored = {s.format(i=i) for s in IGNORED_ALWAYS for i in range(spec.num_layers)}
    if spec.tie_word_embeddings:
        ignored.update(IGNORED_WHEN_TIED)
    # also_used: e.g. a pre-quantized checkpoint's scales; ignored_prefixes: parts of a wrapping model (vision tower)
    unused = sorted(n for n in available - used - ignored - also_used if not n.startswith(arch.ignored_prefixes))
    if unused:
        shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
        problems.append(f"{len(unused)} checkpoint tensor(s) that a {spec.architecture} model with this config does not use: {shown}")
    if problems:
        raise PrecastError(_mismatch_message(checkpoint.path, spec, problems))
    return plan


def _mismatch_message(path: object, spec: ModelSpec, problems: list[str]) -> str:
    """A few lines however many tensors disagree: a wrong config.json makes every layer's tensors wrong."""
    shown = problems[:MAX_PROBLEMS_SHOWN] + (
        [f"... and {len(problems) - MAX_PROBLEMS_SHOWN} more"] if len(problems) > MAX_PROBLEMS_SHOWN else []
    )
    text = f"checkpoint {path} does not match its config ({len(problems)} problem(s)):\n  " + "\n  ".join(shown)
    if sum("has shape" in p for p in problems) > 1:
        text += (
            f"\nThe weights have other sizes than config.json says (hidden_size {spec.hidden_size}, intermediate_size "
            f"{spec.intermediate_size}, {spec.num_heads} heads, {spec.num_kv_heads} KV heads, head_dim {spec.head_dim}, "
            f"vocab_size {spec.vocab_size}): use the config.json that came with these weights."
        )
    return text
