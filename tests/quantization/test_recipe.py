"""Which layers a recipe quantizes, the options' checks, and the engine config's quant section."""

from __future__ import annotations

import pytest

from precast.engine.spec import ModelSpec
from precast.errors import PrecastError
from precast.quantization.recipe import QuantOptions, plan_layers


def spec(hidden: int = 576, inter: int = 1536, tied: bool = True) -> ModelSpec:
    return ModelSpec(
        architecture="llama",
        vocab_size=1000,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=2,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        norm_eps=1e-5,
        activation="silu",
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=2048,
        qkv_bias=False,
        qk_norm=False,
        sliding_window=None,
        sliding_window_layers=(),
        tie_word_embeddings=tied,
    )


def test_default_plan_covers_every_linear_but_not_the_head():
    plan = plan_layers(spec(), QuantOptions(recipe="fp8"))
    assert sorted(plan) == sorted(f"layers.{i}.{k}" for i in range(2) for k in ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down"))
    assert plan_layers(spec(), QuantOptions()) == {}


def test_lm_head_option_quantizes_the_tied_embedding_or_the_head():
    assert "embed" in plan_layers(spec(tied=True), QuantOptions(recipe="nvfp4", quantize_lm_head=True))
    assert "lm_head" in plan_layers(spec(tied=False), QuantOptions(recipe="nvfp4", quantize_lm_head=True))


def test_int4_group_defaults_to_64_or_32():
    plan = plan_layers(spec(), QuantOptions(recipe="int4_awq"))
    assert plan["layers.0.attn.qkv"].group_size == 64  # 576 = 64 x 9
    assert plan["layers.0.mlp.down"].group_size == 64  # 1536
    assert plan_layers(spec(), QuantOptions(recipe="int4_awq", group_size=32))["layers.0.mlp.down"].group_size == 32
    # asymmetric groups (a scale and an offset each) unless asked for symmetric ones
    assert all(p.asymmetric for p in plan_layers(spec(), QuantOptions(recipe="int4_awq")).values())
    assert not any(p.asymmetric for p in plan_layers(spec(), QuantOptions(recipe="int4_awq", asymmetric=False)).values())


def test_exclude_patterns():
    plan = plan_layers(spec(), QuantOptions(recipe="fp8", exclude=("layers.0.*", "*.mlp.down")))
    assert sorted(plan) == ["layers.1.attn.o", "layers.1.attn.qkv", "layers.1.mlp.gate_up"]
    with pytest.raises(PrecastError, match="matches no layer.*layers.0.attn.qkv"):
        plan_layers(spec(), QuantOptions(recipe="fp8", exclude=("model.layers.0.self_attn.q_proj",)))


def test_shape_the_format_cannot_take_names_the_layer():
    odd = spec(hidden=64, inter=40)
    with pytest.raises(PrecastError, match=r"layer layers.0.mlp.down \(64x40\) cannot be stored as nvfp4.*multiple of 16.*--exclude"):
        plan_layers(odd, QuantOptions(recipe="nvfp4"))
    plan = plan_layers(odd, QuantOptions(recipe="nvfp4", skip_unsupported=True))
    assert "layers.0.mlp.down" not in plan and "layers.0.mlp.gate_up" in plan
    with pytest.raises(PrecastError, match="not divisible by 32, 64 or 128"):
        plan_layers(odd, QuantOptions(recipe="int4_awq"))
    with pytest.raises(PrecastError, match="--group-size 80 does not divide"):
        plan_layers(spec(), QuantOptions(recipe="int4_awq", group_size=80))


@pytest.mark.parametrize(
    "options,message",
    [
        (QuantOptions(recipe="int8"), "unknown --quant 'int8'.*fp8, nvfp4, int4_awq"),
        (QuantOptions(kv_cache_dtype="int8"), "--kv-cache-dtype 'int8' is not supported.*auto, fp8"),
        (QuantOptions(recipe="fp8", group_size=64), "--group-size applies to --quant int4_awq only"),
        (QuantOptions(recipe="int4_awq", group_size=7), "even number"),
        (QuantOptions(recipe="fp8", asymmetric=False), "--symmetric applies to --quant int4_awq only"),
        (QuantOptions(quantize_lm_head=True), "needs a --quant recipe"),
        (QuantOptions(recipe="fp8", calib_text="/nonexistent/calib.txt"), "--calib-text /nonexistent/calib.txt does not exist"),
        (QuantOptions(recipe="fp8", calib_samples=0), "--calib-samples must be >= 1"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(PrecastError, match=message):
        options.check()


def test_named_recipe_variants_are_valid_options():
    from precast.quantization.recipe import RECIPE_VARIANTS, parse_recipe_variant

    assert parse_recipe_variant("int4_awq") == ("int4_awq", {})
    for name in RECIPE_VARIANTS:
        recipe, fields = parse_recipe_variant(name)
        QuantOptions(recipe=recipe, **fields).check()  # every variant is a set of options its recipe takes
    assert parse_recipe_variant("int4_awq:symmetric") == ("int4_awq", {"asymmetric": False})
    with pytest.raises(PrecastError, match="unknown recipe variant 'fp8:g32'; known: fp8:dynamic"):
        parse_recipe_variant("fp8:g32")
