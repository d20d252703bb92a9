"""dithered_source.py: a quantized GGUF rewritten as F16, each weight moved within its quantization step."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from dithered_source import dither_gguf  # noqa: E402


def test_quantized_tensors_become_f16_within_half_a_step_and_the_rest_is_kept(tmp_path):
    import gguf
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8, 64)).astype(np.float32)
    norm = rng.standard_normal(64).astype(np.float32)
    source = tmp_path / "source.gguf"
    writer = gguf.GGUFWriter(source, "llama")
    writer.add_block_count(1)
    writer.add_file_type(2)  # Q4_0
    for name, qtype in (("blk.0.ffn_down.weight", gguf.GGMLQuantizationType.Q4_0), ("blk.0.ffn_up.weight", gguf.GGMLQuantizationType.Q8_0)):
        writer.add_tensor(name, quantize(weight, qtype), raw_dtype=qtype)
    writer.add_tensor("blk.0.ffn_norm.weight", norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    out = dither_gguf(source, tmp_path / "dithered.gguf", seed=1)
    before, after = gguf.GGUFReader(source), gguf.GGUFReader(out)
    assert after.fields["general.file_type"].contents() == 1 and after.fields["llama.block_count"].contents() == 1
    for old, new in zip(before.tensors, after.tensors, strict=True):
        assert new.name == old.name and list(new.shape) == list(old.shape)
        values = dequantize(old.data, old.tensor_type)
        if old.tensor_type == gguf.GGMLQuantizationType.F32:
            assert new.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(new.data, values)
            continue
        assert new.tensor_type == gguf.GGMLQuantizationType.F16
        steps = 15 if old.tensor_type == gguf.GGMLQuantizationType.Q4_0 else 254
        blocks = values.reshape(-1, 32)
        half_step = ((blocks.max(1) - blocks.min(1)) / steps / 2)[:, None]
        moved = np.asarray(new.data, np.float32).reshape(-1, 32) - blocks
        assert (np.abs(moved) <= half_step * 1.01 + 1e-3).all()  # within half a step (and float16's rounding)
        assert np.abs(moved).mean() > half_step.mean() / 4  # moved off the grid: uniform noise averages a quarter step
