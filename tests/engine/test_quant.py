"""The engine config's typed quant section: reading, checking and writing it back unchanged."""

from __future__ import annotations

import pytest

from precast.engine.quant import QuantSection
from precast.errors import PrecastError
from tests.quantization.test_recipe import spec


def test_quant_section_checks():
    s = spec()
    good = {"recipe": "fp8", "layers": {"layers.0.attn.o": {"format": "fp8", "weight_scale": 0.1, "input_scale": 0.2}}}
    QuantSection.from_dict(good, s, "auto", "x")
    bad = [
        ({"recipe": "fp6"}, "auto", "recipe 'fp6'"),
        ({"recipe": "fp8", "layers": {"layers.9.attn.o": {"format": "fp8"}}}, "auto", "not a layer of this model"),
        ({"recipe": "fp8", "layers": {"layers.0.attn.o": {"format": "fp8", "weight_scale": 0.1}}}, "auto", "no valid input_scale"),
        ({"recipe": "fp8", "layers": {"layers.0.attn.o": {"format": "fp8", "weight_scale": -1, "input_scale": 1}}}, "auto", "weight_scale"),
        ({"recipe": "int4_awq", "layers": {"layers.0.attn.o": {"format": "int4", "group_size": 100}}}, "auto", "does not divide"),
        ({"recipe": "none"}, "fp8", "fp8 KV cache needs 2 positive k_scales"),
        ({"recipe": "none"}, "int8", "KV cache dtype 'int8'"),
    ]
    for quant, kv, message in bad:
        with pytest.raises(PrecastError, match=message):
            QuantSection.from_dict(quant, s, kv, "engine/config.json")


def test_every_format_reads_and_writes_back_unchanged():
    s = spec()
    section = {
        "recipe": "fp8",
        "lm_head": True,
        "exclude": ["layers.1.*"],
        "layers": {
            "layers.0.attn.o": {"format": "fp8", "weight_scale": 0.1, "input_scale": 0.2},
            "layers.0.attn.qkv": {"format": "fp8", "weight_scale": 0.1, "input_scales": "dynamic"},
            "layers.0.mlp.down": {"format": "nvfp4", "weight_global_scale": 0.3, "input_global_scale": 0.4},
            "layers.0.mlp.gate_up": {"format": "int4", "group_size": 64, "awq": True, "awq_alpha": 0.5, "scale_search": True},
            "layers.1.mlp.gate_up": {"format": "int4", "group_size": 64, "scale_search": False, "asymmetric": True},
        },
        "kv_cache": {"k_scales": [1.0, 2.0], "v_scales": [3.0, 4.0]},
        "calibration": {"samples": 2, "tokens": 8},
    }
    typed = QuantSection.from_dict(section, s, "fp8", "x")
    assert typed.to_dict() == section
    assert [typed.layers[n].format for n in section["layers"]] == ["fp8", "fp8", "nvfp4", "int4", "int4"]
    assert QuantSection().to_dict() == {"recipe": "none"}


def test_each_format_lays_out_its_tensors():
    from precast.engine.quant import FORMATS

    layouts = {name: cls.plan(64, None)[0].tensors("layers.0.attn.o", 32, 64) for name, cls in FORMATS.items()}
    assert layouts["fp8"] == {"layers.0.attn.o.weight": ((32, 64), "F8_E4M3")}
    assert layouts["nvfp4"] == {"layers.0.attn.o.weight": ((32, 32), "U8"), "layers.0.attn.o.weight_scale": ((32, 4), "F8_E4M3")}
    assert layouts["int4"] == {"layers.0.attn.o.weight": ((32, 32), "U8"), "layers.0.attn.o.weight_scale": ((32, 1), "F32")}
    asymmetric = FORMATS["int4"](group_size=64, asymmetric=True).tensors("layers.0.attn.o", 32, 64)
    assert asymmetric == layouts["int4"] | {"layers.0.attn.o.weight_offset": ((32, 1), "F32")}
