"""Speculative decoding: proposals checked in the target's own pass. Greedy output is identical to plain
decoding whatever is proposed; sampled output keeps the target's distribution (chi-square against the exact
next-token probabilities); rejected drafts leave the KV accounting whole."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.stats import chisquare

from precast import _C
from precast.errors import PrecastError
from precast.runtime import LLM, SamplingParams

from .test_executor import wait_idle

GREEDY = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
CODE = """def merge(intervals):
    intervals.sort(key=lambda x: x[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
"""


class ScriptedProposer(_C.Proposer):
    """Proposes what `reference` says comes next (when the tokens so far are a prefix of it), with the draft
    token at a random place replaced by a wrong one half the time; elsewhere random tokens."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], vocab: int, seed: int = 0):
        super().__init__()
        self.reference, self.vocab = reference, vocab
        self.rng = np.random.default_rng(seed)
        self.calls = 0
        self.released: list[int] = []

    def propose(self, requests):
        self.calls += 1
        drafts = []
        for _request_id, tokens, max_draft in requests:
            draft = self.rng.integers(0, self.vocab, max_draft).tolist()
            for prompt, full in self.reference.items():
                if len(tokens) >= len(prompt) and full[: len(tokens)] == list(tokens):
                    draft = full[len(tokens) : len(tokens) + max_draft]
                    if draft and self.rng.random() < 0.5:
                        draft[int(self.rng.integers(0, len(draft)))] = int(self.rng.integers(0, self.vocab))
            drafts.append(draft)
        return drafts

    def release(self, request_id):
        self.released.append(request_id)


def code_prompt(llm: LLM) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": "Rename merged to result in this code:\n" + CODE}])


def test_ngram_lookup_takes_the_longest_latest_match():
    lookup = _C.NgramProposer.lookup
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 1, 3, 4) == [7, 5, 1, 2]  # latest earlier "1 2 3"
    assert lookup([4, 2, 3, 8, 6, 5, 2, 3], 1, 3, 2) == [8, 6]  # no "5 2 3" before: "2 3"
    assert lookup([1, 2, 3, 4], 1, 3, 5) == []  # nothing recurs
    assert lookup([7, 7], 1, 3, 5) == [7]  # the continuation stops at the end of the context
    assert lookup([5, 6, 5], 2, 3, 3) == []  # min_ngram 2: a single token is not enough
    with pytest.raises(ValueError, match="n-gram sizes"):
        _C.NgramProposer(0, 3)


def test_ngram_greedy_identical_alone_and_mixed(smollm2_bf16_engine, smollm2_llm):
    prompt = code_prompt(smollm2_llm)
    others = [smollm2_llm.tokenize(t) for t in ("The history of Rome", "List three fruits:", "def fib(n):")]
    plain = smollm2_llm.generate([prompt, *others], GREEDY)
    with LLM(smollm2_bf16_engine, kv_cache_memory=1 << 30, speculative="ngram") as spec:
        alone = spec.generate(prompt, GREEDY)
        assert alone.token_ids == plain[0].token_ids
        assert alone.num_draft_tokens > 0 and alone.num_accepted_draft_tokens > 0
        # Speculative and plain requests in one step: an opted-out request drafts nothing.
        opted_out = SamplingParams(**{**GREEDY.__dict__, "speculative": False})
        mixed = spec.generate([prompt, *others], [GREEDY, opted_out, GREEDY, opted_out])
        assert [m.token_ids for m in mixed] == [p.token_ids for p in plain]
        assert mixed[1].num_draft_tokens == 0 and mixed[3].num_draft_tokens == 0
        stats = spec.stats()
        assert stats.accepted_draft_tokens <= stats.draft_tokens and stats.speculative_steps > 0
        assert stats.verify_seconds > 0
        wait_idle(spec)
        spec.check_integrity()


def test_draft_engine_greedy_identical(smollm2_engine, smollm2_bf16_engine, smollm2_llm):
    """The bf16 build drafting for the float32 build of the same model: most drafts are accepted, and the output
    is the float32 engine's own."""
    prompt = code_prompt(smollm2_llm)
    with LLM(smollm2_engine, kv_cache_memory=1 << 30) as plain:
        want = plain.generate(prompt, GREEDY).token_ids
    with LLM(smollm2_engine, kv_cache_memory=1 << 30, speculative=f"draft={smollm2_bf16_engine}", num_draft_tokens=4) as spec:
        out = spec.generate(prompt, GREEDY)
        assert out.token_ids == want
        assert out.num_accepted_draft_tokens > 0.8 * out.num_draft_tokens
        assert spec.stats().draft_seconds > 0
        wait_idle(spec)
        spec.check_integrity()


def test_wrong_drafts_roll_back_under_preemption(smollm2_bf16_engine, smollm2_llm, smollm2_block_bytes):
    """Half-right scripted drafts, a KV pool so small that requests are preempted, blocks of 32 tokens crossed by
    rejected runs: every output equals plain decoding and the accounting audit passes."""
    prompts = [code_prompt(smollm2_llm)[: 40 + 13 * i] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    plain = smollm2_llm.generate(prompts, params)
    reference = {tuple(p): p + o.token_ids for p, o in zip(prompts, plain)}
    proposer = ScriptedProposer(reference, vocab=49152)
    with LLM(smollm2_bf16_engine, kv_cache_memory=14 * smollm2_block_bytes, speculative=proposer, num_draft_tokens=6) as tight:
        outs = tight.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        stats = tight.stats()
        assert stats.preemptions > 0
        assert 0 < stats.accepted_draft_tokens < stats.draft_tokens  # some drafts kept, some rolled back
        wait_idle(tight)
        tight.check_integrity()
    assert sorted(proposer.released) == sorted(o.request_id for o in outs)


def test_stops_length_and_logprobs_inside_an_accepted_run(smollm2_bf16_engine, smollm2_llm):
    prompt = code_prompt(smollm2_llm)
    free = smollm2_llm.generate(prompt, GREEDY)
    stop_token = free.token_ids[23]
    stop_text = smollm2_llm.tokenizer.decode(free.token_ids[30:32])
    cases = [
        SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[stop_token], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=60, stop=[stop_text], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=37, ignore_eos=True),  # max_tokens reached mid-run
        SamplingParams(temperature=0, max_tokens=40, min_tokens=30, logprobs=3),
    ]
    plain = smollm2_llm.generate([prompt] * len(cases), cases)
    reference = {tuple(prompt): prompt + free.token_ids}
    with LLM(smollm2_bf16_engine, kv_cache_memory=1 << 30, speculative=ScriptedProposer(reference, 49152), num_draft_tokens=8) as spec:
        outs = [spec.generate(prompt, c) for c in cases]
        for p, o in zip(plain, outs):
            assert (o.token_ids, o.text, o.finish_reason) == (p.token_ids, p.text, p.finish_reason)
        assert outs[0].token_ids[-1] == stop_token and outs[0].finish_reason == "stop"
        assert len(outs[2].token_ids) == 37
        assert len(outs[3].logprobs) == len(outs[3].token_ids) == len(outs[3].top_logprobs)
        np.testing.assert_allclose(outs[3].logprobs, plain[3].logprobs, atol=1e-5)
        wait_idle(spec)
        spec.check_integrity()


def test_cancel_mid_run_frees_everything(smollm2_bf16_engine, smollm2_llm):
    prompt = code_prompt(smollm2_llm)
    with LLM(smollm2_bf16_engine, kv_cache_memory=1 << 30, speculative="ngram") as spec:
        stream = spec.stream(prompt, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        seen = [next(stream) for _ in range(3)]
        stream.close()  # cancels
        wait_idle(spec)
        spec.check_integrity()
        assert not seen[-1].finished


def _exact_distribution(llm: LLM, context: list[int], temperature: float, top_k: int, top_p: float) -> dict[int, float]:
    """The target's sampling distribution after `context`: softmax(logits / T) over the top_k tokens, then the
    smallest most likely set holding top_p of that mass."""
    top = llm.generate(context, SamplingParams(temperature=0, max_tokens=1, logprobs=20)).top_logprobs[0][:top_k]
    weights = sorted(((np.exp(lp / temperature), t) for t, lp in top), reverse=True)
    total = sum(w for w, _ in weights)
    kept, mass = {}, 0.0
    for w, t in weights:
        kept[t] = w
        mass += w
        if mass >= top_p * total:
            break
    return {t: w / mass for t, w in kept.items()}


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.6, 6, 1.0), (1.0, 6, 0.7)])
def test_rejection_sampling_keeps_the_target_distribution(tiny_engines, temperature, top_k, top_p):
    """A fixed draft (the second most likely first token, then the most likely second) on a tiny model: over
    4000 seeds the first token's frequencies (draft accepted, or the residual drawn) and, after an accepted
    first draft, the second token's (checked against the second draft, or drawn at the bonus row) match the
    exact distributions (chi-square, p > 0.001). The seeds are fixed, so the test is deterministic."""
    prompt = [5, 17, 99, 3, 42, 8]
    with LLM(tiny_engines["llama"]) as plain:
        first = _exact_distribution(plain, prompt, temperature, top_k, top_p)
        assert len(first) >= 3  # a draft that is not the only candidate
        draft_first = sorted(first, key=first.get)[-2]
        second = _exact_distribution(plain, prompt + [draft_first], temperature, top_k, top_p)
    draft = [draft_first, max(second, key=second.get)]

    class Fixed(_C.Proposer):
        def propose(self, requests):
            return [draft[:k] for _, tokens, k in requests]

    counts = [dict.fromkeys(first, 0), dict.fromkeys(second, 0)]
    with LLM(tiny_engines["llama"], speculative=Fixed(), num_draft_tokens=2) as spec:
        for group in range(500):  # 8 at a time: the executor's default max_draft_batch
            params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=3, seed=group * 8 + i) for i in range(8)]
            for out in spec.generate([prompt] * 8, params):
                assert out.num_draft_tokens >= 1
                counts[0][out.token_ids[0]] += 1
                if out.token_ids[0] == draft_first:
                    counts[1][out.token_ids[1]] += 1
    for want, seen in zip((first, second), counts):
        observed = np.array([seen[t] for t in want], dtype=float)
        expected = np.array([want[t] for t in want]) * observed.sum()
        assert observed.sum() > 300
        assert chisquare(observed, expected).pvalue > 1e-3, (seen, want)


def test_refusals(smollm2_bf16_engine, tiny_engines, tmp_path):
    with pytest.raises(PrecastError, match="not a method"):
        LLM(smollm2_bf16_engine, speculative="eagle")
    with pytest.raises(PrecastError, match=r"num_draft_tokens must be an integer in \[1, 64\]"):
        LLM(smollm2_bf16_engine, speculative="ngram", num_draft_tokens=0)
    with pytest.raises(PrecastError, match="num_draft_tokens needs speculative"):
        LLM(smollm2_bf16_engine, num_draft_tokens=4)
    with pytest.raises(PrecastError, match="needs both engines' tokenizers"):
        LLM(smollm2_bf16_engine, speculative=f"draft={tiny_engines['llama']}")
    # The same engine with one vocabulary entry renamed: its ids would mean other text.
    other = tmp_path / "other-tokenizer"
    other.mkdir()
    for f in smollm2_bf16_engine.iterdir():
        if f.name != "tokenizer.json":
            (other / f.name).symlink_to(f)
    tokenizer = json.loads((smollm2_bf16_engine / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(PrecastError, match=r"different tokenizer .*'hello'=\d+"):
        LLM(smollm2_bf16_engine, speculative=f"draft={other}")
    with pytest.raises(PrecastError, match="runs on the cpu and cuda backends"):
        LLM(tiny_engines["llama"], backend="tensorrt-reference", speculative="ngram")
    with pytest.raises(PrecastError, match="does not exist"):
        LLM(smollm2_bf16_engine, speculative="draft=/nonexistent/engine")


def test_serve_with_ngram_speculation(smollm2_bf16_engine, smollm2_llm):
    """`precast serve --speculative ngram`: greedy completions equal plain decoding, a request may opt out, and
    the draft counters are exported under precast's and vLLM's names."""
    from openai import OpenAI

    from .test_server import MODEL, metric, start_server, stop_server

    prompt = "Copy this code exactly:\n" + CODE + "\nCopy:\n"
    # The server fills unset fields from the engine's generation defaults (SmolLM2: repetition_penalty 1.1).
    want = smollm2_llm.generate(prompt, smollm2_llm.default_sampling_params(temperature=0, max_tokens=40, ignore_eos=True)).text
    proc, base = start_server(smollm2_bf16_engine, "--speculative", "ngram", "--num-draft-tokens", "6")
    try:
        client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        ask = dict(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
        assert client.completions.create(**ask, extra_body={"ignore_eos": True}).choices[0].text == want
        drafted = metric(base, "precast_spec_decode_draft_tokens_total")
        assert drafted > 0 and metric(base, "vllm:spec_decode_num_draft_tokens_total") == drafted
        assert 0 < metric(base, "vllm:spec_decode_num_accepted_tokens_total") <= drafted
        assert 0 < metric(base, "precast_spec_decode_acceptance_rate") <= 1
        opted_out = client.completions.create(**ask, extra_body={"ignore_eos": True, "speculative": False})
        assert opted_out.choices[0].text == want
        assert metric(base, "precast_spec_decode_draft_tokens_total") == drafted  # nothing proposed for it
    finally:
        stop_server(proc)


def test_triton_request_may_opt_out():
    """The Triton model's `speculative` BOOL input (from SamplingParams' schema) reaches the request."""
    from precast.runtime.triton.translate import parse_request

    inputs = {"input_ids": np.array([[1, 2, 3]], dtype=np.int32)}
    _, params, _ = parse_request(inputs.get, None)
    assert params.speculative is True
    _, params, _ = parse_request((inputs | {"speculative": np.array([[False]])}).get, None)
    assert params.speculative is False


def test_greedy_identical_on_every_tiny_architecture(tiny_engines):
    """Each tiny family (GQA, sliding windows, Gemma's soft-caps, mixtures of experts, ...): prompt lookup and a
    half-wrong scripted proposer give plain decoding's tokens, in a batch of three."""
    prompts = [[5, 17, 99, 3, 42, 8, 5, 17, 99], [7, 7, 7, 7, 7, 7], list(range(10, 50))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for name, engine in tiny_engines.items():
        with LLM(engine) as plain:
            want = [o.token_ids for o in plain.generate(prompts, params)]
        reference = {tuple(p): p + w for p, w in zip(prompts, want)}
        for speculative in ("ngram", ScriptedProposer(reference, vocab=128)):
            with LLM(engine, speculative=speculative, num_draft_tokens=4) as spec:
                got = [o.token_ids for o in spec.generate(prompts, params)]
                assert got == want, (name, speculative)
                assert spec.stats().draft_tokens > 0, name
                spec.check_integrity()
