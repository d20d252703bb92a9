"""Quality of a quantized engine against a reference engine on held-out text, or on chat transcripts.

Both engines run the same token windows through precast's CPU runner (CpuRunner.evaluate,
logits at every position). Reported per engine: perplexity of the text, and against the
reference the mean per-token KL divergence KL(reference || engine) and the share of positions
whose top-1 token agrees. Chat transcripts (chat_windows) are the reference model's own greedy
answers to CHAT_PROMPTS in its chat template: what a quantized engine should predict in a chat.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from precast.engine.directory import Engine, load_engine
from precast.errors import PrecastError
from precast.runtime.cpu_backend import make_cpu_runner

HELDOUT_TEXT = "heldout.txt"  # quantization/data/, distinct from the calibration text
CHAT_PROMPTS = (  # short questions and tasks of the kinds small chat models are asked (the first 8 bound the tests)
    "What is the capital of Italy?",
    "Who wrote Romeo and Juliet?",
    "Name three primary colors.",
    "Write a Python function that adds two numbers.",
    "Give me a tip for sleeping better.",
    "What is 12 times 12?",
    "Translate 'thank you' into Spanish.",
    "What do bees make?",
    "Explain what a list comprehension is in Python.",
    "What is the boiling point of water in Celsius?",
    "Suggest a name for a pet goldfish.",
    "Why is the sky blue?",
    "Write a haiku about autumn.",
    "How do I reverse a string in JavaScript?",
    "What is the largest planet in our solar system?",
    "Summarize the plot of Cinderella in two sentences.",
    "What are the benefits of drinking water?",
    "Convert 5 kilometers to miles.",
    "Write a SQL query that counts the rows of a table named users.",
    "Who painted the Mona Lisa?",
    "Give me three ideas for a rainy afternoon.",
    "What does HTTP stand for?",
    "How many legs does a spider have?",
    "Write a short thank-you note to a teacher.",
)


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


def score(logits_of: Callable[[list[int]], np.ndarray], windows: list[list[int]], reference: list[np.ndarray]) -> Quality:
    """Quality of a model given as `logits_of(window)` (logits at every position, [len(window), vocab]) against
    the reference's log-probabilities of the same windows (reference_log_probs). Any model that reads the same
    token ids can be scored: another engine, or llama.cpp (benchmarks/quality.py)."""
    nll = kl = agree = 0.0
    count = 0
    for window, ref_lp in zip(windows, reference, strict=True):
        lp = _log_softmax(np.asarray(logits_of(window))[:-1].astype(np.float64))
        if lp.shape != ref_lp.shape:
            raise PrecastError(f"logits of shape {lp.shape} against the reference's {ref_lp.shape}: a different vocabulary?")
        targets = np.asarray(window[1:])
        nll += -lp[np.arange(len(targets)), targets].sum()
        kl += (np.exp(ref_lp) * (ref_lp - lp)).sum()
        agree += (lp.argmax(-1) == ref_lp.argmax(-1)).sum()
        count += len(targets)
    return Quality(float(np.exp(nll / count)), float(kl / count), float(agree / count), count)


def reference_log_probs(reference_path: str | Path, windows: list[list[int]], num_threads: int | None = None) -> list[np.ndarray]:
    """Per window, the reference engine's log-probabilities of each next token ([len(window) - 1, vocab])."""
    reference = make_cpu_runner(load_engine(reference_path), num_threads)
    return [_log_softmax(reference.evaluate(w, True)[:-1].astype(np.float64)) for w in windows]


def chat_windows(engine_path: str | Path, prompts: tuple[str, ...] = CHAT_PROMPTS, max_tokens: int = 48) -> list[list[int]]:
    """The engine's greedy answers to `prompts` in its chat template, each as one token window (template, question,
    answer): teacher-forced, they measure how closely another engine follows this one through a chat."""
    from precast import LLM, SamplingParams  # the serving API, only for this

    with LLM(engine_path, kv_cache_memory=256 << 20) as llm:
        outs = [llm.chat([{"role": "user", "content": p}], SamplingParams(temperature=0, max_tokens=max_tokens)) for p in prompts]
    return [list(o.prompt_token_ids) + list(o.token_ids) for o in outs]


def reference_quality(windows: list[list[int]], reference: list[np.ndarray]) -> Quality:
    """The reference scored against itself: its perplexity of the text, KL 0, agreement 1."""
    nll = sum(-lp[np.arange(len(w) - 1), w[1:]].sum() for w, lp in zip(windows, reference, strict=True))
    count = sum(len(w) - 1 for w in windows)
    return Quality(float(np.exp(nll / count)), 0.0, 1.0, count)


def compare(
    engine_path: str | Path,
    reference_path: str | Path,
    windows: list[list[int]],
    num_threads: int | None = None,
    quantize_activations: bool = True,
    reference: list[np.ndarray] | None = None,
) -> tuple[Quality, Quality]:
    """(engine's quality, reference's quality) on the same windows. quantize_activations=False measures what
    the weights alone cost (a diagnostic, not the recipe). `reference`: the reference's log-probabilities when
    already computed (reference_log_probs)."""
    if reference is None:
        reference = reference_log_probs(reference_path, windows, num_threads)
    runner = make_cpu_runner(load_engine(engine_path), num_threads, quantize_activations)
    return score(lambda w: runner.evaluate(w, True), windows, reference), reference_quality(windows, reference)
