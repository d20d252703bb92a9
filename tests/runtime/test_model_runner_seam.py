"""Runners written in Python plug into the C++ executor (the seam the TensorRT runner uses)."""

from __future__ import annotations

import time

import numpy as np

from precast import _C

VOCAB = 50


class CountingRunner(_C.ModelRunner):
    """A fake model whose next token is always (last token + 1) mod VOCAB; records what it sees."""

    def __init__(self, slot_mode: bool = False) -> None:
        super().__init__()
        self._slot = slot_mode
        self.batches: list[list[tuple[int, int, int, list[int]]]] = []
        self.kv: tuple[int, int] | None = None

    def vocab_size(self) -> int:
        return VOCAB

    def kv_block_bytes(self, tokens_per_block: int) -> int:
        return tokens_per_block * 8

    def configure_kv(self, num_blocks: int, tokens_per_block: int) -> None:
        self.kv = (num_blocks, tokens_per_block)

    def slot_mode(self) -> bool:
        return self._slot

    def forward(self, batch):
        ids = batch.token_ids
        rows = []
        self.batches.append([(s.context_len, s.num_tokens, s.token_offset, list(s.block_table)) for s in batch.sequences])
        for s in batch.sequences:
            if s.sample:
                logits = np.zeros(VOCAB, np.float32)
                logits[(ids[s.token_offset + s.num_tokens - 1] + 1) % VOCAB] = 10.0
                rows.append(logits)
        return np.stack(rows) if rows else np.zeros((0, VOCAB), np.float32)


def run(executor, requests: list) -> dict[int, list[int]]:
    ids = [executor.enqueue(r) for r in requests]
    out: dict[int, list[int]] = {i: [] for i in ids}
    done: set[int] = set()
    deadline = time.time() + 30
    while len(done) < len(ids) and time.time() < deadline:
        for resp in executor.await_responses(0.5):
            out[resp.request_id] += list(resp.new_tokens)
            if resp.finished:
                assert resp.finish_reason == _C.FinishReason.LENGTH, resp.error
                done.add(resp.request_id)
    return out


def request(prompt: list[int], max_tokens: int) -> _C.Request:
    r = _C.Request()
    r.prompt = prompt
    r.max_tokens = max_tokens
    s = _C.SamplingParams()
    s.temperature = 0
    r.sampling = s
    return r


def config(**kw) -> _C.ExecutorConfig:
    c = _C.ExecutorConfig()
    c.max_seq_len, c.max_num_tokens, c.max_batch_size, c.tokens_per_block, c.kv_cache_bytes = 64, 16, 4, 4, 8 * 4 * 40
    for k, v in kw.items():
        setattr(c, k, v)
    return c


def test_python_runner_drives_the_executor():
    runner = CountingRunner()
    ex = _C.Executor(config(), runner)
    try:
        assert runner.kv == (40, 4)
        out = run(ex, [request([1, 2, 3], 5), request(list(range(10, 30)), 4)])
        assert list(out.values()) == [[4, 5, 6, 7, 8], [30, 31, 32, 33]]
        # The 20-token prompt did not fit the 16-token budget: it was chunked.
        chunks = [(ctx, n) for b in runner.batches for ctx, n, _, _ in b if n > 1 and ctx + n <= 20 and n != 3]
        assert len(chunks) == 2 and chunks[0][0] == 0 and chunks[1][0] == chunks[0][1] and sum(n for _, n in chunks) == 20
        ex.check_integrity()
    finally:
        ex.shutdown()


def test_slot_mode_gives_each_request_one_whole_sequence_region():
    runner = CountingRunner(slot_mode=True)
    ex = _C.Executor(config(kv_cache_bytes=1 << 20), runner)
    try:
        num_slots, tokens_per_slot = runner.kv
        assert num_slots == 4 and tokens_per_slot == 64  # max_batch_size slots of max_seq_len tokens
        out = run(ex, [request([i, i + 1], 6) for i in range(6)])
        assert all(len(v) == 6 for v in out.values())
        for b in runner.batches:
            slots = [table for *_, table in b]
            assert all(len(t) == 1 for t in slots) and len({t[0] for t in slots}) == len(slots)
        assert ex.stats().kv.reused_blocks == 0
    finally:
        ex.shutdown()


def test_runner_failure_ends_requests_with_an_error_and_the_loop_survives():
    class Failing(CountingRunner):
        fail = True

        def forward(self, batch):
            if self.fail:
                self.fail = False
                raise RuntimeError("device lost")
            return super().forward(batch)

    ex = _C.Executor(config(), Failing())
    try:
        rid = ex.enqueue(request([1, 2], 3))
        resp = []
        while not any(r.finished for r in resp):
            resp += ex.await_responses(1.0)
        assert resp[-1].request_id == rid and resp[-1].finish_reason == _C.FinishReason.ERROR
        assert "device lost" in resp[-1].error
        assert list(run(ex, [request([5], 2)]).values()) == [[6, 7]]
        ex.check_integrity()
    finally:
        ex.shutdown()


def test_non_finite_logits_end_that_request_with_an_error():
    """A NaN or Inf row would be sampled as token 0 with NaN log-probs; it ends its request instead."""

    class Poisoned(CountingRunner):
        def forward(self, batch):
            rows = super().forward(batch)
            for row, s in zip(rows, [s for s in batch.sequences if s.sample]):
                if batch.token_ids[s.token_offset] == 7:  # requests whose prompt starts with 7
                    row[3] = np.nan if s.context_len == 0 else np.inf
            return rows

    ex = _C.Executor(config(), Poisoned())
    try:
        bad, good = ex.enqueue(request([7, 1], 3)), ex.enqueue(request([1, 2], 3))
        finals = {}
        while len(finals) < 2:
            finals |= {r.request_id: r for r in ex.await_responses(1.0) if r.finished}
        assert finals[bad].finish_reason == _C.FinishReason.ERROR and "non-finite logits" in finals[bad].error
        assert finals[good].finish_reason == _C.FinishReason.LENGTH  # the batch's other request is unharmed
        ex.check_integrity()
    finally:
        ex.shutdown()


def test_evaluate_leaves_the_serving_kv_pool_alone(smollm2_bf16_engine):
    """evaluate runs in its own pool: a sequence longer than the whole serving pool neither reallocates nor
    overwrites it, so a prefix cached before it is still reused correctly after it."""
    from precast.engine.directory import load_engine
    from precast.runtime.cpu_backend import make_cpu_runner
    from precast.runtime.sampling_params import SamplingParams

    engine = load_engine(smollm2_bf16_engine)
    runner = make_cpu_runner(engine)
    config = _C.ExecutorConfig()
    config.max_batch_size, config.max_num_tokens, config.max_seq_len, config.tokens_per_block = 4, 256, 512, 32
    config.kv_cache_bytes = 12 * runner.kv_block_bytes(32)
    executor = _C.Executor(config, runner)
    try:
        prompt = [(7 * i) % 1000 + 5 for i in range(200)]
        greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        first = run(executor, [greedy.to_request(prompt, False, [])])
        before = runner.evaluate(prompt[:40], True)
        runner.evaluate([(3 * i) % 1000 + 5 for i in range(12 * 32 + 50)], False)  # longer than the serving pool
        np.testing.assert_array_equal(runner.evaluate(prompt[:40], True), before)
        again = run(executor, [greedy.to_request(prompt, False, [])])  # its prefix comes from the serving pool
        assert executor.stats().kv.reused_blocks >= 6
        assert list(again.values()) == list(first.values())
        executor.check_integrity()
    finally:
        executor.shutdown()
