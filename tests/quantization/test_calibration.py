"""Calibration one decoder layer at a time gives exactly the statistics of whole-model passes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from precast import _C
from precast.engine.directory import load_engine
from precast.errors import PrecastError
from precast.quantization import calibration
from precast.quantization.calibration import calibrate
from precast.runtime.cpu_backend import make_cpu_runner

SEQUENCES = [[3, 17, 5, 9, 44, 2, 8, 1, 30, 11, 7], [12, 4, 4, 60, 21], list(range(40, 77))]
SAMPLE_ROWS = 6


def whole_model_stats(engine) -> dict[str, dict]:
    """What calibration recorded before it streamed: every sequence through one runner holding the whole model."""
    runner = make_cpu_runner(engine, num_threads=2)
    total = sum(len(s) for s in SEQUENCES)
    recorder = _C.CalibrationRecorder(SAMPLE_ROWS, max(1, total // SAMPLE_ROWS))
    runner.set_observer(recorder)
    for seq in SEQUENCES:
        runner.evaluate(seq, False)
    runner.set_observer(None)
    return recorder.take_stats()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_layer_at_a_time_statistics_equal_whole_model_passes(tiny_engines, family):
    engine = load_engine(tiny_engines[family])
    expected = whole_model_stats(engine)
    got = calibrate(engine, SEQUENCES, max_sample_rows=SAMPLE_ROWS, num_threads=2).stats
    assert set(got) == set(expected)  # every linear input, K and V of every layer, and the LM head's input
    assert any(name in got for name in ("embed", "lm_head"))
    for name, want in expected.items():
        assert np.array_equal(got[name].amax, want["amax"]), name
        assert np.array_equal(got[name].mean_abs, want["mean_abs"]), name
        assert np.array_equal(got[name].samples, want["samples"]), name
        # an expert sees only the tokens routed to it: at most SAMPLE_ROWS of them
        rows = got[name].samples.shape[0]
        assert rows <= SAMPLE_ROWS if ".moe.experts." in name else rows == SAMPLE_ROWS, name


def test_large_hidden_states_live_in_a_scratch_file(tiny_engines, tmp_path, monkeypatch):
    engine = load_engine(tiny_engines["llama"])
    in_memory = calibrate(engine, SEQUENCES, max_sample_rows=SAMPLE_ROWS).stats
    created = []
    real = np.lib.format.open_memmap

    def recording_open_memmap(path, *args, **kwargs):
        created.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(calibration, "HIDDEN_IN_MEMORY_BYTES", 0)
    monkeypatch.setattr(np.lib.format, "open_memmap", recording_open_memmap)
    spilled = calibrate(engine, SEQUENCES, max_sample_rows=SAMPLE_ROWS, scratch=tmp_path).stats
    assert created and all(tmp_path in p.parents for p in created)
    samples = [s.samples for s in spilled.values() if s.samples.size]
    assert samples and all(isinstance(s, np.memmap) and tmp_path in Path(s.filename).parents for s in samples)
    for name in in_memory:
        assert np.array_equal(spilled[name].amax, in_memory[name].amax), name
        assert np.array_equal(spilled[name].samples, in_memory[name].samples), name


def test_layer_slice_runner_refuses_what_it_cannot_do(tiny_engines):
    engine = load_engine(tiny_engines["llama"])
    runner = make_cpu_runner(engine, layers=range(1, 2))
    with pytest.raises(RuntimeError, match="layers_only"):
        runner.evaluate([1, 2, 3], True)
    with pytest.raises(ValueError, match="hidden must be"):
        runner.evaluate_hidden(np.zeros((3, 5), np.float32))
    with pytest.raises(ValueError, match="non-empty range"):
        make_cpu_runner(engine, layers=range(0, engine.config.model.num_layers + 1))


def test_calibration_refuses_a_quantized_engine(tiny_checkpoints, tmp_path):
    from precast.builder.build import BuildOptions, build_engine
    from precast.quantization.recipe import QuantOptions

    quant = QuantOptions(recipe="fp8", calib_tokens=tuple(tuple(s) for s in SEQUENCES))
    build_engine(BuildOptions(tiny_checkpoints["llama"], tmp_path / "fp8", progress=False, quant=quant))
    with pytest.raises(PrecastError, match="full-precision engine"):
        calibrate(load_engine(tmp_path / "fp8"), SEQUENCES)


def test_an_expert_no_calibration_token_reached_takes_its_siblings_input_range():
    """Routing may leave an expert without calibration rows; its fp8 / nvfp4 input scale then comes from the largest
    of its layer's other experts of the same kind (never from another layer or kind); AWQ skips it."""
    from types import SimpleNamespace

    from precast.errors import PrecastError
    from precast.quantization.quantize import _input_amax

    stats = {
        "layers.1.moe.experts.0.gate_up": SimpleNamespace(tensor_amax=2.0),
        "layers.1.moe.experts.2.gate_up": SimpleNamespace(tensor_amax=5.0),
        "layers.1.moe.experts.0.down": SimpleNamespace(tensor_amax=9.0),
        "layers.0.moe.experts.1.gate_up": SimpleNamespace(tensor_amax=7.0),
    }
    calib = SimpleNamespace(stats=stats)
    assert _input_amax(calib, "layers.1.moe.experts.2.gate_up") == 5.0  # its own
    assert _input_amax(calib, "layers.1.moe.experts.1.gate_up") == 5.0  # siblings: max(2, 5)
    assert _input_amax(calib, "layers.1.moe.experts.3.down") == 9.0
    with pytest.raises(PrecastError, match="no inputs for layers.2.moe.experts.0.down"):
        _input_amax(calib, "layers.2.moe.experts.0.down")
    with pytest.raises(PrecastError, match="no inputs for layers.1.attn.o"):
        _input_amax(calib, "layers.1.attn.o")
