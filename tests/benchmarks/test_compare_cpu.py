"""compare_cpu.py: --model takes a packaged model's name or a prefix naming one only; what a decode step streams."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from compare_cpu import MODELS, model_arg  # noqa: E402


def test_full_names_and_unique_prefixes_resolve():
    for name in MODELS:
        assert model_arg(name) == name
    assert model_arg("qwen2.5-coder-1.5b") == "qwen2.5-coder-1.5b-instruct"
    assert model_arg("smollm2") == "smollm2-135m-instruct"


@pytest.mark.parametrize("name", ["qwen", "llama-3"])
def test_ambiguous_or_unknown_prefix_is_refused(name):
    with pytest.raises(argparse.ArgumentTypeError, match="packaged model"):
        model_arg(name)


def test_streamed_bytes_leave_out_an_embedding_table_the_head_does_not_share(tmp_path):
    """The bandwidth limit divides by what a decode step reads: an untied embedding table is read one row per token."""
    import gguf
    import numpy as np
    from compare_cpu import gguf_streamed_bytes, precast_streamed_bytes
    from safetensors.numpy import save_file

    embed, head, layer = (np.zeros(shape, np.float32) for shape in ((64, 16), (64, 16), (16, 16)))
    for untied in (True, False):
        engine = tmp_path / f"engine-{untied}"
        engine.mkdir()
        tensors = {"embed.weight": embed, "layers.0.mlp.down.weight": layer} | ({"lm_head.weight": head} if untied else {})
        save_file(tensors, engine / "weights.safetensors")
        size = (engine / "weights.safetensors").stat().st_size
        assert precast_streamed_bytes(engine) == size - (embed.nbytes if untied else 0)

        path = tmp_path / f"model-{untied}.gguf"
        writer = gguf.GGUFWriter(path, "llama")
        writer.add_tensor("token_embd.weight", embed)
        writer.add_tensor("blk.0.ffn_down.weight", layer)
        if untied:
            writer.add_tensor("output.weight", head)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        assert gguf_streamed_bytes(path) == path.stat().st_size - (embed.nbytes if untied else 0)


def test_streamed_bytes_count_int4_group_scales_and_offsets_as_bf16(tmp_path):
    """int4 group scales and offsets are float32 in the file and bf16 in the CPU runner's panels."""
    import numpy as np
    from compare_cpu import precast_streamed_bytes
    from safetensors.numpy import save_file

    codes, pairs = np.zeros((16, 32), np.uint8), np.zeros((16, 1), np.float32)
    tensors = {"embed.weight": np.zeros((64, 16), np.float32), "layers.0.mlp.down.weight": codes}
    save_file(
        tensors | {"layers.0.mlp.down.weight_scale": pairs, "layers.0.mlp.down.weight_offset": pairs}, tmp_path / "weights.safetensors"
    )
    assert precast_streamed_bytes(tmp_path) == (tmp_path / "weights.safetensors").stat().st_size - pairs.nbytes
