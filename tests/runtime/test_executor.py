"""In-flight batching behaviour: batch invariance, prefix reuse, chunked prefill, preemption,
cancellation, seeds, many random requests, bad requests."""

from __future__ import annotations

import time

import numpy as np
import pytest

from precast.errors import PrecastError
from precast.runtime import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def wait_idle(llm: LLM, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = llm.stats()
        if s.active_requests == 0 and s.queued_requests == 0 and s.kv.used_blocks == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"executor did not go idle: {llm.stats().kv.used_blocks} blocks used")


def random_prompts(n: int, seed: int, lo: int = 5, hi: int = 200) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40000, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def test_batch_invariance(smollm2_llm):
    llm = smollm2_llm
    prompt = llm.apply_chat_template([{"role": "user", "content": "Describe a sunrise over the mountains."}])
    alone = llm.generate(prompt, GREEDY).token_ids
    others = random_prompts(30, seed=2)
    mixed = llm.generate([*others[:15], prompt, *others[15:]], GREEDY)
    assert mixed[15].token_ids == alone
    wait_idle(llm)
    llm.check_integrity()


def test_seed_gives_same_tokens_in_any_batch(smollm2_llm):
    llm = smollm2_llm
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate("Once upon a time", params).token_ids
    batch = llm.generate(["Once upon a time", *random_prompts(8, seed=3)], params)
    assert batch[0].token_ids == alone
    seeded = {tuple(llm.generate("Once upon a time", SamplingParams(**{**params.__dict__, "seed": s})).token_ids) for s in range(4)}
    assert len(seeded) > 1  # the seed matters


def test_prefix_reuse(smollm2_llm):
    llm = smollm2_llm
    shared = random_prompts(1, seed=4, lo=300, hi=301)[0]
    first = llm.generate(shared + [500, 600], GREEDY)
    before = llm.stats().kv
    second = llm.generate(shared + [500, 600], GREEDY)
    after = llm.stats().kv
    assert second.num_cached_tokens >= 288  # 9 full blocks of 32 of the shared prefix
    assert after.reused_blocks - before.reused_blocks >= 9
    assert after.prefix_hit_tokens > before.prefix_hit_tokens and after.hit_rate > 0
    assert second.token_ids == first.token_ids
    # A different continuation of the same prefix reuses the prefix too, and matches a cold run.
    third = llm.generate(shared + [700], GREEDY)
    assert third.num_cached_tokens >= 288
    with LLM(llm.engine.path, kv_cache_memory=256 << 20, prefix_reuse=False) as cold:
        assert cold.generate(shared + [700], GREEDY).token_ids == third.token_ids
    llm.check_integrity()


def test_chunked_prefill_and_preemption_match_unconstrained(smollm2_bf16_engine, smollm2_llm, smollm2_block_bytes):
    prompts = random_prompts(6, seed=5, lo=60, hi=120)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = [o.token_ids for o in smollm2_llm.generate(prompts, params)]
    # 16 blocks of 32 tokens hold ~3 of these requests at full length: the rest wait or get
    # preempted; 48 tokens per step forces every prompt through chunked prefill.
    with LLM(smollm2_bf16_engine, kv_cache_memory=16 * smollm2_block_bytes, max_num_tokens=48, prefix_reuse=False) as tight:
        assert tight.num_kv_blocks == 16
        outs = tight.generate(prompts, params)
        stats = tight.stats()
        assert [o.token_ids for o in outs] == reference
        assert stats.preemptions > 0
        wait_idle(tight)
        tight.check_integrity()


def test_prefix_statistics_count_each_request_once_under_retries_and_preemption(smollm2_bf16_engine, smollm2_block_bytes):
    """Requests that wait for memory are matched against the cache at every admission attempt, and a
    preempted one again when it is re-admitted; the statistics count each request's prompt once."""
    shared = random_prompts(1, seed=11, lo=96, hi=97)[0]
    tails = random_prompts(6, seed=12, lo=10, hi=60)
    prompts = [shared + tail for tail in tails]
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)  # 5 x ~8 blocks do not fit in 16
    with LLM(smollm2_bf16_engine, kv_cache_memory=16 * smollm2_block_bytes, max_num_tokens=48) as tight:
        assert tight.num_kv_blocks == 16
        first = tight.generate(prompts[0], params)  # caches the shared prefix
        before = tight.stats()
        outs = tight.generate(prompts[1:], params)
        after = tight.stats()
        assert after.preemptions > before.preemptions  # re-admissions happened
        block = tight.engine.config.limits.tokens_per_block
        cached = [o.num_cached_tokens for o in outs]
        assert any(cached) and all(c % block == 0 for c in cached)
        assert after.kv.prefix_hit_tokens - before.kv.prefix_hit_tokens == sum(cached)
        assert after.kv.reused_blocks - before.kv.reused_blocks == sum(cached) // block
        assert after.kv.prefix_query_tokens - before.kv.prefix_query_tokens == sum(len(p) for p in prompts[1:])
        assert first.num_cached_tokens == 0
        wait_idle(tight)
        tight.check_integrity()


def test_cancel_mid_stream_frees_blocks(smollm2_llm):
    llm = smollm2_llm
    stream = llm.stream(random_prompts(1, seed=6, lo=150, hi=151)[0], SamplingParams(max_tokens=500, ignore_eos=True))
    got = [next(stream) for _ in range(3)]
    assert all(not o.finished for o in got)
    assert llm.stats().kv.used_blocks > 0
    stream.close()  # closing the iterator cancels the request
    wait_idle(llm)
    llm.check_integrity()
    assert llm.cancel(got[0].request_id) is False  # already gone
    assert llm.cancel(10**9) is False  # never existed


def test_cancel_reports_cancelled(smollm2_llm):
    llm = smollm2_llm
    outputs = []
    for out in llm.stream("Count to one hundred:", SamplingParams(max_tokens=300, ignore_eos=True)):
        outputs.append(out)
        if len(outputs) == 2:
            assert llm.cancel(out.request_id)
    assert outputs[-1].finish_reason == "cancelled"
    assert len(outputs) < 300


def test_min_tokens_and_stop_token_ids(smollm2_llm):
    llm = smollm2_llm
    prompt = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    natural = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64))
    assert natural.finish_reason == "stop" and natural.token_ids[-1] in llm.eos_token_ids
    longer = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64, min_tokens=len(natural.token_ids) + 5))
    assert len(longer.token_ids) >= len(natural.token_ids) + 5
    # Stop on the first token of the natural answer's second token.
    stop_at = natural.token_ids[1]
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64, stop_token_ids=[stop_at]))
    assert cut.token_ids == natural.token_ids[:2] and cut.finish_reason == "stop"


def test_bad_words_are_never_generated(smollm2_llm):
    llm = smollm2_llm
    prompt = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, bad_words=["Paris"]))
    assert "Paris" not in out.text


def test_many_random_requests_complete(tiny_engines):
    rng = np.random.default_rng(7)
    with LLM(tiny_engines["qwen2"], kv_cache_memory=256 << 10, max_num_tokens=64) as llm:
        prompts = [rng.integers(0, 128, int(rng.integers(1, 120))).tolist() for _ in range(300)]
        params = [
            SamplingParams(
                max_tokens=int(rng.integers(1, 40)),
                temperature=float(rng.choice([0.0, 0.7, 1.3])),
                top_k=int(rng.choice([0, 5])),
                top_p=float(rng.choice([1.0, 0.8])),
                seed=int(rng.integers(0, 1000)),
                repetition_penalty=float(rng.choice([1.0, 1.2])),
                logprobs=int(rng.choice([0, 3])),
            )
            for _ in prompts
        ]
        outs = llm.generate(prompts, params)  # one SamplingParams per prompt
        assert all(o.finished for o in outs)
        for o, sp in zip(outs, params):
            assert o.finish_reason == "length" and len(o.token_ids) == sp.max_tokens
            assert len(o.logprobs) == sp.max_tokens
        assert llm.stats().preemptions > 0  # 10 blocks of 32 tokens cannot hold them all
        wait_idle(llm)
        llm.check_integrity()


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        ([], SamplingParams(), "prompt is empty"),
        ([7] * 300, SamplingParams(), "max_seq_len is 256"),
        ([1, 2, 3], SamplingParams(max_tokens=300), "exceeds max_seq_len"),
        ([1, 2, 3], SamplingParams(temperature=-1), "temperature must be >= 0"),
        ([1, 2, 3], SamplingParams(top_p=0), "top_p must be in"),
        ([1, 2, 3], SamplingParams(top_k=-2), "top_k must be"),
        ([1, 2, 3], SamplingParams(presence_penalty=3), "presence_penalty must be in"),
        ([1, 2, 3], SamplingParams(max_tokens=0), "max_tokens must be"),
        ([1, 2, 3], SamplingParams(logprobs=50), "logprobs must be"),
        ([1, 2, 3], SamplingParams(stop_token_ids=[10**6]), "outside the vocabulary"),
        ([5000], SamplingParams(), "outside the vocabulary"),
        ("text", SamplingParams(), "no tokenizer"),
    ],
)
def test_bad_requests_are_rejected_and_the_loop_survives(tiny_engines, prompt, params, message):
    with LLM(tiny_engines["llama"], kv_cache_memory=8 << 20) as llm:
        with pytest.raises(PrecastError, match=message):
            llm.generate(prompt, params)
        assert len(llm.generate([1, 2, 3], SamplingParams(max_tokens=3)).token_ids) == 3


def test_request_larger_than_the_kv_pool(tiny_engines):
    with LLM(tiny_engines["llama"], kv_cache_memory=3 * 32 * 2 * 3 * 2 * 16 * 4) as llm:  # 3 blocks
        with pytest.raises(PrecastError, match="needs 4 KV blocks .* the whole cache has 3"):
            llm.generate(list(range(1, 100)), SamplingParams(max_tokens=2))
        assert len(llm.generate([1, 2], SamplingParams(max_tokens=2)).token_ids) == 2


def test_unknown_engine_dir(tmp_path):
    with pytest.raises(PrecastError, match="does not exist"):
        LLM(tmp_path / "nope")


def test_executor_limits_cannot_exceed_the_engine(tiny_engines):
    with pytest.raises(PrecastError, match="outside the engine's build limit"):
        LLM(tiny_engines["llama"], max_batch_size=10_000)


def test_prompt_logprobs_survive_chunking_and_preemption(smollm2_bf16_engine, smollm2_llm, smollm2_block_bytes):
    prompts = random_prompts(6, seed=9, lo=60, hi=120)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    reference = smollm2_llm.generate(prompts, params)
    with LLM(smollm2_bf16_engine, kv_cache_memory=16 * smollm2_block_bytes, max_num_tokens=48, prefix_reuse=False) as tight:
        outs = tight.generate(prompts, params)
        assert tight.stats().preemptions > 0
        wait_idle(tight)
        tight.check_integrity()
    for prompt, ref, out in zip(prompts, reference, outs):
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs == ref.prompt_logprobs
        assert out.prompt_top_logprobs == ref.prompt_top_logprobs and out.token_ids == ref.token_ids


_UNIT_SCRIPT = """
import json, sys
import numpy as np
from precast import _C
from precast.runtime import LLM, SamplingParams
rng = np.random.default_rng(21)
prompts = [rng.integers(100, 40000, int(n)).tolist() for n in rng.integers(60, 120, 5)]
params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
with LLM(sys.argv[1], kv_cache_memory=256 << 20, prefix_reuse=False) as llm:
    alone = [llm.generate(p, params) for p in prompts[:2]]
    together = llm.generate(prompts, params)
with LLM(sys.argv[1], kv_cache_memory=256 << 20, prefix_reuse=False, max_num_tokens=16) as chunked:
    small_steps = chunked.generate(prompts, params)
def key(o):
    return [o.token_ids, [lp for lp in o.logprobs]]
print(json.dumps({
    "unit": _C.dot_unit(),
    "batch": [key(a) == key(t) for a, t in zip(alone, together)],
    "chunked": [key(a) == key(b) for a, b in zip(together, small_steps)],
}))
"""


@pytest.mark.parametrize("unit", __import__("precast._C", fromlist=["dot_units"]).dot_units())
def test_every_dot_unit_keeps_batches_and_chunks_bit_identical(unit, smollm2_bf16_engine):
    """bf16 engines multiply on the process's dot-product unit (AMX, AVX512-BF16 or float32 FMAs;
    PRECAST_CPU_DOT picks one). On each unit this host has, a request's tokens and log-probs are the
    same alone, in a batch, and through 16-token prefill chunks."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "PRECAST_CPU_DOT": unit}
    done = subprocess.run(
        [sys.executable, "-c", _UNIT_SCRIPT, str(smollm2_bf16_engine)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["unit"] == unit
    assert all(result["batch"]) and all(result["chunked"]), result


def test_an_unknown_dot_unit_is_refused_clearly(smollm2_bf16_engine):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PRECAST_CPU_DOT": "tpu"}
    script = "import sys; from precast.runtime import LLM; LLM(sys.argv[1], kv_cache_memory=64 << 20)"
    done = subprocess.run([sys.executable, "-c", script, str(smollm2_bf16_engine)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "unknown dot-product unit 'tpu': use auto, amx, avx512_bf16 or float32" in done.stderr
