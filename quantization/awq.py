"""AWQ (activation-aware weight quantization) for int4 groups.

Channels whose inputs are large matter more. AWQ scales input channel j of a weight by s_j
before quantizing (w * s) and divides the input by s_j (x / s), which is exact in full
precision and moves quantization error away from the important channels. The scales are
s = mean|x| ** alpha (normalized so that max * min = 1), alpha chosen on a grid to minimise the
error of the layer's output on calibration rows:  || x W^T - (x / s) Q(W s)^T ||^2.

The division by s is folded into whatever produces x, so it costs nothing at run time:
    qkv      <- attn_norm weight          gate_up <- mlp_norm weight
    down     <- the up half of gate_up    o       <- the V rows of qkv (only when every query
                                                      head has its own V head: with grouped
                                                      heads one V channel feeds several o inputs)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from precast.engine.formats import INT4_MAX

GRID = 20


@dataclass(frozen=True)
class AwqScale:
    scale: np.ndarray  # [in] float32; 1 everywhere when alpha = 0 (plain round-to-nearest won)
    alpha: float
    error: float  # output MSE with the chosen scale
    error_rtn: float  # output MSE without scaling (alpha = 0)


def search_scale(weight: np.ndarray, inputs: np.ndarray, mean_abs: np.ndarray, group_size: int) -> AwqScale:
    """Grid search of alpha for one weight [out, in] given sample inputs [n, in]."""
    w = np.asarray(weight, dtype=np.float32)
    x = np.asarray(inputs, dtype=np.float32)
    reference = x @ w.T
    best: AwqScale | None = None
    error_rtn = float("nan")
    for k in range(GRID):
        alpha = k / GRID
        s = np.maximum(mean_abs.astype(np.float32), 1e-4) ** np.float32(alpha)
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        dequantized = int4_round_trip(w * s, group_size) / s
        error = float(np.mean((x @ dequantized.T - reference) ** 2))
        if k == 0:
            error_rtn = error
        if best is None or error < best.error:
            best = AwqScale(s, alpha, error, error_rtn)
    assert best is not None
    return AwqScale(best.scale, best.alpha, best.error, error_rtn)


def fold_targets(layer: int, num_heads: int, num_kv_heads: int) -> dict[str, str | None]:
    """For each linear layer of decoder layer `layer`: what absorbs 1 / s (None: AWQ not applicable)."""
    p = f"layers.{layer}."
    return {
        p + "attn.qkv": p + "attn_norm.weight",
        p + "attn.o": p + "attn.qkv (V rows)" if num_heads == num_kv_heads else None,
        p + "mlp.gate_up": p + "mlp_norm.weight",
        p + "mlp.down": p + "mlp.gate_up (up rows)",
    }


def int4_round_trip(w: np.ndarray, group_size: int) -> np.ndarray:
    """quantize_int4(w, group_size).dequantize() without packing (the search runs it 20 times per layer)."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // group_size, group_size)
    scales = np.abs(groups).max(axis=2, keepdims=True) / INT4_MAX
    safe = np.where(scales > 0, scales, 1.0)
    return (np.clip(np.rint(groups / safe), -8, INT4_MAX) * scales).reshape(rows, cols).astype(np.float32)
