"""compare_cpu.py's --model takes a packaged model's name or a prefix naming one only."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from compare_cpu import MODELS, model_arg  # noqa: E402


def test_full_names_and_unique_prefixes_resolve():
    for name in MODELS:
        assert model_arg(name) == name
    assert model_arg("qwen2.5-coder-1.5b") == "qwen2.5-coder-1.5b-instruct"
    assert model_arg("smollm2") == "smollm2-135m-instruct"


@pytest.mark.parametrize("name", ["qwen", "llama-3"])
def test_ambiguous_or_unknown_prefix_is_refused(name):
    with pytest.raises(argparse.ArgumentTypeError, match="packaged models; choose one of"):
        model_arg(name)
