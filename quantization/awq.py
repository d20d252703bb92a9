"""AWQ (activation-aware weight quantization) for int4 groups.

Channels whose inputs are large matter more. AWQ scales input channel j of a weight by s_j
before quantizing (w * s) and divides the input by s_j (x / s), which is exact in full
precision and moves quantization error away from the important channels. The scales are
s = mean|x| ** alpha (normalized so that max * min = 1), alpha chosen on a grid to minimise the
error of the layer's output on calibration rows:  || x W^T - (x / s) Q(W s)^T ||^2.

The division by s is folded into whatever produces x, so it costs nothing at run time:
    qkv      <- attn_norm weight          gate_up <- mlp_norm weight (not an expert's: the norm
                                                      also feeds the router and the other experts)
    down     <- the up half of gate_up    o       <- the V rows of qkv (only when every query
               (an expert's: its own)                 head has its own V head: with grouped
                                                      heads one V channel feeds several o inputs)

Then, with the scales folded in, each group's int4 scale is searched (search_group_scales): AWQ's weight clipping,
done per group on the calibration inputs' per-channel energy; nvfp4 block scales get the same search
(search_nvfp4_block_scales).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from precast import _C
from precast.engine.formats import nvfp4_global_scale, quantize_int4
from precast.engine.spec import ModelSpec
from precast.engine.tensors import layer_linear_kinds
from precast.runtime.cpu_backend import default_num_threads

GRID = 20


@dataclass(frozen=True)
class AwqScale:
    scale: np.ndarray  # [in] float32; 1 everywhere when alpha = 0 (plain round-to-nearest won)
    alpha: float
    error: float  # output MSE with the chosen scale
    error_rtn: float  # output MSE without scaling (alpha = 0)


def search_scale(
    weight: np.ndarray,
    inputs: np.ndarray,
    mean_abs: np.ndarray,
    group_size: int,
    num_threads: int | None = None,
    asymmetric: bool = False,
) -> AwqScale:
    """Search of alpha on the grid k / GRID for one weight [out, in] given sample inputs [n, in], its int4 groups
    symmetric or asymmetric (plain scales from the groups' extremes either way).

    Coarse to fine: every COARSE_STEP-th alpha first, then the neighbours of the best of those, 11 evaluations
    instead of 20. On SmolLM2's 90 AWQ layers this picks the full grid's alpha every time (the error is unimodal in
    alpha for 77 of them and nearly so for the rest). The weight is taken ROWS_PER_CHUNK output rows at a time
    (quantization groups lie within a row, so each chunk's round trip is exact as a whole matrix's), which bounds the
    search's temporaries."""
    w = np.ascontiguousarray(weight, dtype=np.float32)
    x = np.asarray(inputs, dtype=np.float32)
    num_threads = num_threads or default_num_threads()
    magnitude = np.maximum(mean_abs.astype(np.float32), 1e-4)

    def scale(k: int) -> np.ndarray:
        s = magnitude ** np.float32(k / GRID)
        return (s / np.sqrt(s.max() * s.min())).astype(np.float32)

    def mse(ks: list[int]) -> dict[int, float]:
        """Output MSE of each alpha k / GRID: sum of squared errors over every chunk of rows."""
        scales = {k: scale(k) for k in ks}
        squared = dict.fromkeys(ks, 0.0)
        for r in range(0, w.shape[0], ROWS_PER_CHUNK):
            chunk = w[r : r + ROWS_PER_CHUNK]
            reference = x @ chunk.T
            for k in ks:
                # int4_round_trip(chunk * s) / s
                dequantized = _C.int4_round_trip_scaled(chunk, scales[k], group_size, num_threads, asymmetric)
                squared[k] += float(np.sum(np.square(x @ dequantized.T - reference), dtype=np.float64))
        return {k: v / (x.shape[0] * w.shape[0]) for k, v in squared.items()}

    errors = mse(list(range(0, GRID, COARSE_STEP)))
    coarse_best = min(errors, key=lambda k: (errors[k], k))
    errors |= mse([k for k in range(coarse_best - COARSE_STEP + 1, coarse_best + COARSE_STEP) if 0 <= k < GRID and k not in errors])
    best = min(errors, key=lambda k: (errors[k], k))  # the first of equals: alpha = 0 (round to nearest) unless scaling helps
    return AwqScale(scale(best), best / GRID, errors[best], errors[0])


def search_group_scales(
    weight: np.ndarray, inputs: np.ndarray, group_size: int, asymmetric: bool = False, num_threads: int | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """AWQ's weight-clipping search, after its scaling: per group of `weight` [out, in], the int4 scale (and, asymmetric,
    offset) that minimises sum_j a_j (w_j - scale q_j - offset)^2 with a_j = mean(x_j^2) over the calibration `inputs`
    [n, in] (what feeds the weight as stored, so AWQ-scaled: x / s). Symmetric: candidates from max|group| / 7 (the
    plain scale, kept on ties) down to half of it (clipping the largest values refines the grid for the rest), each
    refit by weighted least squares for its codes (_C.int4_search_scales). Asymmetric: grids from the plain
    (max - min) / 15 down to half of it, anchored at the min, the max or the middle, each refit in both parameters
    (_C.int4_search_scales_offsets). The weight a_j is per input channel: the full input covariance (the output error's
    exact metric, kept as 8 eigen-directions per group) scored no better on SmolLM2 and made the search about six
    times slower (a one-off experiment, docs/quantization.md).
    Returns scales [out, in / group_size] and offsets (None when symmetric)."""
    w = np.ascontiguousarray(weight, dtype=np.float32)
    importance, threads = _channel_importance(inputs), num_threads or default_num_threads()
    if asymmetric:
        return _C.int4_search_scales_offsets(w, importance, group_size, threads)
    return _C.int4_search_scales(w, importance, group_size, threads), None


def search_nvfp4_block_scales(weight: np.ndarray, inputs: np.ndarray, num_threads: int | None = None) -> np.ndarray:
    """The same search for an nvfp4 weight [out, in]: per block of 16, the E4M3 block scale (the plain
    e4m3(max|block| / (6 x global)), kept on ties, the 6 E4M3 values below it or the one above) that minimises the
    error weighted by each input channel's mean squared calibration input; E2M1's grid (0, 0.5, 1, 1.5, 2, 3, 4, 6)
    is uneven, so a smaller scale often places a block's values better. Returns the scales' values [out, in / 16]."""
    w = np.ascontiguousarray(weight, dtype=np.float32)
    return _C.nvfp4_search_block_scales(w, _channel_importance(inputs), nvfp4_global_scale(w), num_threads or default_num_threads())


def _channel_importance(inputs: np.ndarray) -> np.ndarray:
    """The searches' weight of each input channel: its mean squared value over the calibration rows [n, in]."""
    return np.mean(np.square(np.asarray(inputs, dtype=np.float32), dtype=np.float64), axis=0).astype(np.float32)


COARSE_STEP = 4
ROWS_PER_CHUNK = 1024  # 1024 x 8960 float32 = 37 MB per temporary for a 1.5B model's down projection


def fold_targets(spec: ModelSpec, layer: int) -> dict[str, str | None]:
    """For each linear layer of decoder layer `layer`: what absorbs 1 / s (None: AWQ not applicable)."""
    p = f"layers.{layer}."
    targets = {
        p + "attn.qkv": p + "attn_norm.weight",
        p + "attn.o": p + "attn.qkv (V rows)" if spec.num_heads == spec.num_kv_heads else None,
    }
    for kind in layer_linear_kinds(spec, layer)[2:]:
        if kind == "mlp.gate_up":
            targets[p + kind] = p + "mlp_norm.weight"
        elif kind.endswith("gate_up"):  # a mixture's experts: the norm also feeds the router and the other experts
            targets[p + kind] = None
        else:  # a down projection: the up rows of its own gate_up
            targets[p + kind] = p + kind[: -len("down")] + "gate_up (up rows)"
    return targets


def int4_round_trip(w: np.ndarray, group_size: int, asymmetric: bool = False) -> np.ndarray:
    """quantize_int4(w, group_size, asymmetric=...).dequantize(): the definition _C.int4_round_trip_scaled follows (in
    one pass, with the AWQ scale applied and removed; tests compare the two bit for bit)."""
    return quantize_int4(w, group_size, asymmetric=asymmetric).dequantize()
