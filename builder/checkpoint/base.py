"""What every checkpoint reader offers the builder.

A reader presents its source as a Hugging Face checkpoint: an HF-style config dict,
tensors under HF names, and the tokenizer files an HF directory would hold. A GGUF file
is translated into exactly that shape, so the architecture translators see one kind of
input and a GGUF builds the same engine as the HF checkpoint made from it.

Tensors are read lazily, one at a time: nothing holds the whole model in memory.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class TokenizerFiles:
    """Tokenizer files to copy into the engine, by file name, and the ids generation needs."""

    files: dict[str, bytes]
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    chat_template: str | None = None


class Checkpoint(abc.ABC):
    path: Path
    format: str  # "hf" or "gguf"
    config: dict[str, Any]  # as an HF config.json would hold it
    # Set when the weights were quantized elsewhere (quantization/prequantized.py): {"method", "algo"}.
    prequantized: dict[str, Any] | None = None

    @abc.abstractmethod
    def tensor_names(self) -> list[str]: ...

    @abc.abstractmethod
    def tensor_shape(self, name: str) -> tuple[int, ...]: ...

    @abc.abstractmethod
    def tensor_dtype(self, name: str) -> str:
        """The dtype as stored in the source (e.g. "BF16", "Q4_K"), for reports and the default --dtype."""

    @abc.abstractmethod
    def read(self, name: str) -> np.ndarray:
        """One tensor in HF layout, as float32/float16/bfloat16 numpy array, freshly materialized."""

    @abc.abstractmethod
    def tokenizer(self) -> TokenizerFiles | None: ...

    @abc.abstractmethod
    def digest(self) -> str:
        """A sha256 over the source files, recorded in the engine's provenance."""

    def generation_config(self) -> dict[str, Any]:
        return {}
