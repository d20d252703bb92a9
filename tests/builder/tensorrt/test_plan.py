"""Real TensorRT plans built by tensorrt-rtx on this CPU-only machine (bf16, fp8, nvfp4), the engine's record of
them, and the errors around plans: no builder, unsupported combinations, a missing/corrupt/foreign plan, no GPU."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from precast.builder.build import BuildOptions, build_engine
from precast.builder.tensorrt.plan import PLAN_FILE, REPORT_FILE, TIMING_CACHE_FILE
from precast.engine.directory import load_engine
from precast.errors import PrecastError
from precast.quantization.recipe import QuantOptions

CALIB = tuple(tuple(int(t) for t in np.random.default_rng(i).integers(0, 128, 48)) for i in range(4))
SMALL = dict(max_seq_len=64, max_batch_size=2, max_num_tokens=32, progress=False)


def precast(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("precast")
    return subprocess.run([exe, *args] if exe else [sys.executable, "-m", "precast", *args], capture_output=True, text=True, timeout=600)


def test_bf16_plan_from_the_command_line(tiny_checkpoints, tmp_path):
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
        "64",
        "--max-batch-size",
        "2",
        "--max-num-tokens",
        "32",
        "--target",
        "all",
    )
    assert r.returncode == 0, r.stderr
    assert "tensorrt plan: tensorrt" in r.stdout
    engine = load_engine(out)
    record = engine.config.targets["tensorrt"]
    assert set(engine.config.targets) == {"cpu", "tensorrt"}
    plan = (out / PLAN_FILE).read_bytes()
    assert len(plan) == record["plan_bytes"] > 100_000 and record["activation_dtype"] == "bfloat16"
    report = json.loads((out / REPORT_FILE).read_text())
    assert report["builder"] in ("tensorrt", "tensorrt_rtx") and report["builder_version"]
    assert report["build_seconds"] > 0 and report["network_layers"] > 50
    assert report["layer_precision"]["layers.0.attn.qkv"] == "bfloat16 weights, bfloat16 inputs"
    if report["builder"] == "tensorrt_rtx":
        assert report["compute_capabilities"] == ["SM80", "SM86", "SM89", "SM120", "SM121"]  # bf16: Ampere on
    rtx = report["builder"] == "tensorrt_rtx"
    assert (out / TIMING_CACHE_FILE).is_file() != rtx  # TensorRT-RTX does not time kernels: no cache to keep
    r = precast("inspect", str(out))
    assert "tensorrt plan  rank0.plan" in r.stdout and "GPU-only" in r.stdout
    # Rebuilding (--force) reads the previous timing cache (full TensorRT) and says so.
    r = precast(
        "build",
        "--checkpoint",
        str(tiny_checkpoints["qwen3"]),
        "--output",
        str(out),
        "--dtype",
        "bfloat16",
        "--max-seq-len",
        "64",
        "--max-batch-size",
        "2",
        "--max-num-tokens",
        "32",
        "--target",
        "tensorrt",
        "--force",
    )
    assert r.returncode == 0, r.stderr
    state = json.loads((out / REPORT_FILE).read_text())["timing_cache"]
    assert state.startswith("not used by tensorrt_rtx") if rtx else state == "reused"


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
def test_quantized_plans(recipe, tiny_checkpoints, tmp_path):
    out = tmp_path / recipe
    build_engine(
        BuildOptions(
            tiny_checkpoints["llama"],
            out,
            dtype="bfloat16",
            targets=("cpu", "tensorrt"),
            quant=QuantOptions(recipe=recipe, calib_tokens=CALIB),
            **SMALL,
        )
    )
    report = json.loads((out / REPORT_FILE).read_text())
    expected = {
        "fp8": "fp8 weights (per-tensor scale), fp8 inputs (static scale)",
        "nvfp4": "nvfp4 weights (E4M3 per 16 x global), nvfp4 inputs (dynamic per 16)",
    }[recipe]
    assert report["layer_precision"]["layers.1.mlp.down"] == expected
    assert report["layer_precision"]["lm_head"] == "bfloat16 weights, bfloat16 inputs"
    if report["builder"] == "tensorrt_rtx":
        assert report["compute_capabilities"] == (["SM89", "SM120", "SM121"] if recipe == "fp8" else ["SM120", "SM121"])
    assert load_engine(out).config.quant.recipe == recipe and (out / PLAN_FILE).stat().st_size > 100_000


def test_refusals_name_what_cannot_be_lowered(tiny_checkpoints, tmp_path):
    with pytest.raises(PrecastError, match="KV-cache update layer takes float32/float16/bfloat16"):
        build_engine(
            BuildOptions(
                tiny_checkpoints["llama"],
                tmp_path / "a",
                targets=("tensorrt",),
                quant=QuantOptions(kv_cache_dtype="fp8", calib_tokens=CALIB),
                **SMALL,
            )
        )
    with pytest.raises(PrecastError, match="16-token sliding window.*--max-seq-len 16"):
        build_engine(BuildOptions(tiny_checkpoints["mistral"], tmp_path / "b", targets=("tensorrt",), **SMALL))
    with pytest.raises(PrecastError, match="gemma2 soft-caps attention scores.*--target cpu"):
        build_engine(BuildOptions(tiny_checkpoints["gemma2"], tmp_path / "c", targets=("tensorrt",), **dict(SMALL, max_seq_len=8)))
    assert not any((tmp_path / d).exists() for d in "abc")  # nothing half-written


def test_no_tensorrt_builder_says_what_to_install(tiny_checkpoints, tmp_path, monkeypatch):
    from precast.runtime.tensorrt import trt_ops

    monkeypatch.setattr(trt_ops, "BUILDER_MODULES", ("precast_no_such_tensorrt",))
    with pytest.raises(PrecastError, match="pip install tensorrt-rtx"):
        build_engine(BuildOptions(tiny_checkpoints["llama"], tmp_path / "e", targets=("tensorrt",), **SMALL))


@pytest.fixture(scope="module")
def planned_engine(tiny_checkpoints, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("planned") / "engine"
    build_engine(BuildOptions(tiny_checkpoints["llama"], out, dtype="float32", targets=("cpu", "tensorrt"), **SMALL))
    return out


def copy_engine(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_plan_missing_corrupt_or_from_another_builder(planned_engine, tmp_path):
    from precast.runtime import LLM

    missing = copy_engine(planned_engine, tmp_path / "missing")
    (missing / PLAN_FILE).unlink()
    with pytest.raises(PrecastError, match="plan rank0.plan is missing"):
        LLM(missing, backend="tensorrt")
    corrupt = copy_engine(planned_engine, tmp_path / "corrupt")
    data = bytearray((corrupt / PLAN_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (corrupt / PLAN_FILE).write_bytes(bytes(data))
    with pytest.raises(PrecastError, match="is corrupt"):
        LLM(corrupt, backend="tensorrt")
    foreign = copy_engine(planned_engine, tmp_path / "foreign")
    config = json.loads((foreign / "config.json").read_text())
    config["targets"]["tensorrt"]["builder_version"] = "0.9.0"
    (foreign / "config.json").write_text(json.dumps(config))
    with pytest.raises(PrecastError, match=r"built by tensorrt\S* 0\.9\.0.*only load in the version that built them"):
        LLM(foreign, backend="tensorrt")
    cpu_only = tmp_path / "cpu-only"
    build_engine(BuildOptions(Path(load_engine(planned_engine).config.provenance["source"]), cpu_only, **SMALL))
    with pytest.raises(PrecastError, match="has no TensorRT plan"):
        LLM(cpu_only, backend="tensorrt")


def test_no_gpu_fails_at_once_with_a_clear_message(planned_engine):
    from precast.runtime import LLM
    from precast.runtime.tensorrt.runner import has_nvidia_gpu

    if has_nvidia_gpu():
        pytest.skip("this machine has an NVIDIA GPU")  # the check below is for machines without one
    with pytest.raises(PrecastError, match="runs TensorRT plans on an NVIDIA GPU, and this machine has none"):
        LLM(planned_engine, backend="tensorrt")


def test_smollm2_plan_and_its_network_answer_on_cpu(smollm2_gguf, tmp_path):
    """The real model end to end: a bfloat16 plan built from the command line, and the plan's network (evaluated in
    numpy through backend tensorrt-reference) answering the chat question as the CPU runner does."""
    out = tmp_path / "smollm2"
    r = precast(
        "build",
        "--checkpoint",
        str(smollm2_gguf),
        "--output",
        str(out),
        "--dtype",
        "bfloat16",
        "--target",
        "all",
        "--max-batch-size",
        "2",
        "--max-seq-len",
        "128",
        "--max-num-tokens",
        "64",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    assert json.loads((out / REPORT_FILE).read_text())["plan_bytes"] > 200 << 20  # the weights are in the plan
    r = precast(
        "run", str(out), "--backend", "tensorrt-reference", "--chat", "--max-tokens", "10", "--prompt", "What is the capital of France?"
    )
    assert r.returncode == 0, r.stderr
    assert "The capital of France is Paris." in r.stdout


def test_phi3_family_plan_builds(tiny_checkpoints, tmp_path):
    """Phi-4-mini's shape (partial rotary, longrope, tied, 4:1 GQA) lowers and builds a real plan."""
    out = tmp_path / "engine"
    build_engine(BuildOptions(tiny_checkpoints["phi4mini"], out, dtype="bfloat16", targets=("cpu", "tensorrt"), **SMALL))
    engine = load_engine(out)
    assert engine.config.model.rotary_dim == 12 and (out / PLAN_FILE).stat().st_size == engine.config.targets["tensorrt"]["plan_bytes"]


def test_gemma3_plan_builds(tiny_checkpoints, tmp_path):
    """Gemma 3's block (sandwich norms, GELU-tanh, qk-norm, two RoPE tables, embedding scale) builds a real plan; its
    8-token window fits an engine of 8 positions, where the window never applies."""
    out = tmp_path / "engine"
    build_engine(BuildOptions(tiny_checkpoints["gemma3"], out, dtype="bfloat16", targets=("cpu", "tensorrt"), **dict(SMALL, max_seq_len=8)))
    engine = load_engine(out)
    assert engine.config.model.sandwich_norms and (out / PLAN_FILE).stat().st_size == engine.config.targets["tensorrt"]["plan_bytes"]
