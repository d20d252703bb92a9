"""Bad input gets a clear PrecastError, and nothing half-written is left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from precast.builder.build import BuildOptions, build_engine
from precast.builder.checkpoint import open_checkpoint
from precast.engine.directory import load_engine
from precast.engine.safetensors_file import SafetensorsFile, SafetensorsWriter
from precast.errors import PrecastError
from tests.builder.gguf_fixtures import write_tiny_llama_gguf


@pytest.fixture
def ckpt(tiny_checkpoints, tmp_path) -> Path:
    """A private copy of the tiny llama checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_checkpoints["llama"], tmp_path / "ckpt"))


def build(src: Path, out: Path, **kw) -> None:
    build_engine(BuildOptions(src, out, progress=False, **kw))


def rewrite_weights(ckpt: Path, edit) -> None:
    """Rewrite model.safetensors after `edit(dict name -> array)` changed the tensors."""
    st = SafetensorsFile(ckpt / "model.safetensors")
    tensors = {n: st.read(n) for n in st.tensors}
    edit(tensors)
    with open(ckpt / "model.safetensors", "wb") as f:
        w = SafetensorsWriter(f, [(n, a.dtype, a.shape) for n, a in tensors.items()], {})
        for n, a in tensors.items():
            w.write(n, a)
        w.finish()


def assert_nothing_left(parent: Path, name: str = "engine") -> None:
    leftovers = [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]
    assert not leftovers, leftovers
    assert not (parent / name).exists()


def test_unknown_architecture_lists_supported(ckpt, tmp_path):
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        PrecastError, match=r"GPTNeoXForCausalLM is not supported.*LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM"
    ):
        build(ckpt, tmp_path / "engine")
    assert_nothing_left(tmp_path)


def test_unsupported_feature_is_refused_not_half_built(ckpt, tmp_path):
    config = json.loads((ckpt / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(PrecastError, match="hidden_act='gelu'"):
        build(ckpt, tmp_path / "engine")


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda rope: rope.update(short_factor=rope["short_factor"][:-1]), "longrope short_factor needs rotary_dim / 2 = 8 values, got 7"),
        (lambda rope: rope.pop("long_factor"), "needs a long_factor list"),
        (lambda rope: rope.update(partial_rotary_factor=0.35), r"partial_rotary_factor=0.35 \(rotary dimension 5 must be even"),
        (lambda rope: rope.update(rope_type="dynamic"), "RoPE scaling type 'dynamic' is not supported; supported: .*longrope"),
    ],
)
def test_bad_phi3_rope_is_refused(edit, message, tiny_checkpoints, tmp_path):
    ckpt = Path(shutil.copytree(tiny_checkpoints["phi3"], tmp_path / "ckpt"))
    config = json.loads((ckpt / "config.json").read_text())
    edit(config["rope_parameters"])
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(PrecastError, match=message):
        build(ckpt, tmp_path / "engine")
    assert_nothing_left(tmp_path)


def test_missing_config(ckpt, tmp_path):
    (ckpt / "config.json").unlink()
    with pytest.raises(PrecastError, match="no config.json"):
        build(ckpt, tmp_path / "engine")


def test_missing_weights(ckpt, tmp_path):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(PrecastError, match="has no weights"):
        build(ckpt, tmp_path / "engine")


def test_missing_shard(tiny_checkpoints, tmp_path):
    sharded = Path(shutil.copytree(tiny_checkpoints["qwen2"], tmp_path / "sharded"))
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(PrecastError, match=f"missing: {shard.name}"):
        build(sharded, tmp_path / "engine")


def test_pickle_weights_are_refused_with_advice(ckpt, tmp_path):
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    with pytest.raises(PrecastError, match="safe_serialization=True"):
        build(ckpt, tmp_path / "engine")


def test_truncated_safetensors(ckpt, tmp_path):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(PrecastError, match="truncated"):
        build(ckpt, tmp_path / "engine")
    assert_nothing_left(tmp_path)


@pytest.mark.parametrize("damage", ["header_length", "header_json", "tiny"])
def test_corrupt_safetensors(ckpt, tmp_path, damage):
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    if damage == "header_length":
        data[:8] = (2**40).to_bytes(8, "little")
    elif damage == "header_json":
        data[8:16] = b"\xff\xfe{{{{{{"
    else:
        data = data[:5]
    path.write_bytes(bytes(data))
    with pytest.raises(PrecastError, match="not a valid safetensors file"):
        build(ckpt, tmp_path / "engine")


def test_tensor_of_wrong_shape(ckpt, tmp_path):
    def edit(t):
        t["model.layers.1.self_attn.k_proj.weight"] = t["model.layers.1.self_attn.k_proj.weight"][:-16]

    rewrite_weights(ckpt, edit)
    with pytest.raises(PrecastError, match=r"model.layers.1.self_attn.k_proj.weight has shape \[16, 64\], the config implies \[32, 64\]"):
        build(ckpt, tmp_path / "engine")


def test_missing_tensor(ckpt, tmp_path):
    rewrite_weights(ckpt, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(PrecastError, match=r"missing tensor model.layers.2.mlp.up_proj.weight \(needed for layers.2.mlp.gate_up.weight\)"):
        build(ckpt, tmp_path / "engine")


def test_unused_tensor(ckpt, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)

    rewrite_weights(ckpt, edit)
    with pytest.raises(PrecastError, match=r"does not use: model.layers.0.self_attn.q_proj.bias"):
        build(ckpt, tmp_path / "engine")


def test_known_extra_tensors_are_ignored(ckpt, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(8, np.float32)

    rewrite_weights(ckpt, edit)
    build(ckpt, tmp_path / "engine")


def test_unsupported_tensor_dtype(ckpt, tmp_path):
    def edit(t):
        t["model.norm.weight"] = t["model.norm.weight"].astype(np.int32)

    rewrite_weights(ckpt, edit)
    with pytest.raises(PrecastError, match="only floating-point weights"):
        build(ckpt, tmp_path / "engine")
    assert_nothing_left(tmp_path)


def test_unreadable_safetensors_dtype(ckpt, tmp_path):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + n].replace(b'"F32"', b'"C64"', 1)
    path.write_bytes(data[:8] + header + data[8 + n :])
    with pytest.raises(PrecastError, match="dtype C64, which precast cannot read"):
        build(ckpt, tmp_path / "engine")


def test_nan_weights_are_refused(ckpt, tmp_path):
    def edit(t):
        t["model.norm.weight"][3] = np.nan

    rewrite_weights(ckpt, edit)
    with pytest.raises(PrecastError, match="NaN or Inf"):
        build(ckpt, tmp_path / "engine")


def test_float16_overflow_is_refused(ckpt, tmp_path):
    def edit(t):
        t["model.layers.0.mlp.down_proj.weight"][0, 0] = 1e6

    rewrite_weights(ckpt, edit)
    with pytest.raises(PrecastError, match="beyond float16's range"):
        build(ckpt, tmp_path / "engine", dtype="float16")


def test_unsupported_build_dtype(ckpt, tmp_path):
    with pytest.raises(PrecastError, match="--dtype 'int8' is not supported"):
        build(ckpt, tmp_path / "engine", dtype="int8")


def test_prequantized_checkpoint_is_refused(ckpt, tmp_path):
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(PrecastError, match="pre-quantized checkpoint.*'fp8'"):
        build(ckpt, tmp_path / "engine")


def test_existing_output_needs_force(ckpt, tmp_path):
    out = tmp_path / "engine"
    build(ckpt, out)
    before = (out / "weights.safetensors").read_bytes()
    with pytest.raises(PrecastError, match="already exists.*--force"):
        build(ckpt, out)
    assert (out / "weights.safetensors").read_bytes() == before
    build(ckpt, out, force=True, dtype="bfloat16")
    assert load_engine(out).config.dtype == "bfloat16"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_failure_mid_build_leaves_nothing_and_keeps_old_engine(ckpt, tmp_path, monkeypatch):
    from precast.builder.checkpoint.hf import HFCheckpoint

    out = tmp_path / "engine"
    build(ckpt, out)
    old_config = (out / "config.json").read_text()
    calls = {"n": 0}
    real_read = HFCheckpoint.read

    def failing_read(self, name):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-build
        return real_read(self, name)

    monkeypatch.setattr(HFCheckpoint, "read", failing_read)
    with pytest.raises(KeyboardInterrupt):
        build(ckpt, out, force=True)
    assert (out / "config.json").read_text() == old_config
    load_engine(out)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

    fresh = tmp_path / "fresh"
    calls["n"] = 0
    with pytest.raises(KeyboardInterrupt):
        build(ckpt, fresh)
    assert_nothing_left(tmp_path, "fresh")


def test_engine_of_newer_format_version(ckpt, tmp_path):
    out = tmp_path / "engine"
    build(ckpt, out)
    config = json.loads((out / "config.json").read_text())
    config["version"] = 2
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(PrecastError, match="format version 2, newer than this precast reads.*upgrade precast"):
        load_engine(out)


@pytest.mark.parametrize(
    "damage,message",
    [
        ("no_weights", "has no weights.safetensors"),
        ("not_json", "not valid JSON"),
        ("not_engine", "not a precast engine"),
        ("spec_field", "damaged or incomplete"),
        ("tensor_shape", "inconsistent with its config"),
        ("missing_dir", "does not exist"),
    ],
)
def test_damaged_engine(ckpt, tmp_path, damage, message):
    out = tmp_path / "engine"
    build(ckpt, out)
    config = json.loads((out / "config.json").read_text())
    if damage == "no_weights":
        (out / "weights.safetensors").unlink()
    elif damage == "not_json":
        (out / "config.json").write_text("{")
    elif damage == "not_engine":
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
    elif damage == "spec_field":
        del config["model"]["hidden_size"]
        (out / "config.json").write_text(json.dumps(config))
    elif damage == "tensor_shape":
        config["model"]["intermediate_size"] = 128
        (out / "config.json").write_text(json.dumps(config))
    else:
        out = tmp_path / "nowhere"
    with pytest.raises(PrecastError, match=message):
        load_engine(out)


def test_truncated_gguf(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_llama_gguf(path, {"attn_q.weight": "Q4_K"})
    data = path.read_bytes()
    for cut in (len(data) - 4096, 200, 10, 0):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(PrecastError, match="not a readable GGUF file"):
            build(tmp_path / "cut.gguf", tmp_path / "engine")
        assert_nothing_left(tmp_path)


def test_gguf_with_impossible_string_length(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_llama_gguf(path, {})
    data = bytearray(path.read_bytes())
    data[24:32] = (1 << 60).to_bytes(8, "little")  # the first metadata key's length
    path.write_bytes(bytes(data))
    with pytest.raises(PrecastError, match="not a readable GGUF file .*runs past the end"):
        open_checkpoint(path)


def test_corrupt_gguf_magic(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_llama_gguf(path, {})
    data = bytearray(path.read_bytes())
    data[:4] = b"GGXX"
    path.write_bytes(bytes(data))
    with pytest.raises(PrecastError, match="not a readable GGUF file"):
        open_checkpoint(path)


def test_gguf_of_unsupported_architecture(tmp_path):
    import gguf

    w = gguf.GGUFWriter(tmp_path / "m.gguf", "falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        PrecastError,
        match="GGUF architecture 'falcon' is not supported; supported: gemma2, gemma3, llama, mistral, phi3, qwen2, qwen2moe, qwen3, qwen3moe",
    ):
        open_checkpoint(tmp_path / "m.gguf")


def test_nonexistent_checkpoint(tmp_path):
    with pytest.raises(PrecastError, match="does not exist"):
        build(tmp_path / "nope", tmp_path / "engine")


def test_length_limits(ckpt, tmp_path):
    with pytest.raises(PrecastError, match="exceeds the model's context length"):
        build(ckpt, tmp_path / "engine", max_seq_len=100_000)
    with pytest.raises(PrecastError, match="below --max-batch-size"):
        build(ckpt, tmp_path / "engine", max_batch_size=64, max_num_tokens=8)
    with pytest.raises(PrecastError, match="power of two"):
        build(ckpt, tmp_path / "engine", tokens_per_block=24)
    assert_nothing_left(tmp_path)


@pytest.mark.parametrize(
    "name,edit,message",
    [
        ("gemma2", lambda c: c.update(hidden_activation="gelu"), "hidden_activation='gelu'.*supported gate activations"),
        ("gemma2", lambda c: c.update(layer_types=["chunked_attention"] * 3), r"layer_types \['chunked_attention'\]"),
        ("gemma3", lambda c: c.update(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
        ("gemma3", lambda c: c.update(attn_logit_softcapping=50.0), "gemma3: attn_logit_softcapping is not supported"),
        (
            "gemma3",
            lambda c: c["rope_parameters"]["sliding_attention"].update(rope_type="linear", factor=2.0),
            "RoPE scaling 'linear' on the sliding-window layers",
        ),
        (
            "gemma3",
            lambda c: c.update(architectures=["Gemma3ForConditionalGeneration"]),  # an image-text model's config nests the text one
            "Gemma3ForConditionalGeneration config.json lacks text_config",
        ),
        ("qwen3_moe", lambda c: c.update(scoring_func="sigmoid"), "routing rule scoring_func='sigmoid'"),
        ("qwen3_moe", lambda c: c.update(n_group=4, topk_group=2), "routing rule n_group=4"),
        ("mixtral", lambda c: c.update(routed_scaling_factor=2.5), "routing rule routed_scaling_factor=2.5"),
        ("mixtral", lambda c: c.update(num_experts_per_tok=9), "experts_per_token <= num_experts"),
        ("qwen2_moe", lambda c: c.update(mlp_only_layers=[0, 1, 2]), "every layer is dense"),
        ("qwen3_moe", lambda c: c.pop("moe_intermediate_size"), "lacks 'moe_intermediate_size'"),
    ],
)
def test_gemma_and_moe_configs_precast_cannot_run_are_refused(name, edit, message, tiny_checkpoints, tmp_path):
    ckpt = Path(shutil.copytree(tiny_checkpoints[name], tmp_path / "ckpt"))
    config = json.loads((ckpt / "config.json").read_text())
    edit(config)
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(PrecastError, match=message):
        build(ckpt, tmp_path / "engine")
    assert_nothing_left(tmp_path)


def test_a_missing_expert_is_named(tiny_checkpoints, tmp_path):
    ckpt = Path(shutil.copytree(tiny_checkpoints["mixtral"], tmp_path / "ckpt"))
    rewrite_weights(ckpt, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.5.w2.weight"))
    with pytest.raises(
        PrecastError,
        match=r"missing tensor model.layers.1.block_sparse_moe.experts.5.w2.weight \(needed for layers.1.moe.experts.5.down.weight\)",
    ):
        build(ckpt, tmp_path / "engine")
    assert_nothing_left(tmp_path)
