"""Calibration: activation statistics of a full-precision engine on real text.

The engine runs on precast's own CPU runner with a CalibrationRecorder attached as its activation observer:
for every linear layer's input it keeps the per-channel max |x| and mean |x| and a bounded sample
of rows (for AWQ's search), and for K and V the max |x| per layer. No torch; the model is run one
decoder layer at a time over all sequences, so memory is one layer's weights, the hidden states
and the samples, not the whole model.
"""

from __future__ import annotations

import hashlib
import resource
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from precast import _C
from precast.engine.directory import Engine
from precast.errors import PrecastError
from precast.runtime.cpu_backend import make_cpu_runner

DEFAULT_TEXT = "calibration.txt"  # quantization/data/, written for precast (Apache-2.0, like the code)


@dataclass
class ChannelStats:
    amax: np.ndarray  # [cols] max |x| per input channel
    mean_abs: np.ndarray  # [cols]
    samples: np.ndarray  # [n, cols] rows kept for AWQ (may be empty)

    @property
    def tensor_amax(self) -> float:
        return float(self.amax.max()) if self.amax.size else 0.0


@dataclass
class CalibrationResult:
    stats: dict[str, ChannelStats]  # linear layer name / "layers.{i}.attn.k|v" -> statistics
    report: dict[str, object] = field(default_factory=dict)  # recorded in the engine's quant.calibration


def peak_rss_mb() -> int:
    """This process's peak resident memory so far. VmHWM belongs to the address space, so unlike
    ru_maxrss it does not carry over the parent's size into a freshly started child."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def default_text() -> str:
    return resources.files("precast.quantization").joinpath("data", DEFAULT_TEXT).read_text(encoding="utf-8")


def calibration_sequences(tokenizer_json: str | None, text_path: Path | None, samples: int, seq_len: int) -> tuple[list[list[int]], str]:
    """Tokenize the calibration text and cut it into `samples` sequences of `seq_len` tokens."""
    if tokenizer_json is None:
        raise PrecastError(
            "calibration needs a tokenizer to read text, and this checkpoint has none; "
            "use the Python API's calib_tokens to give token ids instead"
        )
    from tokenizers import Tokenizer

    if text_path is None:
        text, source = default_text(), f"precast default text ({DEFAULT_TEXT})"
    else:
        try:
            text = Path(text_path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise PrecastError(f"cannot read --calib-text {text_path}: {e}") from e
        source = str(Path(text_path).resolve())
    ids = Tokenizer.from_str(tokenizer_json).encode(text, add_special_tokens=False).ids
    need = samples * seq_len
    if len(ids) < need:
        raise PrecastError(
            f"calibration text {source} has {len(ids)} tokens; --calib-samples {samples} x --calib-seq-len {seq_len} "
            f"needs {need}: give a longer text or lower them"
        )
    # Spread the samples over the whole text rather than taking its beginning.
    starts = np.linspace(0, len(ids) - seq_len, samples).astype(int)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return [ids[s : s + seq_len] for s in starts], f"{source} sha256:{digest[:16]}"


def calibrate(
    engine: Engine,
    sequences: list[list[int]],
    max_sample_rows: int = 0,
    num_threads: int | None = None,
    scratch: Path | None = None,
) -> CalibrationResult:
    """Run every sequence through the engine with recording on; `max_sample_rows` rows per layer are kept.

    One decoder layer at a time: every sequence's hidden states pass through layer i (a runner
    holding only its weights) before layer i + 1 is loaded, so memory is one layer's weights plus
    the hidden states, whatever the model's size. The statistics are those of a whole-model pass
    (the same kernels on the same inputs). Hidden states larger than HIDDEN_IN_MEMORY_BYTES live in
    a file under `scratch` when one is given, and so do AWQ's sample rows."""
    spec = engine.config.model
    if not sequences or any(len(s) == 0 for s in sequences):
        raise PrecastError("calibration needs at least one non-empty token sequence")
    for s in sequences:
        bad = [t for t in s if not 0 <= t < spec.vocab_size]
        if bad:
            raise PrecastError(f"calibration token id {bad[0]} is outside the vocabulary (0..{spec.vocab_size - 1})")
    if engine.config.quant.layers:
        raise PrecastError(f"calibration runs on a full-precision engine; {engine.path} is quantized")
    start = time.perf_counter()
    total = sum(len(s) for s in sequences)
    hidden = _hidden_states(total, spec.hidden_size, scratch)
    embed = engine.weights.read("embed.weight")
    offsets = np.cumsum([0] + [len(s) for s in sequences])
    scale = np.float32(engine.config.embedding_scale)  # Gemma's sqrt(hidden); 1 elsewhere
    for seq, begin in zip(sequences, offsets):
        rows = embed[np.asarray(seq)].astype(np.float32)  # exact widening, as the runner's
        hidden[begin : begin + len(seq)] = rows * scale if scale != 1 else rows
    del embed
    recorder = _C.CalibrationRecorder(max_sample_rows, max(1, total // max(1, max_sample_rows)) if max_sample_rows else 1)
    stats: dict[str, ChannelStats] = {}
    for layer in range(spec.num_layers):
        runner = make_cpu_runner(engine, num_threads, layers=range(layer, layer + 1))
        runner.set_observer(recorder)
        for seq, begin in zip(sequences, offsets):
            hidden[begin : begin + len(seq)] = runner.evaluate_hidden(hidden[begin : begin + len(seq)])
        runner.set_observer(None)
        del runner
        for name, d in recorder.take_stats().items():  # this layer's names are complete now
            stats[name] = ChannelStats(d["amax"], d["mean_abs"], _keep_samples(d["samples"], name, scratch))
    del hidden
    report = {
        "samples": len(sequences),
        "tokens": total,
        "seconds": round(time.perf_counter() - start, 2),
        "peak_rss_mb": peak_rss_mb(),
    }
    return CalibrationResult(stats, report)


HIDDEN_IN_MEMORY_BYTES = 256 << 20  # the default calibration (16 x 256 tokens) of a 1.5B model holds 25 MB


def _hidden_states(num_tokens: int, hidden_size: int, scratch: Path | None) -> np.ndarray:
    """float32 [num_tokens, hidden_size]: in memory, or in a file under `scratch` when large (file pages, not anonymous)."""
    if scratch is None or num_tokens * hidden_size * 4 <= HIDDEN_IN_MEMORY_BYTES:
        return np.empty((num_tokens, hidden_size), np.float32)
    return np.lib.format.open_memmap(Path(scratch) / "calibration-hidden.npy", "w+", np.float32, (num_tokens, hidden_size))


def _keep_samples(samples: np.ndarray, name: str, scratch: Path | None) -> np.ndarray:
    """AWQ's sample rows of one layer input; with `scratch`, in a file read back mapped (they add up to about
    512 rows x every layer's input width: 0.8 GB for a 1.5B model, more for larger ones)."""
    if scratch is None or samples.size == 0:
        return samples
    path = Path(scratch) / f"calibration-samples-{name}.npy"
    np.save(path, samples)
    return np.load(path, mmap_mode="r")
