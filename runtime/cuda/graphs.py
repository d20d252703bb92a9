"""CUDA graphs for decode steps: one graph per batch-size bucket, captured at first use, replayed after.

A decode-only step (every sequence one new token, sampled) is padded to the next bucket. Its metadata goes into
the bucket's static device tensors; padded rows read token 0 at position 0 and write their K/V into the
runner's scratch block (one block past those the executor hands out), so they touch no request's cache.
Kernels read lengths and block tables from device memory, so one capture serves every later step of that size.

Without a GPU (TRITON_INTERPRET=1) nothing is captured: the same padded static batch runs eagerly, so the
padding and the static buffers are what the tests check; capture and replay have not run anywhere yet.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from precast.plugins.triton.attention import AttentionBatch

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(self, runner: Any, max_batch_size: int, capture: bool):
        self.runner = runner
        self.torch = runner.torch
        self.capture = capture
        self.buckets = sorted({b for b in BUCKETS if b < max_batch_size} | {max_batch_size})
        B = runner.tokens_per_block
        self.max_blocks = -(-runner.max_positions // B)
        self.static: dict[int, tuple[Any, Any, Any]] = {}  # bucket -> (StepInputs, graph or None, logits)
        self.pool = self.torch.cuda.graph_pool_handle() if capture else None

    def takes(self, seqs: list[Any]) -> bool:
        return 0 < len(seqs) <= self.buckets[-1] and all(s.num_tokens == 1 and s.sample and not s.all_logits for s in seqs)

    def run(self, batch: Any) -> Any:
        seqs = list(batch.sequences)
        n = len(seqs)
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        step, graph, logits = self.static.get(bucket) or self._make(bucket)
        runner, B = self.runner, self.runner.tokens_per_block
        positions = np.zeros(bucket, np.int32)
        positions[:n] = batch.positions
        token_ids = np.zeros(bucket, np.int32)
        token_ids[:n] = batch.token_ids
        runner.check_batch(token_ids, positions)
        tables = np.full((bucket, self.max_blocks), runner.scratch_block, np.int32)
        slot_blocks = np.full(bucket, runner.scratch_block, np.int32)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = s.block_table
            slot_blocks[i] = s.block_table[positions[i] // B]
        context = positions.copy()  # one new token each: its position is the context before it
        for target, values in (
            (step.token_ids, token_ids),
            (step.positions, positions),
            (step.slot_blocks, slot_blocks),
            (step.slot_offsets, positions % B),
            (step.attention.block_tables, tables),
            (step.attention.context_lens, context),
        ):
            target.copy_(self.torch.from_numpy(values), non_blocking=False)
        if graph is not None:
            graph.replay()
        else:
            logits = runner.compute(step)
        return logits[:n]

    def _make(self, bucket: int) -> tuple[Any, Any, Any]:
        """The bucket's static inputs (every row padding until filled), its graph (captured after a warm-up that
        compiles every kernel) and the graph's output tensor."""
        torch, runner = self.torch, self.runner
        device, group = runner.device, runner.spec.num_heads // runner.spec.num_kv_heads
        tables = [[runner.scratch_block] * self.max_blocks] * bucket
        attention = AttentionBatch.make(tables, [0] * bucket, [1] * bucket, list(range(bucket)), group, device, tokens_per_tile=1)

        def zeros(dtype: Any = torch.int32) -> Any:
            return torch.zeros(bucket, dtype=dtype, device=device)

        from precast.runtime.cuda.runner import StepInputs

        slots = torch.full((bucket,), runner.scratch_block, dtype=torch.int32, device=device)
        step = StepInputs(zeros(), zeros(), slots, zeros(), attention, torch.arange(bucket, dtype=torch.int64, device=device))
        graph, logits = None, None
        if self.capture:  # pragma: no cover - needs a GPU
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    runner.compute(step)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = runner.compute(step)
        self.static[bucket] = (step, graph, logits)
        return self.static[bucket]
