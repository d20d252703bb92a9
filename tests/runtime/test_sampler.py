"""The C++ sampler, one step at a time."""

from __future__ import annotations

import numpy as np

from precast import _C


def params(**kw) -> _C.SamplingParams:
    p = _C.SamplingParams()
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def sample(logits, p, context=(), num_output=0, bad_words=(), banned=(), seed=0):
    return _C.sample_token(np.asarray(logits, np.float32), p, list(context), num_output, [list(w) for w in bad_words], list(banned), seed)


def test_greedy_takes_first_maximum():
    assert sample([0.0, 3.0, 3.0, 1.0], params(temperature=0))[0] == 1


def test_top_k_one_is_greedy_and_seed_repeats():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(1000)
    assert sample(logits, params(temperature=1.0, top_k=1), seed=5)[0] == int(np.argmax(logits))
    draws = [sample(logits, params(temperature=1.0), seed=s)[0] for s in range(50)]
    assert draws == [sample(logits, params(temperature=1.0), seed=s)[0] for s in range(50)]
    assert len(set(draws)) > 10


def test_top_p_and_min_p_restrict_candidates():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    for s in range(100):
        assert sample(logits, params(temperature=1.0, top_p=0.7), seed=s)[0] in (0, 1)
        assert sample(logits, params(temperature=1.0, min_p=0.5), seed=s)[0] in (0, 1)


def test_sampling_follows_the_distribution():
    probs = np.array([0.6, 0.3, 0.1])
    draws = np.bincount([sample(np.log(probs), params(temperature=1.0), seed=s)[0] for s in range(3000)], minlength=3)
    np.testing.assert_allclose(draws / 3000, probs, atol=0.04)


def test_penalties():
    logits = [2.0, 1.9, -1.0]
    # Repetition penalty (HF rule) on a seen token makes the other win.
    assert sample(logits, params(temperature=0, repetition_penalty=2.0), context=[0])[0] == 1
    # Presence/frequency penalties count output tokens only.
    assert sample(logits, params(temperature=0, presence_penalty=0.5), context=[0], num_output=0)[0] == 0
    assert sample(logits, params(temperature=0, presence_penalty=0.5), context=[0], num_output=1)[0] == 1
    assert sample(logits, params(temperature=0, frequency_penalty=0.06), context=[0, 0], num_output=2)[0] == 1


def test_bad_words_and_banned_tokens():
    logits = [5.0, 4.0, 3.0]
    assert sample(logits, params(temperature=0), bad_words=[[0]])[0] == 1
    assert sample(logits, params(temperature=0), context=[7], bad_words=[[7, 0]])[0] == 1  # completes "7 0"
    assert sample(logits, params(temperature=0), context=[8], bad_words=[[7, 0]])[0] == 0
    assert sample(logits, params(temperature=0), banned=[0, 1])[0] == 2


def test_logprobs_are_of_the_raw_distribution():
    logits = np.array([1.0, 2.0, 3.0], np.float32)
    token, logprob, top = sample(logits, params(temperature=0, top_logprobs=2))
    ref = logits - np.log(np.exp(logits).sum())
    assert token == 2 and abs(logprob - ref[2]) < 1e-6
    assert [t for t, _ in top] == [2, 1] and abs(top[1][1] - ref[1]) < 1e-6


def test_truncation_beyond_the_first_sorted_prefix():
    """top-k above 64 and top-p needing more than 64 tokens take the longer sorting path."""
    flat = np.zeros(1000, np.float32)  # all equal: ties go to the lower index
    for s in range(200):
        assert sample(flat, params(temperature=1.0, top_k=100), seed=s)[0] < 100
        assert sample(flat, params(temperature=1.0, top_p=0.5), seed=s)[0] < 500
    draws = {sample(flat, params(temperature=1.0, top_p=0.5), seed=s)[0] for s in range(400)}
    assert max(draws) > 64  # really drew beyond the first prefix
    logits = np.log(np.array([0.4, 0.3, 0.19, 0.11]))
    for s in range(100):  # min_p 0.5: only tokens at least half as likely as the best (0.4, 0.3)
        assert sample(logits, params(temperature=1.0, min_p=0.5), seed=s)[0] in (0, 1)


def bitmask(vocab: int, allowed) -> np.ndarray:
    words = np.zeros((vocab + 31) // 32, np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1 << (t % 32))
    return words.view(np.int32)


def test_grammar_mask_keeps_only_allowed_tokens():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal(100)
    allowed = [3, 40, 97]
    greedy = _C.sample_token(np.asarray(logits, np.float32), params(temperature=0), [], 0, [], [], 0, bitmask(100, allowed))[0]
    assert greedy == allowed[int(np.argmax(logits[allowed]))]
    draws = {
        _C.sample_token(np.asarray(logits, np.float32), params(temperature=2.0), [], 0, [], [], s, bitmask(100, allowed))[0]
        for s in range(200)
    }
    assert draws == set(allowed)
    # logprobs stay those of the raw distribution (as with bad words and penalties)
    token, logprob, _ = _C.sample_token(
        np.asarray(logits, np.float32), params(temperature=0, top_logprobs=0), [], 0, [], [], 0, bitmask(100, allowed)
    )
    raw = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    assert abs(logprob - raw[token]) < 1e-5


def test_nothing_allowed_returns_no_token():
    logits = np.zeros(64, np.float32)
    assert _C.sample_token(logits, params(temperature=0), [], 0, [], [], 0, bitmask(64, []))[0] == -1
    # the mask allows only a token that a ban removes
    assert _C.sample_token(logits, params(temperature=0.7), [], 0, [], [5], 0, bitmask(64, [5]))[0] == -1


def test_logit_bias_bans_and_forces():
    logits = np.array([0.0, 5.0, 1.0, 2.0], np.float32)
    assert sample(logits, params(temperature=0, logit_bias=[(1, -100.0)]))[0] == 3
    assert sample(logits, params(temperature=0, logit_bias=[(2, 100.0)]))[0] == 2
    for s in range(50):
        assert sample(logits, params(temperature=1.0, logit_bias=[(0, 100.0)]), seed=s)[0] == 0
