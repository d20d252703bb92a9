"""RoPE frequencies from a ModelSpec: every backend gets the same inverse frequencies.

Rotary embedding rotates each pair (x[j], x[j + head_dim/2]) of a head by the angle
position * inv_freq[j]. Scaling schemes only change inv_freq (and, for yarn and longrope, scale the
rotated q/k by `attention_factor`), so a backend needs just these two values.

Partial rotary (spec.rotary_dim < head_dim): HF rotates pairs (j, j + rotary_dim/2) of the first rotary_dim
dimensions and passes the rest through. The builder reorders each q/k head's rows with `rotary_row_order`, which
puts those pairs at (j, j + head_dim/2) for j < rotary_dim/2; backends rotate only the first rotary_dim/2 pairs
(inv_freq is zero beyond them). q.k is unchanged by a permutation applied to both, so nothing else notices.
"""

from __future__ import annotations

import math

import numpy as np

from precast.engine.spec import ModelSpec


def rope_parameters(spec: ModelSpec, max_seq_len: int | None = None, local: bool = False) -> tuple[np.ndarray, float]:
    """(inv_freq as float32 [head_dim // 2], attention_factor) for this model; max_seq_len is the engine's (longrope
    picks its factors by it). Entries from rotary_dim // 2 on are zero: those pairs pass through unrotated.
    `local`: the sliding-window layers' parameters, which differ only where spec.local_rope_theta is set (Gemma 3:
    default RoPE on its own base); has_local_rope(spec) says whether they do.

    Computed in float64 and rounded once, so they can differ from float32 reference code
    by an ulp (tested to 1e-6 relative).
    """
    if local and spec.local_rope_theta is not None:
        inv_freq, attention = _default_inv_freq(spec.local_rope_theta, spec.rotary_dim).astype(np.float32), 1.0
    else:
        inv_freq, attention = _rotary_parameters(spec, max_seq_len)
    padded = np.zeros(spec.head_dim // 2, dtype=np.float32)
    padded[: inv_freq.size] = inv_freq
    return padded, attention


def rope_tables(spec: ModelSpec, max_seq_len: int, num_positions: int, local: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin float32 [num_positions, head_dim / 2] for positions 0.., angles position * inv_freq in float32 (as
    the CPU runner computes them), both times the attention factor; 1 and 0 past the rotary pairs, so those pass
    through. The tables backends that rotate by lookup use (the TensorRT lowering, the CUDA runner)."""
    inv_freq, attention_factor = rope_parameters(spec, max_seq_len, local=local)
    angles = np.arange(num_positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles) * np.float32(attention_factor), np.sin(angles) * np.float32(attention_factor)
    cos[:, spec.rotary_dim // 2 :], sin[:, spec.rotary_dim // 2 :] = 1.0, 0.0
    return cos, sin


def rotary_row_order(head_dim: int, rotary_dim: int) -> np.ndarray:
    """Source row of each stored q/k row within a head: stored j <- j and stored j + head_dim/2 <- j + rotary_dim/2
    for j < rotary_dim/2 (the rotary pairs), and the pass-through rows fill the rest in order."""
    half, r_half = head_dim // 2, rotary_dim // 2
    rot_first, rot_second = np.arange(r_half), np.arange(r_half, rotary_dim)
    passing = np.arange(rotary_dim, head_dim)
    first = np.concatenate([rot_first, passing[: half - r_half]])
    second = np.concatenate([rot_second, passing[half - r_half :]])
    return np.concatenate([first, second])


def has_local_rope(spec: ModelSpec) -> bool:
    """Whether sliding-window layers rotate with other frequencies than the rest (Gemma 3)."""
    return spec.local_rope_theta is not None and bool(spec.sliding_window_layers)


def _default_inv_freq(base: float, dim: int) -> np.ndarray:
    return 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def _rotary_parameters(spec: ModelSpec, max_seq_len: int | None) -> tuple[np.ndarray, float]:
    inv_freq = _default_inv_freq(spec.rope_theta, spec.rotary_dim)
    s = spec.rope_scaling
    if s is None:
        return inv_freq.astype(np.float32), 1.0
    if s.rope_type == "linear":
        return (inv_freq / s.factor).astype(np.float32), 1.0
    if s.rope_type == "llama3":
        return _llama3(inv_freq, s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings), 1.0
    if s.rope_type == "yarn":
        return _yarn(spec, inv_freq)
    if s.rope_type == "longrope":
        return _longrope(spec, max_seq_len)
    raise ValueError(f"unknown rope type {s.rope_type}")


def _longrope(spec: ModelSpec, max_seq_len: int | None) -> tuple[np.ndarray, float]:
    """inv_freq[j] = 1 / (ext[j] * base^(2j/dim)), ext = long_factor when the engine's sequences may exceed the
    original context, else short_factor. transformers switches per forward pass by the current length; an engine
    has one table, so an engine built for longer sequences than the original context uses the long factors for
    every sequence (transformers would use the short ones for sequences that fit)."""
    s = spec.rope_scaling
    assert s is not None and s.original_max_position_embeddings is not None
    assert s.short_factor is not None and s.long_factor is not None
    original = s.original_max_position_embeddings
    ext = np.asarray(s.long_factor if max_seq_len is not None and max_seq_len > original else s.short_factor, np.float32)
    dim = spec.rotary_dim
    # float32 as transformers computes it (its factors are float32 tensors): 1 / (ext * base ** (2j / dim))
    shape = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (1.0 / (ext * np.float32(spec.rope_theta) ** shape)).astype(np.float32)
    factor = s.factor
    if s.attention_factor is not None:
        attention = s.attention_factor
    else:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return inv_freq, float(attention)


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


def llama3_from_divisors(divisors: np.ndarray, rope_theta: float, rotary_dim: int, original: int) -> dict[str, float] | None:
    """The llama3 scaling parameters whose rule divides each inverse frequency by `divisors` (llama.cpp stores the
    divisors, not the parameters, as rope_freqs.weight), or None when no llama3 rule gives them. Only the ratios
    original / low and original / high matter, so `original` (the context the model was trained for) fixes the
    scale; the result is checked by recomputing the divisors."""
    d = np.asarray(divisors, dtype=np.float64)
    inv_freq = 1.0 / (rope_theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    if d.shape != inv_freq.shape or not np.all(np.isfinite(d)) or d.min() < 1.0 - 1e-6:
        return None
    factor = float(d.max())
    if factor <= 1.0 + 1e-6:
        return None
    wavelen = 2 * math.pi / inv_freq
    kept, scaled = np.isclose(d, 1.0, rtol=1e-5), np.isclose(d, factor, rtol=1e-5)
    middle = ~(kept | scaled)
    if middle.sum() >= 2:
        # The blend is linear in original / wavelength: smooth = (original / wavelength - low) / (high - low).
        smooth = (1.0 / d[middle] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(original / wavelen[middle], smooth, 1)
        high = (1.0 - intercept) / slope
        low = -intercept / slope
    else:  # no blended band to fit: put the band edges between the kept and the scaled wavelengths
        if not kept.any() or not scaled.any():
            return None
        low = original / wavelen[scaled].min()
        high = original / wavelen[kept].max()
    params = {"factor": factor, "low_freq_factor": float(low), "high_freq_factor": float(high)}
    if not (0 < low < high):
        return None
    again = inv_freq / _llama3(inv_freq, factor, low, high, original).astype(np.float64)
    return params if np.allclose(again, d, rtol=1e-4) else None


def _yarn(spec: ModelSpec, inv_freq: np.ndarray) -> tuple[np.ndarray, float]:
    """NTK-by-parts: dimensions rotating fewer than beta_slow times over the original context are
    interpolated (divided by factor), those rotating more than beta_fast times are kept, a linear
    ramp in between. The attention factor defaults to 0.1 ln(factor) + 1."""
    s = spec.rope_scaling
    assert s is not None and s.original_max_position_embeddings is not None
    dim, base, factor = spec.rotary_dim, spec.rope_theta, s.factor
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
