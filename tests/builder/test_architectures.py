"""Tiny random checkpoints of every supported architecture: spec, weights, rope, reload."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from precast.builder.architectures import find_architecture, supported_names
from precast.builder.build import BuildOptions, build_engine
from precast.engine.directory import load_engine, numpy_dtype
from precast.engine.rope import rope_parameters, rotary_row_order
from precast.engine.spec import ModelSpec
from tests.conftest import TINY_CONFIGS

# Canonical engine tensor -> HF tensors it is made of (concatenated along dim 0).
HF_PARTS = {
    "attn_norm.weight": ["input_layernorm.weight"],
    "attn.qkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "attn.qkv.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    "attn.q_norm.weight": ["self_attn.q_norm.weight"],
    "attn.k_norm.weight": ["self_attn.k_norm.weight"],
    "attn.o.weight": ["self_attn.o_proj.weight"],
    "mlp_norm.weight": ["post_attention_layernorm.weight"],
    "mlp.gate_up.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "mlp.down.weight": ["mlp.down_proj.weight"],
}
GLOBAL_PARTS = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}


# Phi-3 checkpoints store q|k|v and gate|up fused already.
FUSED_PARTS = {"attn.qkv.weight": ["self_attn.qkv_proj.weight"], "mlp.gate_up.weight": ["mlp.gate_up_proj.weight"]}
# Gemma 2/3 name four norms per layer; their norms multiply by 1 + w, and the engine stores 1 + w.
SANDWICH_PARTS = {
    "post_attn_norm.weight": ["post_attention_layernorm.weight"],
    "mlp_norm.weight": ["pre_feedforward_layernorm.weight"],
    "post_mlp_norm.weight": ["post_feedforward_layernorm.weight"],
}


def moe_reference(state: dict[str, torch.Tensor], layer: str, rest: str) -> np.ndarray:
    """A mixture layer's engine tensor from transformers' in-memory layout: experts fused as [E, 2 mi, hidden] (gate
    rows, then up) and [E, hidden, mi], the router as mlp.gate, the shared expert as a plain MLP."""
    p = f"model.layers.{layer}.mlp."
    parts = rest.split(".")
    if rest == "moe.router.weight":
        return state[p + "gate.weight"].numpy()
    if rest == "moe.shared_gate.weight":
        return state[p + "shared_expert_gate.weight"].numpy()
    if parts[1] == "experts":
        fused = state[p + ("experts.gate_up_proj" if parts[3] == "gate_up" else "experts.down_proj")]
        return fused[int(parts[2])].numpy()
    names = ["gate_proj", "up_proj"] if parts[2] == "gate_up" else ["down_proj"]
    return np.concatenate([state[f"{p}shared_expert.{n}.weight"].numpy() for n in names], axis=0)


def hf_reference(state: dict[str, torch.Tensor], name: str, spec: ModelSpec | None = None) -> np.ndarray:
    gemma = "model.layers.0.pre_feedforward_layernorm.weight" in state
    offset = np.float32(1.0) if gemma and name.endswith("norm.weight") else np.float32(0.0)
    if name in GLOBAL_PARTS:
        return state[GLOBAL_PARTS[name]].numpy() + offset
    _, layer, rest = name.split(".", 2)
    if rest.startswith("moe."):
        return moe_reference(state, layer, rest)
    if gemma and rest in SANDWICH_PARTS:
        parts = SANDWICH_PARTS[rest]
    elif f"model.layers.{layer}.self_attn.qkv_proj.weight" in state:
        parts = FUSED_PARTS.get(rest, HF_PARTS[rest])
    else:
        parts = HF_PARTS[rest]
    array = np.concatenate([state[f"model.layers.{layer}.{p}"].numpy() for p in parts], axis=0) + offset
    if spec is not None and spec.rotary_dim < spec.head_dim and rest == "attn.qkv.weight":
        # partial rotary: each q/k head's rows reordered so rotary pairs sit head_dim/2 apart (engine/rope.py)
        order = rotary_row_order(spec.head_dim, spec.rotary_dim)
        qk = array[: spec.q_size + spec.kv_size].reshape(-1, spec.head_dim, array.shape[1])[:, order]
        array = np.concatenate([qk.reshape(-1, array.shape[1]), array[spec.q_size + spec.kv_size :]])
    return array


EXPECTED_FEATURES = {
    "llama": dict(qkv_bias=False, qk_norm=False, sliding_window=None, tie_word_embeddings=False, num_kv_heads=2, rope="linear"),
    "llama3": dict(qkv_bias=False, qk_norm=False, sliding_window=None, tie_word_embeddings=True, num_kv_heads=1, rope="llama3"),
    "mistral": dict(qkv_bias=False, qk_norm=False, sliding_window=16, tie_word_embeddings=False, num_kv_heads=2, rope=None),
    "qwen2": dict(qkv_bias=True, qk_norm=False, sliding_window=8, tie_word_embeddings=True, num_kv_heads=2, rope="yarn"),
    "qwen3": dict(qkv_bias=False, qk_norm=True, sliding_window=None, tie_word_embeddings=False, num_kv_heads=2, rope="yarn"),
    "phi3": dict(qkv_bias=False, qk_norm=False, sliding_window=24, tie_word_embeddings=False, num_kv_heads=2, rope="longrope"),
    "phi4mini": dict(qkv_bias=False, qk_norm=False, sliding_window=None, tie_word_embeddings=True, num_kv_heads=1, rope="longrope"),
    "mixtral": dict(qkv_bias=False, qk_norm=False, sliding_window=None, tie_word_embeddings=False, num_kv_heads=2, rope=None),
    "qwen2_moe": dict(qkv_bias=True, qk_norm=False, sliding_window=None, tie_word_embeddings=True, num_kv_heads=2, rope=None),
    "qwen3_moe": dict(qkv_bias=False, qk_norm=True, sliding_window=None, tie_word_embeddings=False, num_kv_heads=2, rope=None),
    "gemma2": dict(qkv_bias=False, qk_norm=False, sliding_window=8, tie_word_embeddings=True, num_kv_heads=2, rope=None),
    "gemma3": dict(qkv_bias=False, qk_norm=True, sliding_window=8, tie_word_embeddings=False, num_kv_heads=1, rope="linear"),
}


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_build_and_reload_fp32(name, tiny_checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = tiny_checkpoints[name]
    result = build_engine(BuildOptions(ckpt, tmp_path / "engine", progress=False))
    engine = load_engine(tmp_path / "engine")
    spec = engine.config.model
    assert engine.config == result.config
    want = EXPECTED_FEATURES[name]
    assert spec.qkv_bias == want["qkv_bias"] and spec.qk_norm == want["qk_norm"]
    assert spec.sliding_window == want["sliding_window"]
    assert spec.tie_word_embeddings == want["tie_word_embeddings"] and spec.num_kv_heads == want["num_kv_heads"]
    assert (spec.rope_scaling.rope_type if spec.rope_scaling else None) == want["rope"]
    assert engine.config.dtype == "float32"

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    state = model.state_dict()
    assert spec.num_parameters() == sum(p.numel() for p in model.parameters())
    for tensor_name in engine.weights.tensors:
        want_tensor = hf_reference(state, tensor_name, spec)
        np.testing.assert_array_equal(engine.weights.read(tensor_name), want_tensor, err_msg=tensor_name)
    # The engine's RoPE frequencies are the ones transformers uses (zero beyond a partial rotary dimension; longrope:
    # its short factors, which transformers' buffer holds; tests/runtime/test_model_vs_hf.py checks the long ones).
    # Gemma 3: one RoPE per layer kind (full_attention_inv_freq, sliding_attention_inv_freq).
    rotary = model.model.rotary_emb
    kinds = [("", False)] if hasattr(rotary, "inv_freq") else [("full_attention_", False), ("sliding_attention_", True)]
    for prefix, local in kinds:
        inv_freq, attention_factor = rope_parameters(spec, local=local)
        theirs = getattr(rotary, prefix + "inv_freq").numpy()
        assert spec.rotary_dim == 2 * theirs.size and not inv_freq[theirs.size :].any()
        np.testing.assert_allclose(inv_freq[: theirs.size], theirs, rtol=1e-6)
        assert attention_factor == pytest.approx(getattr(rotary, prefix + "attention_scaling"))
    # Sliding-window layers are the ones transformers applies the window to.
    layer_types = getattr(model.config, "layer_types", None)
    if layer_types is not None:
        assert spec.sliding_window_layers == tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")


@pytest.mark.parametrize("dtype,torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_precision_rounds_like_torch(dtype, torch_dtype, tiny_checkpoints, tmp_path):
    ckpt = tiny_checkpoints["qwen2"]
    build_engine(BuildOptions(ckpt, tmp_path / "e", dtype=dtype, progress=False))
    engine = load_engine(tmp_path / "e")
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).state_dict()
    for name, info in engine.weights.tensors.items():
        ref = torch.from_numpy(hf_reference(state, name))
        got = engine.weights.read(name)
        if len(info.shape) == 1:  # norms and biases stay float32
            assert info.dtype == "F32"
            np.testing.assert_array_equal(got, ref.numpy())
        else:
            assert got.dtype.itemsize == 2
            np.testing.assert_array_equal(got.astype(np.float32), ref.to(torch_dtype).float().numpy(), err_msg=name)


def test_spec_round_trips_through_dict(tiny_checkpoints):
    import json

    for ckpt in tiny_checkpoints.values():
        config = json.loads((ckpt / "config.json").read_text())
        spec = find_architecture(config).to_spec(config)
        assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_old_style_rope_config_reads_the_same():
    """Configs written before transformers 5 use rope_theta + rope_scaling{type: ...}."""
    old = dict(TINY_CONFIGS["llama3"][1], architectures=["LlamaForCausalLM"], hidden_act="silu")
    params = old.pop("rope_parameters")
    old["rope_theta"] = params.pop("rope_theta")
    new = dict(old, rope_parameters=dict(params, rope_theta=old["rope_theta"]))
    old["rope_scaling"] = dict(params, type=params.pop("rope_type"))
    arch = find_architecture(old)
    assert arch.to_spec(old) == arch.to_spec(new)


def test_qwen2_without_use_sliding_window_ignores_window_value():
    config = dict(TINY_CONFIGS["qwen2"][1], architectures=["Qwen2ForCausalLM"], use_sliding_window=False)
    config.pop("layer_types", None)
    spec = find_architecture(config).to_spec(config)
    assert spec.sliding_window is None and spec.sliding_window_layers == ()


def test_gemma_configs_written_before_transformers_5_read_the_same():
    """Older Gemma 3 configs: rope_theta + rope_scaling for global layers, rope_local_base_freq, sliding_window_pattern
    instead of layer_types; older Gemma 2 configs: no layer_types (every other layer slides, from layer 0)."""
    new = dict(TINY_CONFIGS["gemma3"][1], architectures=["Gemma3ForCausalLM"], num_hidden_layers=7)
    new["layer_types"] = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(7)]
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old.update(
        rope_theta=1000000.0, rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_local_base_freq=10000.0, sliding_window_pattern=3
    )
    arch = find_architecture(new)
    assert arch.to_spec(old) == arch.to_spec(new)
    assert arch.to_spec(new).sliding_window_layers == (0, 1, 3, 4, 6)
    gemma2 = dict(TINY_CONFIGS["gemma2"][1], architectures=["Gemma2ForCausalLM"])
    assert find_architecture(gemma2).to_spec(gemma2).sliding_window_layers == (0, 2)


@pytest.mark.parametrize("hidden", [64, 640, 2304, 3840])
@pytest.mark.parametrize("dtype,torch_dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_gemma_embedding_scale_is_rounded_like_transformers(hidden, dtype, torch_dtype):
    """transformers multiplies embeddings by sqrt(hidden) cast to the weights' dtype (bf16: 25.298 -> 25.25 for 640)."""
    config = dict(TINY_CONFIGS["gemma2"][1], architectures=["Gemma2ForCausalLM"], hidden_size=hidden)
    spec = find_architecture(config).to_spec(config)
    assert spec.embedding_scale(numpy_dtype(dtype)) == torch.tensor(hidden**0.5).to(torch_dtype).item()


@pytest.mark.parametrize(
    "name,experts,top_k,renormalize,layers,shared",
    [("mixtral", 8, 2, True, (0, 1, 2), 0), ("qwen2_moe", 6, 2, False, (0, 2), 64), ("qwen3_moe", 16, 4, True, (1,), 0)],
)
def test_mixture_of_experts_specs(name, experts, top_k, renormalize, layers, shared, tiny_checkpoints):
    """The routing rule and sparse layers of each family, and the active parameters one token uses."""
    import json

    config = json.loads((tiny_checkpoints[name] / "config.json").read_text())
    spec = find_architecture(config).to_spec(config)
    assert (spec.num_experts, spec.experts_per_token, spec.moe_renormalize) == (experts, top_k, renormalize)
    assert spec.moe_layers == layers and spec.shared_expert_intermediate_size == shared
    unused = (experts - top_k) * 3 * spec.hidden_size * spec.moe_intermediate_size * len(layers)
    assert spec.num_parameters() - spec.num_parameters(active=True) == unused


def test_inspect_shows_the_mixture_and_gemma_blocks(tiny_engines):
    from precast.builder.inspect import engine_summary, format_summary

    text = format_summary(engine_summary(load_engine(tiny_engines["qwen2_moe"])))
    assert "mixture of 6 experts of 32 in 2 layers, top 2, shared expert of 64" in text
    assert "active per token" in text
    text = format_summary(engine_summary(load_engine(tiny_engines["gemma2"])))
    assert "gated gelu_tanh; sandwich norms, embeddings x 8" in text and "scores soft-capped at 4, logits soft-capped at 10" in text
    text = format_summary(engine_summary(load_engine(tiny_engines["gemma3"])))
    assert "sliding layers theta 10000" in text


def test_gemma3_image_text_config_without_text_config_is_refused():
    from precast.errors import PrecastError

    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}
    with pytest.raises(PrecastError, match="lacks text_config"):
        find_architecture(config).to_spec(config)
    assert "Gemma3ForConditionalGeneration" in supported_names()
