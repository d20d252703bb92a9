"""Quantized engines end to end on tiny random models: build (calibration through the CPU runner),
load, and run, checked against transformers running the same dequantized weights with the recipe's
activation quantization applied to every linear input by hooks."""

from __future__ import annotations

import copy
import functools
import json
import shutil
import types

import ml_dtypes
import numpy as np
import pytest
import torch

from precast import _C
from precast.builder.build import BuildOptions, build_engine
from precast.engine.directory import load_engine
from precast.engine.formats import (
    Int4Tensor,
    Nvfp4Tensor,
    fake_quant_fp8_activation,
    fake_quant_fp8_dynamic,
    fake_quant_nvfp4_activation,
    quantize_int4,
    quantize_nvfp4,
)
from precast.engine.quant import SIDE_TENSOR_SUFFIXES, Fp8Layer
from precast.engine.rope import rotary_row_order
from precast.engine.safetensors_file import SafetensorsWriter
from precast.engine.tensors import linear_shapes
from precast.errors import PrecastError
from precast.quantization import awq
from precast.quantization.quantize import fold_awq
from precast.quantization.recipe import QuantOptions, parse_recipe_variant
from precast.runtime.cpu_backend import make_cpu_runner
from tests.conftest import TINY_CONFIGS, make_tiny_model

RNG = np.random.default_rng(3)
CALIB = tuple(tuple(RNG.integers(0, 128, 48).tolist()) for _ in range(4))
PROMPT = RNG.integers(0, 128, 40).tolist()

HF_LINEARS = {
    "attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.o": ("self_attn.o_proj",),
    "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down": ("mlp.down_proj",),
}
# Phi-3 modules hold q|k|v and gate|up fused, as the engine does.
FUSED_LINEARS = {**HF_LINEARS, "attn.qkv": ("self_attn.qkv_proj",), "mlp.gate_up": ("mlp.gate_up_proj",)}


def dequantized(engine, layer: str, entry: dict) -> np.ndarray:
    rows, cols = linear_shapes(engine.config.model)[layer]
    values = engine.weights.read(f"{layer}.weight")
    if entry["format"] == "fp8":
        return values.astype(np.float32) * np.float32(entry["weight_scale"])
    scales = engine.weights.read(f"{layer}.weight_scale")
    if entry["format"] == "nvfp4":
        return Nvfp4Tensor(values, scales, entry["weight_global_scale"], (rows, cols)).dequantize()
    offsets = engine.weights.read(f"{layer}.weight_offset") if entry.get("asymmetric") else None
    return Int4Tensor(values, scales, int(entry["group_size"]), offsets).dequantize()


def quantize_input(x: torch.Tensor, entry: dict | None, bf16_inputs: bool = False, int8_int4: bool = True) -> torch.Tensor:
    """x as a layer whose record is `entry` quantizes its input (fp8 static or per token, nvfp4 dynamic); int4 and
    unquantized layers take it as it is, or rounded to bf16 where they multiply on a bf16 dot-product unit
    (`bf16_inputs`), int4 quantized to int8 per group where that unit multiplies int4 in int8 (int8_inputs below;
    `int8_int4=False` keeps bf16 there)."""
    if entry is not None and entry["format"] == "int4" and bf16_inputs and int8_int4 and _C.int4_multiplies_in_int8(_C.dot_unit()):
        return int8_inputs(x, entry["group_size"])
    if entry is None or entry["format"] == "int4":
        return x.to(torch.bfloat16).to(torch.float32) if bf16_inputs else x
    flat = x.detach().numpy().reshape(-1, x.shape[-1])
    if entry["format"] == "fp8" and entry.get("input_scales") == "dynamic":
        q = fake_quant_fp8_dynamic(flat)
    elif entry["format"] == "fp8":
        q = fake_quant_fp8_activation(flat, entry["input_scale"])
    else:
        q = fake_quant_nvfp4_activation(flat, entry["input_global_scale"])
    return torch.from_numpy(q).reshape(x.shape)


def int8_inputs(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as int4 layers on int8 dot products see it (plugins/cpu/int8_gemm.h): per row and group of `group` inputs,
    round(x x 127 / amax) (nearest even) x amax / 127, in float32."""
    groups = x.reshape(*x.shape[:-1], -1, group).to(torch.float32)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / torch.where(amax > 0, amax, 1.0), 0.0)
    return (torch.round(groups * inverse) * (amax / 127.0)).reshape(x.shape)


def moe_state(state: dict[str, torch.Tensor], hf_state: dict[str, torch.Tensor], spec) -> None:
    """Engine mixture tensors -> transformers' in-memory names: experts stacked into gate_up_proj [E, 2 mi, hidden]
    and down_proj [E, hidden, mi], the router as mlp.gate, the shared expert's gate_up split."""
    for i in spec.moe_layers:
        p, q = f"layers.{i}.moe.", f"model.layers.{i}.mlp."
        hf_state[q + "gate.weight"] = state[p + "router.weight"]
        for part in ("gate_up", "down"):
            stacked = [state[f"{p}experts.{e}.{part}.weight"] for e in range(spec.num_experts)]
            hf_state[q + f"experts.{part}_proj"] = torch.stack(stacked)
        if spec.shared_expert_intermediate_size:
            gate, up = torch.split(state[p + "shared.gate_up.weight"], spec.shared_expert_intermediate_size)
            hf_state[q + "shared_expert.gate_proj.weight"], hf_state[q + "shared_expert.up_proj.weight"] = gate, up
            hf_state[q + "shared_expert.down_proj.weight"] = state[p + "shared.down.weight"]
            hf_state[q + "shared_expert_gate.weight"] = state[p + "shared_gate.weight"]


def quantizing_experts_forward(layers: dict, i: int, quantize):
    """transformers' expert loop (per routed expert: gate_up, act, down, weighted index_add) with each expert's inputs
    quantized as its records say: what the engine's experts compute."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token_idx, slot = torch.where(top_k_index == e)
            if len(token_idx) == 0:
                continue
            name = f"layers.{i}.moe.experts.{e}."
            x = quantize(hidden_states[token_idx], layers.get(name + "gate_up"))
            gate, up = torch.nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            h = quantize(self.act_fn(gate) * up, layers.get(name + "down"))
            y = torch.nn.functional.linear(h, self.down_proj[e]) * top_k_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y)
        return out

    return forward


def hf_twin(engine, checkpoint, bf16_inputs: bool = False, int8_int4: bool = True):
    """A transformers model of the checkpoint's config holding the engine's weights (dequantized),
    with hooks that quantize every quantized layer's input as the recipe defines (quantize_input)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # from_config, not from_pretrained (which modelopt patches once imported): every weight is replaced below.
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint), dtype=torch.float32).eval()
    spec = engine.config.model
    linears = FUSED_LINEARS if model.config.model_type == "phi3" else HF_LINEARS
    # partial rotary: the engine stores each q/k head's rows in rotary-pair order; undo it for transformers
    head_order = np.argsort(rotary_row_order(spec.head_dim, spec.rotary_dim))
    qk_rows = (np.arange(spec.num_heads + spec.num_kv_heads)[:, None] * spec.head_dim + head_order).reshape(-1)
    unpermute = np.concatenate([qk_rows, np.arange(spec.q_size + spec.kv_size, spec.q_size + 2 * spec.kv_size)])
    layers = engine.config.quant.to_dict().get("layers", {})
    state = {}
    for name in engine.weights.tensors:
        if name.endswith(SIDE_TENSOR_SUFFIXES):
            continue
        layer = name[: -len(".weight")]
        array = dequantized(engine, layer, layers[layer]) if layer in layers else engine.weights.read(name).astype(np.float32)
        if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
            array = array[unpermute]
        state[name] = torch.from_numpy(np.ascontiguousarray(array))
    hf_state = {}
    sizes = {"attn.qkv": [spec.q_size, spec.kv_size, spec.kv_size], "mlp.gate_up": [spec.intermediate_size] * 2}
    simple = {
        "attn_norm.weight": "input_layernorm.weight",
        "mlp_norm.weight": "post_attention_layernorm.weight",
        "attn.q_norm.weight": "self_attn.q_norm.weight",
        "attn.k_norm.weight": "self_attn.k_norm.weight",
        "attn.o.weight": "self_attn.o_proj.weight",
        "mlp.down.weight": "mlp.down_proj.weight",
    }
    gemma = spec.sandwich_norms  # four norms per layer, each multiplying by 1 + w (the engine stores 1 + w)
    if gemma:
        simple.update(
            {
                "post_attn_norm.weight": "post_attention_layernorm.weight",
                "mlp_norm.weight": "pre_feedforward_layernorm.weight",
                "post_mlp_norm.weight": "post_feedforward_layernorm.weight",
            }
        )
        state = {n: t - 1.0 if n.endswith("norm.weight") else t for n, t in state.items()}
    moe_state(state, hf_state, spec)  # a mixture's tensors, in transformers' fused in-memory layout
    for name, t in state.items():
        if ".moe." in name:
            continue
        if name == "embed.weight":
            hf_state["model.embed_tokens.weight"] = t
            if spec.tie_word_embeddings:
                hf_state["lm_head.weight"] = t
        elif name == "final_norm.weight":
            hf_state["model.norm.weight"] = t
        elif name == "lm_head.weight":
            hf_state["lm_head.weight"] = t
        else:
            _, i, rest = name.split(".", 2)
            p = f"model.layers.{i}."
            if rest in simple:
                hf_state[p + simple[rest]] = t
            else:
                kind, what = rest.rsplit(".", 1)
                chunks = torch.split(t, sizes[kind], dim=0) if len(linears[kind]) > 1 else (t,)
                for part, chunk in zip(linears[kind], chunks):
                    hf_state[f"{p}{part}.{what}"] = chunk
    model.load_state_dict(hf_state, strict=True)

    quantize = functools.partial(quantize_input, bf16_inputs=bf16_inputs, int8_int4=int8_int4)

    def hook_for(entry):
        def hook(module, args):
            return (quantize(args[0], entry),)

        return hook

    for i in spec.moe_layers:
        experts = model.get_submodule(f"model.layers.{i}.mlp.experts")
        experts.forward = types.MethodType(quantizing_experts_forward(layers, i, quantize), experts)
    if bf16_inputs and "lm_head" not in layers and "embed" not in layers:
        model.lm_head.register_forward_pre_hook(hook_for(None))
    for layer, entry in layers.items():
        if (entry["format"] == "int4" and not bf16_inputs) or ".moe.experts." in layer:
            continue
        if ".moe.shared." in layer:
            _, i, rest = layer.split(".", 2)
            part = {"moe.shared.gate_up": ("gate_proj", "up_proj"), "moe.shared.down": ("down_proj",)}[rest]
            for name in part:
                model.get_submodule(f"model.layers.{i}.mlp.shared_expert.{name}").register_forward_pre_hook(hook_for(entry))
            continue
        if layer in ("embed", "lm_head"):
            model.lm_head.register_forward_pre_hook(hook_for(entry))
            continue
        _, i, kind = layer.split(".", 2)
        for part in linears[kind]:
            model.get_submodule(f"model.layers.{i}.{part}").register_forward_pre_hook(hook_for(entry))
    return model


CASES = [  # recipe[:variant] (precast.quantization.recipe.RECIPE_VARIANTS)
    ("llama", "fp8", False),
    ("qwen2", "fp8:dynamic", False),
    ("mixtral", "fp8:dynamic", True),
    ("qwen2", "fp8", True),
    ("llama3", "nvfp4", True),
    ("qwen3", "nvfp4", False),
    ("mistral", "int4_awq", False),
    ("llama3", "int4_awq", True),
    ("qwen2", "int4_awq:symmetric", True),
    ("phi4mini", "fp8", True),
    ("phi3", "nvfp4", False),
    ("phi4mini", "int4_awq", False),
    ("gemma2", "fp8", True),
    ("gemma2", "int4_awq", False),
    ("gemma3", "nvfp4", True),
    ("gemma3", "int4_awq", False),
    ("mixtral", "fp8", False),
    ("qwen2_moe", "nvfp4", True),
    ("qwen3_moe", "int4_awq", False),
    ("qwen2_moe", "int4_awq", False),
]


@pytest.mark.parametrize("name,recipe,lm_head", CASES)
def test_quantized_engine_matches_transformers_on_the_same_quantization(name, recipe, lm_head, tiny_checkpoints, tmp_path):
    out = tmp_path / "engine"
    variant = recipe.partition(":")[2]
    recipe, fields = parse_recipe_variant(recipe)
    build_engine(
        BuildOptions(
            tiny_checkpoints[name],
            out,
            max_seq_len=256,  # longrope (phi): within the original context, as transformers runs a 40-token prompt
            progress=False,
            quant=QuantOptions(recipe=recipe, quantize_lm_head=lm_head, calib_tokens=CALIB, **fields),
        )
    )
    engine = load_engine(out)
    q = engine.config.quant.to_dict()
    assert q["recipe"] == recipe and q["lm_head"] == lm_head
    assert len(q["layers"]) == len(linear_shapes(engine.config.model)) - 1 + lm_head
    assert q["calibration"]["samples"] == len(CALIB)
    stored = {"fp8": "F8_E4M3", "nvfp4": "U8", "int4_awq": "U8"}[recipe]
    first_down = next(n for n in linear_shapes(engine.config.model) if n.endswith(".down"))  # an expert's in a mixture
    assert engine.weights.tensors[f"{first_down}.weight"].dtype == stored
    if recipe == "int4_awq":
        shapes = linear_shapes(engine.config.model)
        assert all(entry["group_size"] == {32: 32, 64: 64, 96: 32, 128: 64}[shapes[layer][1]] for layer, entry in q["layers"].items())
        assert any(entry["awq"] for entry in q["layers"].values())
        # every layer with calibration rows (not an expert no calibration token reached) has searched group scales
        assert all(entry["scale_search"] for layer, entry in q["layers"].items() if ".moe.experts." not in layer)
        asymmetric = variant != "symmetric"
        assert all(entry["asymmetric"] == asymmetric for entry in q["layers"].values())
        assert all((f"{layer}.weight_offset" in engine.weights.tensors) == asymmetric for layer in q["layers"])
    if recipe == "nvfp4":
        assert all(entry["scale_search"] for layer, entry in q["layers"].items() if ".moe.experts." not in layer)
    if recipe == "fp8":
        dynamic = variant == "dynamic"
        assert all(
            (entry.get("input_scales") == "dynamic") == dynamic and ("input_scale" in entry) != dynamic for entry in q["layers"].values()
        )
    runner = make_cpu_runner(engine, num_threads=2)
    ours = runner.evaluate(PROMPT, True)
    with torch.no_grad():
        theirs = hf_twin(engine, tiny_checkpoints[name])(torch.tensor([PROMPT])).logits[0].numpy()
    # Same quantized values on both sides; what differs is float32 summation order, which can
    # move an activation across a rounding boundary now and then.
    scale = np.abs(theirs).max()
    assert np.median(np.abs(ours - theirs)) < 1e-4 * scale
    assert np.abs(ours - theirs).max() < 5e-2 * scale
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.95


@pytest.mark.parametrize("precision", ["weights", "float32"])
def test_a_bf16_int4_engine_multiplies_at_its_matmul_precision(precision, tiny_checkpoints, tmp_path):
    """In a bf16 engine, int4 layers and the bf16 LM head take bf16-rounded inputs on the chip's dot-product unit
    (matmul precision "weights" where the host has one): transformers with those inputs rounded computes the same."""
    out = tmp_path / "engine"
    quant = QuantOptions(recipe="int4_awq", calib_tokens=CALIB)
    build_engine(BuildOptions(tiny_checkpoints["llama"], out, dtype="bfloat16", max_seq_len=256, progress=False, quant=quant))
    engine = load_engine(out)
    ours = make_cpu_runner(engine, num_threads=2, matmul_precision=precision).evaluate(PROMPT, True)
    on_unit = precision == "weights" and _C.dot_unit() != "float32"
    with torch.no_grad():
        theirs = hf_twin(engine, tiny_checkpoints["llama"], bf16_inputs=on_unit)(torch.tensor([PROMPT])).logits[0].numpy()
        other = hf_twin(engine, tiny_checkpoints["llama"], bf16_inputs=not on_unit)(torch.tensor([PROMPT])).logits[0].numpy()
    scale = np.abs(theirs).max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.95
    assert np.median(np.abs(other - theirs)) > 1e-3 * scale  # the rounding shows: the check can tell the two apart
    if on_unit and _C.int4_multiplies_in_int8(_C.dot_unit()):
        # int8 inputs (int8_gemm.h): a summation-order difference that moves a group's amax or one value across a
        # rounding boundary changes a whole int8 step, so the twins drift apart along the sequence (the first
        # position agrees exactly); the int8 twin stays far closer than the bf16-input one.
        with torch.no_grad():
            bf16_twin = (
                hf_twin(engine, tiny_checkpoints["llama"], bf16_inputs=True, int8_int4=False)(torch.tensor([PROMPT])).logits[0].numpy()
            )
        np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-5 * scale)
        assert np.median(np.abs(ours - theirs)) < 2e-3 * scale
        assert np.median(np.abs(ours - theirs)) < 0.25 * np.median(np.abs(ours - bf16_twin))
    else:
        assert np.median(np.abs(ours - theirs)) < 1e-4 * scale


def test_awq_folding_preserves_the_full_precision_model(tiny_checkpoints, tmp_path):
    """x s on each layer's inputs and / s where the inputs are made is exact arithmetic: with random
    scales on every foldable layer (V rows too, in a model where each query head has its own V head),
    the folded full-precision engine computes the same logits."""
    arch, kwargs = TINY_CONFIGS["qwen2"]  # qkv bias: the V bias is divided too
    mha = make_tiny_model(arch, dict(kwargs, num_key_value_heads=kwargs["num_attention_heads"]))
    mha.save_pretrained(tmp_path / "ckpt")
    build_engine(BuildOptions(tmp_path / "ckpt", tmp_path / "full", progress=False))
    full = load_engine(tmp_path / "full")
    spec = full.config.model
    targets = awq.fold_targets(spec, 0)
    assert all(targets.values()), "every layer foldable when heads are not grouped"
    shapes = linear_shapes(spec)
    scales = {
        layer: awq.AwqScale(RNG.uniform(0.5, 2.0, shapes[layer][1]).astype(np.float32), 0.5, 0.0, 0.0)
        for i in range(spec.num_layers)
        for layer in awq.fold_targets(spec, i)
    }
    shutil.copytree(tmp_path / "full", tmp_path / "folded")
    layout = [(n, full.weights.read(n).dtype, info.shape) for n, info in full.weights.tensors.items()]
    with open(tmp_path / "folded" / "weights.safetensors", "wb") as f:
        writer = SafetensorsWriter(f, layout, metadata={})
        for name, _, _ in layout:
            writer.write(name, fold_awq(name, full.weights.read(name), scales, spec.q_size, spec.kv_size).astype(np.float32))
        writer.finish()
    a = make_cpu_runner(full).evaluate(PROMPT, True)
    b = make_cpu_runner(load_engine(tmp_path / "folded")).evaluate(PROMPT, True)
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())


def test_awq_round_trip_is_the_int4_format():
    w = RNG.standard_normal((48, 192)).astype(np.float32)
    np.testing.assert_array_equal(awq.int4_round_trip(w, 64), quantize_int4(w, 64).dequantize())
    np.testing.assert_array_equal(awq.int4_round_trip(w, 64, True), quantize_int4(w, 64, asymmetric=True).dequantize())


@pytest.mark.parametrize("asymmetric", [False, True])
def test_awq_search_round_trip_kernel_is_bit_exact(asymmetric):
    """_C.int4_round_trip_scaled (one pass, threaded) computes exactly int4_round_trip(w * s) / s."""
    from precast import _C

    w = RNG.standard_normal((37, 256)).astype(np.float32)
    w[3, :64] = 0  # an all-zero group: scale 0
    w[5, :64] = np.arange(64, dtype=np.float32) / 63 * 7  # integers and halves after scaling: ties to even
    w[6, 64:128] = -np.linspace(0, 8.5, 64, dtype=np.float32)  # the scale from the most negative value (-7 at most)
    s = (RNG.random(256) + 0.25).astype(np.float32)
    s[:64] = 1
    w[7, 128:192] += 3  # a group far from zero: asymmetric groups shift to it
    reference = awq.int4_round_trip(w * s, 64, asymmetric) / s
    for threads in (1, 3):
        np.testing.assert_array_equal(_C.int4_round_trip_scaled(w, s, 64, threads, asymmetric), reference)
    with pytest.raises(ValueError, match="group_size"):
        _C.int4_round_trip_scaled(w, s, 100)


def test_group_scale_search_never_loses_to_the_plain_scale():
    """Each group's searched scale has at most the plain scale's input-weighted error (the plain one is a candidate),
    the codes follow the format's rounding for it, and on inputs with salient channels the layer's output error
    drops well below round-to-nearest's."""
    rows, cols, g = 96, 256, 64
    w = RNG.standard_normal((rows, cols)).astype(np.float32)
    w[0, :64] = 0  # an all-zero group keeps scale 0
    w[1, :8] *= 12  # a group with outlier weights: clipping them pays
    x = RNG.standard_normal((512, cols)).astype(np.float32)
    x[:, 3:7] *= 20  # a few salient input channels
    scales, offsets = awq.search_group_scales(w, x, g, num_threads=2)
    assert scales.shape == (rows, cols // g) and scales[0, 0] == 0 and offsets is None
    plain = quantize_int4(w, g)
    searched = quantize_int4(w, g, scales)
    np.testing.assert_array_equal(searched.scales, scales)
    codes = np.clip(np.rint(w.reshape(rows, -1, g) / np.where(scales > 0, scales, 1)[:, :, None]), -8, 7)
    np.testing.assert_array_equal(searched.dequantize(), (codes * scales[:, :, None]).reshape(rows, cols))
    importance = np.mean(np.square(x, dtype=np.float64), axis=0)

    def group_errors(q) -> np.ndarray:
        return ((q.dequantize() - w) ** 2 * importance).reshape(rows, -1, g).sum(-1)

    assert (group_errors(searched) <= group_errors(plain) * (1 + 1e-5) + 1e-12).all()
    assert not np.array_equal(scales, plain.scales)  # smaller scales won somewhere
    out_err = lambda q: np.mean((x @ (q.dequantize() - w).T) ** 2)  # noqa: E731
    assert out_err(searched) < 0.9 * out_err(plain)
    with pytest.raises(ValueError, match="scales must be"):
        quantize_int4(w, g, scales[:, :2])
    with pytest.raises(ValueError, match="group_size"):
        awq.search_group_scales(w, x, 100)


def test_asymmetric_group_search_never_loses_to_the_plain_groups():
    """Each asymmetric group's searched (scale, offset) has at most the plain pair's input-weighted error (the plain
    pair is a candidate), the codes follow the format's rounding for them, the output error drops well below the plain
    pairs' on inputs with salient channels, and the result beats the searched symmetric groups."""
    rows, cols, g = 96, 256, 64
    w = RNG.standard_normal((rows, cols)).astype(np.float32) + 0.2
    w[0, :64] = 0.5  # a constant group keeps its plain pair (scale 0, offset the value)
    w[1, :8] *= 12  # a group with outliers
    x = RNG.standard_normal((512, cols)).astype(np.float32)
    x[:, 3:7] *= 20
    scales, offsets = awq.search_group_scales(w, x, g, asymmetric=True, num_threads=2)
    assert scales.shape == offsets.shape == (rows, cols // g)
    assert scales[0, 0] == 0 and offsets[0, 0] == 0.5
    plain = quantize_int4(w, g, asymmetric=True)
    searched = quantize_int4(w, g, scales, asymmetric=True, offsets=offsets)
    np.testing.assert_array_equal(searched.offsets, offsets)
    safe = np.where(scales > 0, scales, 1)[:, :, None]
    codes = np.clip(np.rint((w.reshape(rows, -1, g) - offsets[:, :, None]) / safe), -8, 7)
    np.testing.assert_array_equal(searched.dequantize(), (codes * scales[:, :, None] + offsets[:, :, None]).reshape(rows, cols))
    importance = np.mean(np.square(x, dtype=np.float64), axis=0)

    def group_errors(q) -> np.ndarray:
        return ((q.dequantize() - w) ** 2 * importance).reshape(rows, -1, g).sum(-1)

    assert (group_errors(searched) <= group_errors(plain) * (1 + 1e-5) + 1e-12).all()
    out_err = lambda q: np.mean((x @ (q.dequantize() - w).T) ** 2)  # noqa: E731
    assert out_err(searched) < 0.9 * out_err(plain)
    symmetric = quantize_int4(w, g, awq.search_group_scales(w, x, g)[0])
    assert out_err(searched) < 0.8 * out_err(symmetric)


def test_nvfp4_block_scale_search_never_loses_to_the_plain_scale():
    """Each block's searched scale is an E4M3 value with at most the plain scale's input-weighted error, and the
    weight stored with them has a clearly smaller output error on inputs with salient channels."""
    rows, cols = 64, 128
    w = RNG.standard_normal((rows, cols)).astype(np.float32)
    w[0, :16] = 0  # an all-zero block keeps scale 0
    x = RNG.standard_normal((512, cols)).astype(np.float32)
    x[:, 3:7] *= 20
    scales = awq.search_nvfp4_block_scales(w, x, num_threads=2)
    assert scales.shape == (rows, cols // 16) and scales[0, 0] == 0
    np.testing.assert_array_equal(scales.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), scales)
    plain, searched = quantize_nvfp4(w), quantize_nvfp4(w, block_scales=scales)
    assert searched.global_scale == plain.global_scale
    np.testing.assert_array_equal(searched.block_scales.astype(np.float32), scales)
    importance = np.mean(np.square(x, dtype=np.float64), axis=0)

    def block_errors(q) -> np.ndarray:
        return ((q.dequantize() - w) ** 2 * importance).reshape(rows, -1, 16).sum(-1)

    assert (block_errors(searched) <= block_errors(plain) * (1 + 1e-5) + 1e-12).all()
    out_err = lambda q: np.mean((x @ (q.dequantize() - w).T) ** 2)  # noqa: E731
    assert out_err(searched) < 0.9 * out_err(plain)
    with pytest.raises(ValueError, match="E4M3 values"):
        quantize_nvfp4(w, block_scales=scales + 0.01)
    with pytest.raises(ValueError, match="block scales must be"):
        quantize_nvfp4(w, block_scales=scales[:, :2])


def test_awq_search_never_loses_to_round_to_nearest():
    w = RNG.standard_normal((64, 128)).astype(np.float32)
    x = RNG.standard_normal((256, 128)).astype(np.float32)
    x[:, :4] *= 30  # a few salient input channels
    found = awq.search_scale(w, x, np.abs(x).mean(0), 32)
    assert found.error <= found.error_rtn
    assert found.alpha > 0 and found.error < 0.8 * found.error_rtn


def test_awq_coarse_to_fine_search_finds_the_full_grids_alpha():
    found_alphas = set()
    for count, factor in [(0, 1), (2, 50), (128, 0.05), (1, 5000)]:  # salient (or damped) input channels, their weight
        rng = np.random.default_rng(count)
        w = rng.standard_normal((96, 256)).astype(np.float32)
        x = rng.standard_normal((128, 256)).astype(np.float32) * (rng.random(256).astype(np.float32) * 3 + 0.1)
        x[:, rng.choice(256, count, replace=False)] *= factor
        mean_abs = np.abs(x).mean(0)
        errors = []
        for k in range(awq.GRID):  # the full grid, by definition
            s = np.maximum(mean_abs, 1e-4).astype(np.float32) ** np.float32(k / awq.GRID)
            s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
            errors.append(np.sum(np.square(x @ (awq.int4_round_trip(w * s, 64) / s).T - x @ w.T), dtype=np.float64))
        found = awq.search_scale(w, x, mean_abs, 64)
        assert found.alpha == int(np.argmin(errors)) / awq.GRID
        found_alphas.add(found.alpha)
    assert len(found_alphas) >= 3  # the cases do move alpha


def test_fp8_kv_cache_matches_transformers_with_quantized_k_and_v(tiny_checkpoints, tmp_path, monkeypatch):
    from transformers.models.llama import modeling_llama

    ckpt = tiny_checkpoints["llama"]
    build_engine(BuildOptions(ckpt, tmp_path / "full", progress=False))
    build_engine(BuildOptions(ckpt, tmp_path / "kv8", progress=False, quant=QuantOptions(kv_cache_dtype="fp8", calib_tokens=CALIB)))
    engine = load_engine(tmp_path / "kv8")
    assert engine.config.limits.kv_cache_dtype == "fp8" and engine.config.quant.recipe == "none"
    kv = engine.config.quant.to_dict()["kv_cache"]
    assert len(kv["k_scales"]) == engine.config.model.num_layers and min(kv["k_scales"] + kv["v_scales"]) > 0
    full = load_engine(tmp_path / "full")
    for name in full.weights.tensors:  # weights untouched: only the cache is E4M3
        np.testing.assert_array_equal(engine.weights.read(name), full.weights.read(name))
    runner = make_cpu_runner(engine)
    assert runner.kv_block_bytes(32) * 4 == make_cpu_runner(full).kv_block_bytes(32)
    ours = runner.evaluate(PROMPT, True)

    # transformers with K (after RoPE) and V rounded to E4M3 with the engine's per-layer scales.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    current = {"layer": 0}

    def fq(t, scale):
        return torch.from_numpy(fake_quant_fp8_activation(t.detach().numpy(), scale))

    rope = modeling_llama.apply_rotary_pos_emb

    def rope_then_quantize(q, k, *args, **kw):
        q, k = rope(q, k, *args, **kw)
        return q, fq(k, kv["k_scales"][current["layer"]])

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", rope_then_quantize)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(lambda m, a, k, i=i: current.update(layer=i), with_kwargs=True)
        layer.self_attn.v_proj.register_forward_hook(lambda m, a, out, i=i: fq(out, kv["v_scales"][i]))
    with torch.no_grad():
        theirs = model(torch.tensor([PROMPT])).logits[0].numpy()
        plain = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()(torch.tensor([PROMPT])).logits[0].numpy()
    scale = np.abs(theirs).max()
    assert np.abs(plain - theirs).max() > 1e-2 * scale  # the quantization is visible...
    assert np.median(np.abs(ours - theirs)) < 1e-4 * scale  # ...and precast's is the same
    assert np.abs(ours - theirs).max() < 5e-2 * scale


@pytest.mark.parametrize("recipe,activation_scales", [("nvfp4", "static"), ("fp8", "dynamic")])
def test_quantized_engine_generates_through_the_executor(recipe, activation_scales, tiny_checkpoints, tmp_path):
    """Batched greedy decoding equals the standalone runner's, token for token: run-time activation scales (nvfp4 per
    16 inputs, fp8 per token) depend on each row alone, whatever else is in the batch."""
    from precast import LLM, SamplingParams

    out = tmp_path / "engine"
    quant = QuantOptions(recipe=recipe, kv_cache_dtype="fp8", calib_tokens=CALIB, activation_scales=activation_scales)
    build_engine(BuildOptions(tiny_checkpoints["llama"], out, progress=False, quant=quant))
    runner = make_cpu_runner(load_engine(out))
    expected = []
    tokens = list(PROMPT)
    for _ in range(8):  # greedy by hand on the standalone runner
        nxt = int(runner.evaluate(tokens, True)[-1].argmax())
        expected.append(nxt)
        tokens.append(nxt)
    with LLM(out) as llm:
        result = llm.generate([PROMPT] * 3, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(r.token_ids == expected for r in result)


def test_bad_quantized_builds_and_engines(tiny_checkpoints, tmp_path):
    ckpt = tiny_checkpoints["llama"]
    for options, message in [
        (QuantOptions(recipe="int4_awq", activation_scales="dynamic"), "applies to --quant fp8 only"),
        (QuantOptions(recipe="fp8", activation_scales="per-block"), "choose from static, dynamic"),
        (QuantOptions(recipe="fp8", scale_search=False), "applies to --quant int4_awq and nvfp4 only"),
    ]:
        with pytest.raises(PrecastError, match=message):
            build_engine(BuildOptions(ckpt, tmp_path / "e0", progress=False, quant=options))
    # Per-token fp8 scales run on the CPU only: a TensorRT target is refused before any work, the GPU kernels'
    # weights too.
    dynamic = QuantOptions(recipe="fp8", activation_scales="dynamic", calib_tokens=CALIB)
    with pytest.raises(PrecastError, match="CPU backend only.*--activation-scales static"):
        build_engine(BuildOptions(ckpt, tmp_path / "e0", progress=False, quant=dynamic, targets=("cpu", "tensorrt")))
    with pytest.raises(PrecastError, match="CPU backend only"):
        Fp8Layer(weight_scale=1.0, input_scales="dynamic").device_arrays("layers.0.attn.o", lambda name: np.zeros((4, 4), np.uint8))
    assert Fp8Layer(weight_scale=1.0, input_scales="dynamic").problems("layers.0.attn.o", 4, 4) == []
    assert "unknown input_scales" in Fp8Layer(weight_scale=1.0, input_scales="per-row").problems("layers.0.attn.o", 4, 4)[0]
    with pytest.raises(PrecastError, match="needs a tokenizer"):  # tiny checkpoints have none: text cannot be read
        build_engine(BuildOptions(ckpt, tmp_path / "e1", progress=False, quant=QuantOptions(recipe="fp8")))
    with pytest.raises(PrecastError, match="outside the vocabulary"):
        build_engine(BuildOptions(ckpt, tmp_path / "e2", progress=False, quant=QuantOptions(recipe="fp8", calib_tokens=((1, 2, 500),))))
    assert not (tmp_path / "e1").exists() and not (tmp_path / "e2").exists()
    assert not list(tmp_path.glob(".e*"))  # no temporary directories left behind

    build_engine(BuildOptions(ckpt, tmp_path / "good", progress=False, quant=QuantOptions(recipe="fp8", calib_tokens=CALIB)))
    config_path = tmp_path / "good" / "config.json"
    original = json.loads(config_path.read_text())
    for mutate, message in [
        (lambda c: c["quant"].update(recipe="int3"), "recipe 'int3'"),
        (lambda c: c["quant"]["layers"]["layers.0.attn.o"].pop("input_scale"), "no valid input_scale"),
        (
            lambda c: c["quant"]["layers"]["layers.1.mlp.down"].update(format="nvfp4", weight_global_scale=1, input_global_scale=1),
            "layers.1.mlp.down.weight is F8_E4M3",
        ),
        (lambda c: c["quant"]["layers"].pop("layers.2.attn.qkv"), "layers.2.attn.qkv.weight is F8_E4M3"),
    ]:
        broken = json.loads(json.dumps(original))
        mutate(broken)
        config_path.write_text(json.dumps(broken))
        with pytest.raises(PrecastError, match=message):
            load_engine(tmp_path / "good")
    config_path.write_text(json.dumps(original))
    load_engine(tmp_path / "good")


def test_modelopt_fp8_export_builds_without_recalibration(tmp_path):
    """modelopt quantizes (FP8, max calibration) and exports an HF checkpoint on CPU; precast builds it
    with modelopt's values and scales and runs it as the recipe defines."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.export import export_hf_checkpoint
    from safetensors import safe_open

    arch, kwargs = TINY_CONFIGS["qwen2"]  # qkv bias, tied embeddings
    model = make_tiny_model(arch, kwargs)
    model.config.architectures = ["Qwen2ForCausalLM"]
    copy.deepcopy(model.config).save_pretrained(tmp_path / "plain")  # the twin's config (saving edits it: a copy)
    calib = torch.tensor(CALIB)
    model = mtq.quantize(model, mtq.FP8_DEFAULT_CFG, lambda m: [m(row[None]) for row in calib])
    export_hf_checkpoint(model, export_dir=tmp_path / "fp8")

    result = build_engine(BuildOptions(tmp_path / "fp8", tmp_path / "engine", progress=False))
    engine = load_engine(tmp_path / "engine")
    q = engine.config.quant.to_dict()
    assert result.config.quant.recipe == "fp8" and "not recalibrated" in q["source"] and "calibration" not in q
    assert len(q["layers"]) == 4 * engine.config.model.num_layers and not q["lm_head"]
    exported = safe_open(str(tmp_path / "fp8" / "model.safetensors"), "pt")

    def part(name: str) -> np.ndarray:
        values = exported.get_tensor(f"model.layers.1.{name}.weight").float().numpy()
        return values * exported.get_tensor(f"model.layers.1.{name}.weight_scale").item()

    # Unfused layers keep modelopt's bytes and scales exactly.
    down = exported.get_tensor("model.layers.1.mlp.down_proj.weight").view(torch.uint8).numpy()
    np.testing.assert_array_equal(engine.weights.read("layers.1.mlp.down.weight").view(np.uint8), down)
    entry = q["layers"]["layers.1.mlp.down"]
    assert entry["weight_scale"] == pytest.approx(exported.get_tensor("model.layers.1.mlp.down_proj.weight_scale").item(), rel=1e-7)
    assert entry["input_scale"] == pytest.approx(exported.get_tensor("model.layers.1.mlp.down_proj.input_scale").item(), rel=1e-7)
    # Fused layers: the parts on one shared scale, each value within one E4M3 step of modelopt's.
    fused = dequantized(engine, "layers.1.attn.qkv", q["layers"]["layers.1.attn.qkv"])
    parts = np.concatenate([part("self_attn.q_proj"), part("self_attn.k_proj"), part("self_attn.v_proj")])
    assert np.all(np.abs(fused - parts) <= np.abs(parts) * 2**-3 + 2**-9 * q["layers"]["layers.1.attn.qkv"]["weight_scale"])
    # The runner computes what the recipe defines on those values.
    ours = make_cpu_runner(engine).evaluate(PROMPT, True)
    with torch.no_grad():
        theirs = hf_twin(engine, tmp_path / "plain")(torch.tensor([PROMPT])).logits[0].numpy()
    scale = np.abs(theirs).max()
    assert np.median(np.abs(ours - theirs)) < 1e-4 * scale
    with pytest.raises(PrecastError, match="already quantized.*without --quant"):
        build_engine(BuildOptions(tmp_path / "fp8", tmp_path / "again", progress=False, quant=QuantOptions(recipe="nvfp4")))
