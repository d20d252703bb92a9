"""Quality of a quantized engine against a reference engine on held-out text.

Both engines run the same token windows through precast's CPU runner (CpuRunner.evaluate,
logits at every position). Reported per engine: perplexity of the text, and against the
reference the mean per-token KL divergence KL(reference || engine) and the share of positions
whose top-1 token agrees.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from precast.engine.directory import Engine, load_engine
from precast.errors import PrecastError
from precast.runtime.cpu_backend import make_cpu_runner

HELDOUT_TEXT = "heldout.txt"  # quantization/data/, distinct from the calibration text


@dataclass(frozen=True)
class Quality:
    perplexity: float
    mean_kl: float  # nats per token, against the reference (0 for the reference itself)
    top1_agreement: float  # share of positions whose argmax equals the reference's
    tokens: int


def heldout_windows(engine: Engine, seq_len: int = 512, max_windows: int | None = None, text: str | None = None) -> list[list[int]]:
    if engine.tokenizer_path is None:
        raise PrecastError("quality measurement needs an engine with a tokenizer")
    from tokenizers import Tokenizer

    if text is None:
        text = resources.files("precast.quantization").joinpath("data", HELDOUT_TEXT).read_text(encoding="utf-8")
    ids = Tokenizer.from_file(str(engine.tokenizer_path)).encode(text, add_special_tokens=False).ids
    windows = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    if not windows:
        raise PrecastError(f"the held-out text has {len(ids)} tokens, fewer than one window of {seq_len}")
    return windows[:max_windows] if max_windows else windows


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def compare(
    engine_path: str | Path,
    reference_path: str | Path,
    windows: list[list[int]],
    num_threads: int | None = None,
    quantize_activations: bool = True,
) -> tuple[Quality, Quality]:
    """(engine's quality, reference's quality) on the same windows. quantize_activations=False measures what
    the weights alone cost (a diagnostic, not the recipe)."""
    reference = make_cpu_runner(load_engine(reference_path), num_threads)
    runner = make_cpu_runner(load_engine(engine_path), num_threads, quantize_activations)
    nll = ref_nll = kl = agree = 0.0
    count = 0
    for window in windows:
        ref_lp = _log_softmax(reference.evaluate(window, True)[:-1].astype(np.float64))
        lp = _log_softmax(runner.evaluate(window, True)[:-1].astype(np.float64))
        targets = np.asarray(window[1:])
        rows = np.arange(len(targets))
        nll += -lp[rows, targets].sum()
        ref_nll += -ref_lp[rows, targets].sum()
        kl += (np.exp(ref_lp) * (ref_lp - lp)).sum()
        agree += (lp.argmax(-1) == ref_lp.argmax(-1)).sum()
        count += len(targets)
    engine_q = Quality(float(np.exp(nll / count)), float(kl / count), float(agree / count), count)
    ref_q = Quality(float(np.exp(ref_nll / count)), 0.0, 1.0, count)
    return engine_q, ref_q
