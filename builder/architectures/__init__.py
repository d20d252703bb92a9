"""Supported architectures, found by the HF config's `architectures` (or `model_type`)."""

from __future__ import annotations

from typing import Any

from precast.builder.architectures import gemma, llama, mistral, moe, phi3, qwen2, qwen3
from precast.builder.architectures.common import Architecture
from precast.errors import PrecastError

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        llama.ARCHITECTURE,
        mistral.ARCHITECTURE,
        qwen2.ARCHITECTURE,
        qwen3.ARCHITECTURE,
        phi3.ARCHITECTURE,
        gemma.GEMMA2,
        gemma.GEMMA3,
        gemma.GEMMA3_IMAGE_TEXT,
        moe.MIXTRAL,
        moe.QWEN2_MOE,
        moe.QWEN3_MOE,
    )
}


def supported_names() -> list[str]:
    return sorted(c for a in ARCHITECTURES.values() for c in a.hf_classes)


def find_architecture(config: dict[str, Any]) -> Architecture:
    classes = config.get("architectures") or []
    for arch in ARCHITECTURES.values():
        if any(c in arch.hf_classes for c in classes):
            return arch
    if not classes and config.get("model_type") in ARCHITECTURES:
        return ARCHITECTURES[config["model_type"]]
    named = ", ".join(classes) if classes else f"model_type {config.get('model_type')!r}"
    raise PrecastError(f"architecture {named} is not supported; precast supports: {', '.join(supported_names())}")
