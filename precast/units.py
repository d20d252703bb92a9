"""Sizes as people type them on command lines: '2GiB', '512MiB', '1e9' (bytes)."""

from __future__ import annotations


def memory_size(text: str) -> int:
    """'2GiB', '512MiB', '1e9' -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    for suffix, factor in units.items():
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * factor)
    return int(float(t))
