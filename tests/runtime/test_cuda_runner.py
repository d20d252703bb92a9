"""The CUDA runner (runtime/cuda) in Triton's interpreter mode (tests/conftest.py sets TRITON_INTERPRET=1): the
same engines, executor and scheduler as the CPU runner, and greedy tokens identical to it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from precast.builder.build import BuildOptions, build_engine
from precast.engine.directory import load_engine
from precast.errors import PrecastError
from precast.quantization.recipe import QuantOptions
from precast.runtime import LLM, SamplingParams
from precast.runtime.cuda import make_cuda_runner

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's numpy exp

PROMPTS = [[5, 17, 99, 3, 42, 8, 5, 17, 99], [7, 7, 7, 7, 7, 7], list(range(10, 50))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
RNG = np.random.default_rng(3)
CALIB = tuple(tuple(int(t) for t in RNG.integers(0, 128, 48)) for _ in range(4))


def generate(engine: Path, prompts: list[list[int]], params: SamplingParams = GREEDY, **options) -> list[list[int]]:
    with LLM(engine, **options) as llm:
        outs = llm.generate(prompts, params)
        llm.check_integrity()
        return [o.token_ids for o in outs]


def test_greedy_identical_to_the_cpu_runner_on_every_tiny_architecture(tiny_engines):
    """GQA and MQA, sliding windows, qkv bias, qk-norm, partial rotary and every RoPE scaling, Gemma's block and
    soft-caps, mixtures of experts: the batch of three decodes the CPU runner's tokens."""
    for name, engine in tiny_engines.items():
        want = generate(engine, PROMPTS)
        assert generate(engine, PROMPTS, backend="cuda", matmul_precision="float32") == want, name


@pytest.fixture(scope="module")
def quantized_tiny(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    """The tiny llama (GQA) and gemma2 (soft-caps, tied embedding) under each recipe, and with an fp8 KV cache."""
    root = tmp_path_factory.mktemp("cuda-quant")
    out = {}
    builds = [("llama", "fp8", "auto"), ("llama", "nvfp4", "auto"), ("llama", "int4_awq", "auto"), ("llama", "none", "fp8")]
    for arch, recipe, kv in builds + [("gemma2", "fp8", "fp8"), ("gemma2", "int4_awq", "auto")]:
        name = f"{arch}-{recipe}-kv{kv}"
        quant = QuantOptions(
            recipe=recipe,
            kv_cache_dtype=kv,
            quantize_lm_head=arch == "gemma2",
            calib_tokens=CALIB,
            group_size=32 if recipe == "int4_awq" else None,
        )
        build_engine(BuildOptions(tiny_checkpoints[arch], root / name, max_seq_len=256, max_batch_size=8, progress=False, quant=quant))
        out[name] = root / name
    return out


def test_greedy_identical_under_every_recipe_and_fp8_kv(quantized_tiny):
    """fp8 (E4M3 x E4M3 products), nvfp4 (bf16-exact products), int4_awq (dequantized in registers), the E4M3 KV
    pool; gemma2's LM head (tied: the embedding gathered from the quantized table) quantized too."""
    for name, engine in quantized_tiny.items():
        want = generate(engine, PROMPTS)
        assert generate(engine, PROMPTS, backend="cuda") == want, name


def test_chunked_prefill_prefix_reuse_and_preemption(tiny_engines):
    """16 tokens per step (every prompt chunked), six KV blocks for four requests of three blocks each
    (preemption), then a prompt sharing a cached prefix: the CPU runner's tokens, and the pools stay consistent."""
    engine = tiny_engines["qwen2"]
    prompts = [RNG.integers(0, 128, n).tolist() for n in (60, 41, 70, 33)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = generate(engine, prompts, params)
    block = load_engine(engine)
    spec = block.config.model
    block_bytes = spec.num_layers * 2 * spec.num_kv_heads * 32 * spec.head_dim * 4
    with LLM(engine, backend="cuda", max_num_tokens=16, kv_cache_memory=6 * block_bytes) as llm:
        assert llm.num_kv_blocks == 6
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        assert llm.stats().preemptions > 0
        shared = prompts[2][:64] + [1, 2, 3]
        out = llm.generate(shared, params)
        assert out.num_cached_tokens >= 64
        llm.check_integrity()
    assert out.token_ids == generate(engine, [shared], params)[0]


def test_decode_graph_buckets_pad_batches_and_match_eager(tiny_engines):
    """Decode steps go through the graph path's padded static batches (run eagerly here): three requests in the
    bucket of four, the padded row writing only the scratch block; tokens as without graphs."""
    engine = load_engine(tiny_engines["llama"])
    runner = make_cuda_runner(engine, "float32", cuda_graphs=True)
    with LLM(engine.path, backend="cuda", matmul_precision="float32") as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert 4 in llm._runner.graphs.static and 1 not in llm._runner.graphs.static
    assert got == generate(engine.path, PROMPTS)
    assert runner.graphs is None  # made at configure_kv
    runner.configure_kv(8, 32)
    assert runner.graphs.buckets[-1] == engine.config.limits.max_batch_size


def test_speculative_decoding_on_the_cuda_runner(tiny_engines):
    """Drafts are checked from the runner's logits rows for every position (all_logits)."""
    engine = tiny_engines["llama"]
    prompts = [[5, 17, 99, 3, 42, 8, 5, 17, 99, 3, 42, 8], list(range(10, 40))]
    want = generate(engine, prompts)
    with LLM(engine, backend="cuda", speculative="ngram", num_draft_tokens=3) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        assert llm.stats().draft_tokens > 0


def test_weights_precision_rounds_bf16_inputs_within_bf16_bounds(tiny_checkpoints, tmp_path):
    """A bf16 engine with precision "weights" (bf16 tensor-core operands) stays within bf16 rounding of the CPU
    runner's float32 logits, and prompt log-probabilities (every position's logits) come back."""
    engine = tmp_path / "bf16"
    build_engine(BuildOptions(tiny_checkpoints["llama"], engine, dtype="bfloat16", max_seq_len=256, max_batch_size=4, progress=False))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    with LLM(engine) as cpu, LLM(engine, backend="cuda") as gpu:
        want, got = cpu.generate(PROMPTS[2], params), gpu.generate(PROMPTS[2], params)
    cpu_lp, gpu_lp = np.array(want.prompt_logprobs[1:]), np.array(got.prompt_logprobs[1:])
    # bf16 inputs carry a relative error of up to 2**-9 into every product; through three layers that moves a
    # log-probability by a few hundredths here
    np.testing.assert_allclose(gpu_lp, cpu_lp, atol=0.15)
    assert np.abs(gpu_lp - cpu_lp).mean() < 0.03
    assert not np.array_equal(gpu_lp, cpu_lp)  # the inputs were rounded to bf16


def test_refusals(tiny_engines, tiny_checkpoints, tmp_path, monkeypatch):
    engine = tiny_engines["llama"]
    with pytest.raises(PrecastError, match="matmul precision"):
        LLM(engine, backend="cuda", matmul_precision="tf32")
    with pytest.raises(PrecastError, match="matmul precision must be one of weights, float32"):
        LLM(engine, matmul_precision="bfloat16")
    with pytest.raises(PrecastError, match="option of backends 'cpu' and 'cuda'"):
        LLM(engine, backend="tensorrt-reference", matmul_precision="float32")
    odd = tmp_path / "odd"
    build_engine(BuildOptions(tiny_checkpoints["llama"], odd, max_seq_len=256, tokens_per_block=8, progress=False))
    with pytest.raises(PrecastError, match="power of two >= 16.*--tokens-per-block 32"):
        LLM(odd, backend="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not torch.cuda.is_available():
        with pytest.raises(PrecastError, match="torch sees none here; use backend='cpu'"):
            LLM(engine, backend="cuda")


def test_triton_repository_takes_the_backend(tiny_engines, tmp_path):
    """`precast triton-repo --backend cuda`: the model's config names the backend its LLM is made with."""
    from precast.runtime.triton.repo import write_model_repository

    repo = write_model_repository(tiny_engines["llama"], tmp_path / "repo", "precast", backend="cuda")
    assert 'key: "backend" value: { string_value: "cuda" }' in (repo / "precast" / "config.pbtxt").read_text()
    with pytest.raises(PrecastError, match="unknown backend 'gpu'"):
        write_model_repository(tiny_engines["llama"], tmp_path / "other", "precast", backend="gpu")


@pytest.mark.slow
def test_the_device_check_script_runs_at_a_tiny_shape(tmp_path):
    """benchmarks/gpu_check.py end to end on the CPU (`device --small`, 5-10 minutes): its greedy comparisons hold
    and its table is written, so the prepared device run does not fail on the script itself."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "gpu_check.py"), "device", "--small", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
        env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    report = (tmp_path / "out" / "gpu_check.md").read_text()
    # float32 multiplies give the CPU runner's tokens; bf16 operands and pools may not (reported, not failed)
    assert report.count(": identical") >= 2 and "bfloat16 engine, matmul weights:" in report
    assert "| Llama-3-8B shape, 4 layers | fp8 | 4 |" in report
