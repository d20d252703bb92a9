"""The examples run as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_build_engine_example(tmp_path):
    script = ROOT / "examples" / "build_engine.py"
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "llama: 30 layers, 9 heads (3 kv), 134,515,008 parameters" in r.stdout
    assert "embed.weight: bfloat16 (49152, 576)" in r.stdout
    assert (tmp_path / "engines" / "example" / "weights.safetensors").is_file()


def test_generate_example(smollm2_bf16_engine):
    script = ROOT / "examples" / "generate.py"
    r = subprocess.run([sys.executable, str(script), str(smollm2_bf16_engine)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "chat: The capital of France is Paris." in r.stdout
    assert r.stdout.count("batch:") == 3 and "stream: " in r.stdout
