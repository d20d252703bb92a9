"""RoPE frequencies from a ModelSpec: every backend gets the same inverse frequencies.

Rotary embedding rotates each pair (x[j], x[j + head_dim/2]) of a head by the angle
position * inv_freq[j]. Scaling schemes only change inv_freq (and, for yarn, scale the
rotated q/k by `attention_factor`), so a backend needs just these two values.
"""

from __future__ import annotations

import math

import numpy as np

from precast.engine.spec import ModelSpec


def rope_parameters(spec: ModelSpec) -> tuple[np.ndarray, float]:
    """(inv_freq as float32 [head_dim // 2], attention_factor) for this model.

    Computed in float64 and rounded once, so they can differ from float32 reference code
    by an ulp (tested to 1e-6 relative).
    """
    dim = spec.head_dim
    base = spec.rope_theta
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    s = spec.rope_scaling
    if s is None:
        return inv_freq.astype(np.float32), 1.0
    if s.rope_type == "linear":
        return (inv_freq / s.factor).astype(np.float32), 1.0
    if s.rope_type == "llama3":
        return _llama3(inv_freq, s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings), 1.0
    if s.rope_type == "yarn":
        return _yarn(spec, inv_freq)
    raise ValueError(f"unknown rope type {s.rope_type}")


def _llama3(inv_freq: np.ndarray, factor: float, low: float | None, high: float | None, original: int | None) -> np.ndarray:
    """Wavelengths longer than original/low are divided by factor, shorter than original/high kept,
    and the band between blends the two linearly in original/wavelength."""
    assert low is not None and high is not None and original is not None
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def _yarn(spec: ModelSpec, inv_freq: np.ndarray) -> tuple[np.ndarray, float]:
    """NTK-by-parts: dimensions rotating fewer than beta_slow times over the original context are
    interpolated (divided by factor), those rotating more than beta_fast times are kept, a linear
    ramp in between. The attention factor defaults to 0.1 ln(factor) + 1."""
    s = spec.rope_scaling
    assert s is not None and s.original_max_position_embeddings is not None
    dim, base, factor = spec.head_dim, spec.rope_theta, s.factor
    beta_fast = s.beta_fast or 32.0
    beta_slow = s.beta_slow or 1.0

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    blended = (inv_freq / factor) * (1 - keep) + inv_freq * keep
    attention = s.attention_factor if s.attention_factor is not None else (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return blended.astype(np.float32), float(attention)
