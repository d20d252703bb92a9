"""Checkpoint readers: a path in, a `Checkpoint` (HF-shaped, lazy) out."""

from __future__ import annotations

import os
from pathlib import Path

from precast.builder.checkpoint.base import Checkpoint, TokenizerFiles
from precast.builder.checkpoint.gguf_file import GGUFCheckpoint
from precast.builder.checkpoint.hf import HFCheckpoint
from precast.errors import PrecastError

__all__ = ["Checkpoint", "TokenizerFiles", "open_checkpoint"]


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """An HF checkpoint directory or a .gguf file; anything else is refused with the reason."""
    p = Path(path)
    if not p.exists():
        raise PrecastError(f"checkpoint {p} does not exist")
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if not (p / "config.json").exists() and len(ggufs) == 1:
            p = ggufs[0]
        else:
            return HFCheckpoint(p)
    if p.suffix.lower() == ".gguf" or _has_gguf_magic(p):
        return GGUFCheckpoint(p)
    raise PrecastError(f"{p} is neither a Hugging Face checkpoint directory nor a .gguf file")


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
