"""The TensorRT runner's host side on CPU: executor batches packed into the network's padded slot steps, run
through the numpy evaluation of the plan's network (backend 'tensorrt-reference'), over many steps."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from precast.builder.build import BuildOptions, build_engine
from precast.engine.directory import load_engine
from precast.runtime import LLM, SamplingParams
from precast.runtime.tensorrt.runner import TensorRTRunner


@pytest.fixture(scope="module")
def planned(tiny_checkpoints, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trt-runner") / "engine"
    build_engine(
        BuildOptions(
            tiny_checkpoints["qwen3"],
            out,
            dtype="float32",
            max_seq_len=96,
            max_batch_size=4,
            max_num_tokens=32,
            targets=("cpu", "tensorrt"),
            progress=False,
        )
    )
    return out


def test_multi_step_generation_matches_the_cpu_runner(planned):
    """Five requests over four slots (one waits), prompts longer than a step (chunked prefill), mixed
    prefill/decode steps: the same greedy tokens as the CPU runner and log-probs within float32 noise."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 128, n).tolist() for n in (3, 45, 17, 60, 8)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    with LLM(planned) as cpu:
        want = cpu.generate(prompts, params)
    with LLM(planned, backend="tensorrt-reference", max_num_tokens=16) as ref:
        got = ref.generate(prompts, params)
        ref.check_integrity()
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)


def batch(seqs: list[tuple[int, int, int, bool]]) -> SimpleNamespace:
    """(slot, context_len, num_tokens, sample) per sequence, packed as the executor packs them."""
    tokens, out, offset = [], [], 0
    for slot, ctx, n, sample in seqs:
        tokens += list(range(100 + offset, 100 + offset + n))
        out.append(SimpleNamespace(block_table=[slot], context_len=ctx, num_tokens=n, token_offset=offset, sample=sample))
        offset += n
    return SimpleNamespace(token_ids=tokens, sequences=out, num_sampling=lambda: sum(s.sample for s in out))


def test_packing_pads_each_slot_and_never_writes_over_cached_tokens(planned):
    runner = TensorRTRunner(load_engine(planned), step=None, activation_dtype="float32")
    runner.slot_lengths = [0, 50, 0, 7]  # slot 3 is idle this step, with 7 cached positions
    feeds, slots = runner.pack(batch([(0, 0, 5, True), (1, 50, 1, True), (2, 10, 3, False)]))
    step = 5
    assert feeds["input_ids"].shape == (4, step)
    np.testing.assert_array_equal(feeds["input_ids"][0], [100, 101, 102, 103, 104])
    np.testing.assert_array_equal(feeds["input_ids"][1], [105, 0, 0, 0, 0])  # a decode token, then filler
    np.testing.assert_array_equal(feeds["write_indices"], [0, 50, 10, 7])  # idle slot 3 writes past its 7 tokens
    np.testing.assert_array_equal(feeds["kv_lengths"], feeds["write_indices"] + step)
    np.testing.assert_array_equal(feeds["position_ids"][1], [50, 51, 52, 53, 54])
    np.testing.assert_array_equal(feeds["last_token_ids"], [0 * step + 4, 1 * step + 0])  # sampled sequences, in order
    assert slots == [(0, 5), (1, 51), (2, 13)]


def test_steps_outside_the_build_limits_are_refused(planned):
    runner = TensorRTRunner(load_engine(planned), step=None, activation_dtype="float32")
    with pytest.raises(ValueError, match="exceeds the plan's max_num_tokens 32"):
        runner.pack(batch([(0, 0, 33, True)]))
    with pytest.raises(ValueError, match="exceed the plan's max_seq_len 96"):
        runner.pack(batch([(0, 90, 10, True)]))
    with pytest.raises(ValueError, match="outside the plan's 4 slots"):
        runner.pack(batch([(4, 0, 1, True)]))
    with pytest.raises(ValueError, match="the TensorRT plan has 4 slots"):
        runner.configure_kv(5, 96)


def test_prompt_longer_than_the_plan_is_a_clear_error(planned):
    from precast.errors import PrecastError

    with LLM(planned, backend="tensorrt-reference") as ref:
        with pytest.raises(PrecastError, match="this engine's max_seq_len is 96"):
            ref.generate(list(range(1, 100)), SamplingParams(max_tokens=4))
        assert ref.generate([1, 2, 3], SamplingParams(max_tokens=2)).token_ids  # and it keeps serving
