"""precast's streaming safetensors writer/reader against the `safetensors` package."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from precast.engine.safetensors_file import SafetensorsFile, SafetensorsWriter


def test_written_file_reads_back_in_safetensors(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.standard_normal((3, 5)).astype(np.float32),
        "b": rng.standard_normal((7,)).astype(ml_dtypes.bfloat16),
        "c": rng.standard_normal((2, 2, 2)).astype(np.float16),
        "d": np.arange(5, dtype=np.uint8),
        "e": rng.standard_normal((4, 4)).astype(ml_dtypes.float8_e4m3fn),
    }
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as f:
        w = SafetensorsWriter(f, [(n, a.dtype, a.shape) for n, a in tensors.items()], {"format": "precast"})
        for n in ["d", "a", "e", "c", "b"]:  # any order
            w.write(n, tensors[n])
        w.finish()
    loaded = load_file(path)
    for n, a in tensors.items():
        np.testing.assert_array_equal(loaded[n].float().numpy(), a.astype(np.float32))
    ours = SafetensorsFile(path)
    assert ours.metadata == {"format": "precast"}
    for n, a in tensors.items():
        got = ours.read(n)
        assert got.dtype == a.dtype and got.shape == a.shape
        np.testing.assert_array_equal(got.astype(np.float32), a.astype(np.float32))


def test_reads_files_written_by_safetensors(tmp_path):
    t = {"w": torch.randn(4, 6, dtype=torch.bfloat16), "s": torch.tensor(3.5)}
    save_file(t, tmp_path / "y.safetensors")
    f = SafetensorsFile(tmp_path / "y.safetensors")
    np.testing.assert_array_equal(f.read("w").astype(np.float32), t["w"].float().numpy())
    assert f.read("s").shape == () and float(f.read("s")) == 3.5


def test_writer_refuses_unplanned_shapes_and_missing_tensors(tmp_path):
    with open(tmp_path / "z.safetensors", "wb") as f:
        w = SafetensorsWriter(f, [("a", np.dtype(np.float32), (2,)), ("b", np.dtype(np.float32), (1,))], {})
        with pytest.raises(ValueError, match="planned"):
            w.write("a", np.zeros(3, np.float32))
        w.write("a", np.zeros(2, np.float32))
        with pytest.raises(ValueError, match="never written"):
            w.finish()
