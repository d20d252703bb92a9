"""The `precast` console script, run as a user would."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest


def precast(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("precast")
    cmd = [exe, *args] if exe else [sys.executable, "-m", "precast", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_build_then_inspect(tiny_checkpoints, tmp_path):
    out = tmp_path / "engine"
    r = precast(
        "build",
        "--checkpoint",
        str(tiny_checkpoints["qwen3"]),
        "--output",
        str(out),
        "--dtype",
        "bfloat16",
        "--max-seq-len",
        "128",
        "--max-batch-size",
        "4",
    )
    assert r.returncode == 0, r.stderr
    assert "built" in r.stdout and "qwen3" in r.stdout
    assert "precast build" in r.stderr  # the progress bar
    r = precast("inspect", str(out))
    assert r.returncode == 0, r.stderr
    for expected in (
        "architecture   qwen3",
        "qk-norm True",
        "bfloat16",
        "max_seq_len 128",
        "max_batch_size 4",
        "targets        cpu",
        "sha256",
    ):
        assert expected in r.stdout, expected
    summary = json.loads(precast("inspect", str(out), "--json").stdout)
    sizes = summary["bytes_by_dtype"]
    assert summary["parameters"] == sizes["bfloat16"] // 2 + sizes["float32"] // 4
    assert set(summary["bytes_by_dtype"]) == {"bfloat16", "float32"}  # matrices bf16, norms float32
    assert summary["provenance"]["source_format"] == "hf"


@pytest.mark.parametrize(
    "args,message",
    [
        (["build", "--checkpoint", "/nonexistent", "--output", "/tmp/x"], "does not exist"),
        (["inspect", "/nonexistent-engine"], "does not exist"),
    ],
)
def test_errors_are_one_line_without_traceback(args, message):
    r = precast(*args)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


def test_quantized_build_from_the_command_line(smollm2_gguf, tmp_path):
    out = tmp_path / "fp8"
    r = precast(
        "build",
        "--checkpoint",
        str(smollm2_gguf),
        "--output",
        str(out),
        "--quant",
        "fp8",
        "--activation-scales",
        "dynamic",
        "--kv-cache-dtype",
        "fp8",
        "--exclude",
        "layers.0.*",
        "--calib-samples",
        "2",
        "--calib-seq-len",
        "64",
        "--max-seq-len",
        "512",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    assert "quantized: fp8, 116 layers, KV cache fp8; calibration 2 x 64 tokens" in r.stdout
    r = precast("inspect", str(out))
    assert "quant          fp8; 116 layers fp8 (per-token inputs); LM head not quantized; KV cache fp8; excluded layers.0.*" in r.stdout
    r = precast("run", str(out), "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "12")
    assert r.returncode == 0 and "Paris" in r.stdout, r.stdout + r.stderr


def test_quantized_build_errors(smollm2_gguf, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Too short to calibrate on.")
    cases = [
        (["--quant", "int8"], "unknown --quant 'int8'; choose from none, fp8, nvfp4, int4_awq"),
        (["--kv-cache-dtype", "int4"], "--kv-cache-dtype 'int4' is not supported"),
        (["--quant", "fp8", "--calib-text", str(tmp_path / "missing.txt")], "missing.txt does not exist"),
        (["--quant", "fp8", "--calib-text", str(short)], "has 7 tokens; --calib-samples 16 x --calib-seq-len 256 needs 4096"),
        (["--quant", "nvfp4", "--exclude", "q_proj"], "--exclude q_proj matches no layer"),
        (["--quant", "int4_awq", "--activation-scales", "dynamic"], "--activation-scales dynamic applies to --quant fp8 only"),
        (["--quant", "fp8", "--no-scale-search"], "--no-scale-search applies to --quant int4_awq and nvfp4 only"),
        (["--quant", "nvfp4", "--symmetric"], "--symmetric applies to --quant int4_awq only"),
    ]
    for extra, message in cases:
        r = precast("build", "--checkpoint", str(smollm2_gguf), "--output", str(tmp_path / "e"), "--quiet", *extra)
        assert r.returncode == 2, (extra, r.stderr)
        assert message in r.stderr and "Traceback" not in r.stderr, (extra, r.stderr)
        assert not (tmp_path / "e").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["short.txt"]  # nothing half-built left behind


def test_run_chat_prints_the_answer(smollm2_bf16_engine):
    r = precast("run", str(smollm2_bf16_engine), "--prompt", "What is the capital of France?", "--chat", "--verbose")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "The capital of France is Paris."
    assert "finish: stop" in r.stderr
    r = precast("run", str(smollm2_bf16_engine), "--prompt", "What is the capital of France?", "--chat", "--stream")
    assert r.stdout.strip() == "The capital of France is Paris."


def test_run_rejects_bad_values(smollm2_bf16_engine):
    r = precast("run", str(smollm2_bf16_engine), "--prompt", "Hi", "--top-p", "0")
    assert r.returncode == 2 and "top_p must be in (0, 1]" in r.stderr and "Traceback" not in r.stderr


def test_run_with_an_output_format(smollm2_bf16_engine):
    schema = '{"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"], "additionalProperties": false}'
    r = precast("run", str(smollm2_bf16_engine), "--prompt", "Where is the Eiffel tower?", "--chat", "--json-schema", schema)
    assert r.returncode == 0, r.stderr
    assert list(json.loads(r.stdout)) == ["city"]
    r = precast("run", str(smollm2_bf16_engine), "--prompt", "Is water wet?", "--chat", "--choice", "yes", "--choice", "no")
    assert r.returncode == 0 and r.stdout.strip() in ("yes", "no")
    r = precast("run", str(smollm2_bf16_engine), "--prompt", "Hi", "--regex", "(")
    assert r.returncode == 2 and "regex cannot be used" in r.stderr and "Traceback" not in r.stderr
