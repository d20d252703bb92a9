"""Quality of quantized SmolLM2-135M-Instruct engines against the float32 engine.

Bounds (measured first, with the small CI calibration of 8 x 256 tokens and one 512-token
held-out window; docs/quantization.md has the full-calibration numbers):
  fp8       perplexity +2.6..3.5%, KL 0.032..0.035: E4M3 W8A8 with per-tensor scales. The weights
            alone cost ~1.1%; static per-tensor activation rounding (3 mantissa bits on every
            linear input) the rest. The often quoted "~1%" is for 7B+ models; a 576-wide model
            with 30 layers feels each rounding more. Bound: +5%, KL 0.05.
  fp8:dynamic  the same with one activation scale per token at run time: KL 0.028 here (one window; over the
            full held-out text and on chat transcripts its KL is 16-24% below static's). Same bounds.
  int4_awq  perplexity +10%, KL 0.104: W4A16, asymmetric groups (a scale and an offset each) of 64 (576 inputs)
            and 128 (1536). Symmetric groups cost +19%, KL 0.20 (+30..34%, KL 0.27 before the group scale
            search). Bound: +16%, KL 0.15.
  nvfp4     perplexity +29%, KL 0.30 (+57..60%, KL 0.46 before the block scale search): W4A4 (E2M1 weights
            and activations, 16-element blocks). Bound: +45%, KL 0.40.
The bounds leave room for calibration and summation-order noise, not for a change of recipe.
"""

from __future__ import annotations

import numpy as np
import pytest

from precast.engine.directory import load_engine
from precast.errors import PrecastError
from precast.quantization.quality import (
    CHAT_PROMPTS,
    _log_softmax,
    chat_windows,
    compare,
    heldout_windows,
    reference_log_probs,
    reference_quality,
    score,
)

BOUNDS = {  # recipe: (perplexity ratio, mean KL, top-1 agreement at least)
    "fp8": (1.05, 0.05, 0.85),
    "fp8:dynamic": (1.05, 0.05, 0.85),
    "int4_awq": (1.16, 0.15, 0.80),
    "nvfp4": (1.45, 0.40, 0.68),
}
FACTS = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
]


@pytest.mark.parametrize("recipe", list(BOUNDS))
def test_perplexity_and_kl_within_bounds(recipe, smollm2_quantized_engines, smollm2_engine):
    windows = heldout_windows(load_engine(smollm2_engine), 512, max_windows=1)
    ours, reference = compare(smollm2_quantized_engines[recipe], smollm2_engine, windows)
    ppl_bound, kl_bound, top1_bound = BOUNDS[recipe]
    assert 5 < reference.perplexity < 40  # the reference model reads the text as language
    assert ours.perplexity / reference.perplexity < ppl_bound
    assert 0 < ours.mean_kl < kl_bound
    assert ours.top1_agreement >= top1_bound


@pytest.mark.parametrize("recipe", list(BOUNDS))
def test_greedy_answers_to_factual_questions_stay_correct(recipe, smollm2_quantized_engines):
    from precast import LLM, SamplingParams

    # "How many days are there in a week?" was a third fact until every variant flipped it in turn: fp8 on
    # AVX512-BF16 (summation order alone), nvfp4 on AMD Zen 5, fp8 with per-token scales ("528 days") and int4_awq
    # with searched group scales ("31 days") while their perplexity and chat-transcript KL improved. The float32
    # model itself leads that answer's tokens by only 0.31 nats ("A week is approximately 7 days."): a near-tie,
    # not a fact this 135M model holds. Chat behaviour is measured below on transcripts instead.
    with LLM(smollm2_quantized_engines[recipe], kv_cache_memory=256 << 20) as llm:
        for question, answer in FACTS:
            text = llm.chat([{"role": "user", "content": question}], SamplingParams(temperature=0, max_tokens=32)).text
            assert answer in text, (recipe, question, text)


CHAT_BOUNDS = {  # recipe: (mean KL, top-1 agreement at least) on the float32 model's own chat transcripts
    "fp8": (0.12, 0.82),  # measured (Intel Xeon, AMX) KL 0.080, top-1 0.865
    "fp8:dynamic": (0.09, 0.88),  # 0.059, 0.928
    "int4_awq": (0.26, 0.70),  # 0.178, 0.751 (symmetric groups: 0.416, 0.688)
    "nvfp4": (0.85, 0.57),  # 0.641, 0.658 (0.585, 0.640 before the block scale search; on 24 other prompts
    # the search lowered it, 0.618 -> 0.534)
}


@pytest.fixture(scope="module")
def chat_transcripts(smollm2_engine) -> tuple[list[list[int]], list[np.ndarray]]:
    """The float32 engine's greedy answers to the first 8 CHAT_PROMPTS (template, question, answer as token ids) and its
    log-probabilities over them: what a quantized engine should predict at every position of a chat."""
    windows = chat_windows(smollm2_engine, CHAT_PROMPTS[:8])
    return windows, reference_log_probs(smollm2_engine, windows)


@pytest.mark.parametrize("recipe", list(CHAT_BOUNDS))
def test_chat_transcripts_stay_close_to_float32(recipe, smollm2_quantized_engines, smollm2_engine, chat_transcripts):
    windows, reference = chat_transcripts
    ours, _ = compare(smollm2_quantized_engines[recipe], smollm2_engine, windows, reference=reference)
    kl_bound, top1_bound = CHAT_BOUNDS[recipe]
    assert 0 < ours.mean_kl < kl_bound
    assert ours.top1_agreement >= top1_bound


def test_quantized_engines_are_smaller(smollm2_quantized_engines, smollm2_engine):
    size = {r: (p / "weights.safetensors").stat().st_size for r, p in smollm2_quantized_engines.items()}
    full = (smollm2_engine / "weights.safetensors").stat().st_size
    embed = 49152 * 576 * 4  # the tied embedding / head stays float32 by default
    assert size["fp8"] < embed + (full - embed) / 4 * 1.01
    # int4: 4 bits and a float32 scale and offset per group of 64 (576 inputs) or 128: 5 bits a weight at most
    assert size["int4_awq"] < embed + (full - embed) * 5 / 32 * 1.05 and size["nvfp4"] < embed + (full - embed) / 8 * 1.15


def test_score_reads_any_model_against_the_reference_log_probabilities():
    """score() takes logits from anything that reads the same ids (llama.cpp in benchmarks/quality.py): the
    reference scored as a model has KL 0, full agreement and its own perplexity; a shifted model has neither."""
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, 50, 9).tolist() for _ in range(3)]
    logits = {tuple(w): rng.normal(size=(9, 50)) for w in windows}
    reference = [_log_softmax(logits[tuple(w)][:-1]) for w in windows]
    itself = score(lambda w: logits[tuple(w)], windows, reference)
    ref = reference_quality(windows, reference)
    assert itself.mean_kl == pytest.approx(0, abs=1e-12) and itself.top1_agreement == 1.0
    assert itself.perplexity == pytest.approx(ref.perplexity) and itself.tokens == ref.tokens == 24
    targets_nll = -np.mean([lp[np.arange(8), w[1:]] for w, lp in zip(windows, reference)])
    assert ref.perplexity == pytest.approx(np.exp(targets_nll))
    flipped = score(lambda w: -logits[tuple(w)], windows, reference)
    assert flipped.mean_kl > 1 and flipped.top1_agreement < 0.2
    with pytest.raises(PrecastError, match="a different vocabulary"):
        score(lambda w: logits[tuple(w)][:, :40], windows, reference)


def test_per_token_fp8_scales_lose_less_than_static_ones_in_chat(smollm2_quantized_engines, smollm2_engine, chat_transcripts):
    """Measured: KL 0.059 against 0.080 on these transcripts, 0.056 against 0.075 on 24 others; on the held-out
    prose 0.027 against 0.032 (full calibration)."""
    windows, reference = chat_transcripts
    kl = {r: compare(smollm2_quantized_engines[r], smollm2_engine, windows, reference=reference)[0].mean_kl for r in ("fp8", "fp8:dynamic")}
    assert kl["fp8:dynamic"] < 0.9 * kl["fp8"], kl


def test_asymmetric_int4_groups_lose_less_than_symmetric_ones(smollm2_gguf, smollm2_quantized_engines, smollm2_engine, tmp_path):
    """The same build with groups centred on zero (a scale each, no offset): measured on this window KL 0.203 against
    the asymmetric groups' 0.104; on the full held-out text 0.199 against 0.104 (perplexity +24.5% against +12.1%)."""
    from precast.builder.build import BuildOptions, build_engine
    from precast.quantization.recipe import QuantOptions
    from tests.conftest import SMALL_CALIBRATION

    symmetric = tmp_path / "symmetric"
    quant = QuantOptions(recipe="int4_awq", asymmetric=False, **SMALL_CALIBRATION)
    build_engine(BuildOptions(smollm2_gguf, symmetric, max_seq_len=2048, progress=False, quant=quant))
    windows = heldout_windows(load_engine(smollm2_engine), 512, max_windows=1)
    asym, _ = compare(smollm2_quantized_engines["int4_awq"], smollm2_engine, windows)
    sym, _ = compare(symmetric, smollm2_engine, windows)
    assert asym.mean_kl < 0.75 * sym.mean_kl, (asym, sym)
    assert asym.perplexity < sym.perplexity


@pytest.mark.parametrize("recipe", ["int4_awq", "nvfp4"])
def test_searched_scales_lose_less_than_plain_ones(recipe, smollm2_gguf, smollm2_quantized_engines, smollm2_engine, tmp_path):
    """The same build with scales from each group's extremes: measured on this window (before int4 groups became
    asymmetric) KL 0.27 against the search's 0.20 (int4_awq), 0.46 against 0.30 (nvfp4); asymmetric int4 groups on the
    full held-out text 0.147 against 0.104."""
    from precast.builder.build import BuildOptions, build_engine
    from precast.quantization.recipe import QuantOptions
    from tests.conftest import SMALL_CALIBRATION

    plain = tmp_path / "plain"
    quant = QuantOptions(recipe=recipe, scale_search=False, **SMALL_CALIBRATION)
    build_engine(BuildOptions(smollm2_gguf, plain, max_seq_len=2048, progress=False, quant=quant))
    windows = heldout_windows(load_engine(smollm2_engine), 512, max_windows=1)
    searched, reference = compare(smollm2_quantized_engines[recipe], smollm2_engine, windows)
    rounded, _ = compare(plain, smollm2_engine, windows)
    assert searched.mean_kl < 0.85 * rounded.mean_kl, (searched, rounded)
    assert searched.perplexity < rounded.perplexity
