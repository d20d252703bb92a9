"""The TensorRT lowering, evaluated in numpy, against HF transformers and the CPU runner; and the recorded
TensorRT network against the numpy trace, layer by layer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from precast.builder.build import BuildOptions, build_engine
from precast.engine.directory import load_engine
from precast.errors import PrecastError
from precast.quantization.recipe import QuantOptions
from precast.runtime.cpu_backend import make_cpu_runner
from precast.runtime.tensorrt.lowering import lower
from precast.runtime.tensorrt.numpy_ops import NumpyOps
from tests.conftest import TINY_CONFIGS

# Layers with a sliding window cannot be lowered; an engine whose max_seq_len fits in the window can.
SEQ = {"mistral": 16, "qwen2": 8, "phi3": 24, "gemma2": 8, "gemma3": 8}  # at most the sliding window (TensorRT has none)


def numpy_prefill(engine_dir: Path, prompt: list[int], act_dtype: str | None = None) -> tuple[np.ndarray, NumpyOps]:
    """Logits at every prompt position: the prompt as one step in slot 0 of the lowered network."""
    engine = load_engine(engine_dir)
    spec, limits = engine.config.model, engine.config.limits
    S, step, cache_len = limits.max_batch_size, len(prompt), limits.max_seq_len + limits.max_num_tokens
    feeds = {
        "input_ids": np.zeros((S, step), np.int32),
        "position_ids": np.tile(np.arange(step, dtype=np.int64), (S, 1)),
        "write_indices": np.zeros(S, np.int32),
        "kv_lengths": np.full(S, step, np.int32),
        "last_token_ids": np.arange(step, dtype=np.int32),
    }
    feeds["input_ids"][0] = prompt
    for i in range(spec.num_layers):
        for kind in "kv":
            feeds[f"{kind}_cache.{i}"] = np.zeros((S, spec.num_kv_heads, cache_len, spec.head_dim), np.float32)
    ops = NumpyOps(feeds)
    lower(ops, engine, act_dtype)
    return ops.outputs["logits"].value, ops


@pytest.fixture(scope="module")
def tiny_trt_engines(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trt-tiny")
    out = {}
    for name in TINY_CONFIGS:
        out[name] = root / name
        build_engine(
            BuildOptions(
                tiny_checkpoints[name], out[name], max_seq_len=SEQ.get(name, 64), max_batch_size=2, max_num_tokens=32, progress=False
            )
        )
    return out


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_numpy_lowering_matches_hf(name, tiny_checkpoints, tiny_trt_engines):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[name], dtype=torch.float32).eval()
    prompt = np.random.default_rng(7).integers(0, TINY_CONFIGS[name][1]["vocab_size"], SEQ.get(name, 29)).tolist()
    refusals = {"gemma2": "soft-caps attention scores.*--target cpu", "mixtral": "mixture of experts.*--target cpu"}
    refusals |= {"qwen2_moe": refusals["mixtral"], "qwen3_moe": refusals["mixtral"]}
    if name in refusals:  # attention soft-capping, routed experts: not in the lowering
        with pytest.raises(PrecastError, match=refusals[name]):
            numpy_prefill(tiny_trt_engines[name], prompt)
        return
    ours, _ = numpy_prefill(tiny_trt_engines[name], prompt)
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(ours, want, atol=1e-4 * np.abs(want).max(), rtol=0)


def test_numpy_lowering_matches_hf_on_smollm2(smollm2_gguf, smollm2_hf_model, tmp_path):
    build_engine(BuildOptions(smollm2_gguf, tmp_path / "e", max_seq_len=64, max_batch_size=1, max_num_tokens=32, progress=False))
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2]
    ours, _ = numpy_prefill(tmp_path / "e", prompt)
    with torch.no_grad():
        want = smollm2_hf_model(torch.tensor([prompt])).logits[0].float().numpy()
    assert np.abs(ours - want).max() <= 1e-4 * np.abs(want).max()
    assert (ours.argmax(-1) == want.argmax(-1)).all()


@pytest.fixture(scope="module")
def quantized_tiny(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    """The tiny llama quantized by each recipe (float32 elsewhere, so both sides compute in float32); int4_awq has
    asymmetric groups, "int4_awq:symmetric" symmetric ones."""
    root = tmp_path_factory.mktemp("trt-quant")
    tokens = tuple(tuple(int(t) for t in np.random.default_rng(i).integers(0, 128, 48)) for i in range(4))
    out = {}
    for name in ("fp8", "nvfp4", "int4_awq", "int4_awq:symmetric"):
        recipe, int4 = name.split(":")[0], name.startswith("int4")
        out[name] = root / name.replace(":", "-")
        quant = QuantOptions(recipe=recipe, calib_tokens=tokens, group_size=32 if int4 else None, asymmetric=not name.endswith("symmetric"))
        build_engine(
            BuildOptions(
                tiny_checkpoints["llama"],
                out[name],
                dtype="float32",
                max_seq_len=64,
                max_batch_size=2,
                max_num_tokens=32,
                progress=False,
                quant=quant,
            )
        )
    return out


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4", "int4_awq", "int4_awq:symmetric"])
def test_numpy_lowering_matches_the_cpu_runner_on_quantized_engines(recipe, quantized_tiny):
    prompt = np.random.default_rng(11).integers(0, 128, 30).tolist()
    ours, ops = numpy_prefill(quantized_tiny[recipe], prompt)
    runner = make_cpu_runner(load_engine(quantized_tiny[recipe]), 2)
    want = np.asarray(runner.evaluate(prompt, True)).reshape(len(prompt), -1)
    assert (ours.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(ours - want).max() <= 1e-3 * np.abs(want).max()
    formats = {"fp8": {"quantize"}, "nvfp4": {"dynamic_quantize"}}.get(recipe, set())
    assert formats <= {e.op for e in ops.trace}  # the recipe's activation quantization is in the network
    assert "dequantize" in {e.op for e in ops.trace}


@pytest.mark.parametrize("which", ["llama", "qwen3", "phi4mini", "gemma3", "fp8", "nvfp4", "int4_awq", "int4_awq:symmetric"])
def test_recorded_network_matches_the_numpy_trace(which, tiny_trt_engines, quantized_tiny):
    """One lowering, two backends: the TensorRT layers and the numpy ops agree entry by entry (op, shape, dtype)."""
    from precast.runtime.tensorrt.trt_ops import TrtOps, import_tensorrt, quiet_logger

    engine_dir = tiny_trt_engines.get(which) or quantized_tiny[which]
    _, numpy_ops = numpy_prefill(engine_dir, list(range(5, 17)))
    trt = import_tensorrt()
    builder = trt.Builder(quiet_logger(trt))
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    trt_ops = TrtOps(trt, network)
    lower(trt_ops, load_engine(engine_dir))
    assert len(trt_ops.trace) == len(numpy_ops.trace)
    mismatched = [(i, a, b) for i, (a, b) in enumerate(zip(trt_ops.trace, numpy_ops.trace)) if not a.matches(b)]
    assert not mismatched, mismatched[:5]
    # Every traced op is one layer, except IAttention, which TensorRT keeps as an input and an output boundary layer.
    ops = [e.op for e in trt_ops.trace if e.op != "input"]
    assert network.num_layers == len(ops) + ops.count("attention")
