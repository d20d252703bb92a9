"""The Triton model's custom metrics, named after tensorrtllm_backend's, refreshed from executor stats."""

from __future__ import annotations

import asyncio
from typing import Any

try:
    import triton_python_backend_utils as pb_utils  # provided by Triton's python backend stub
except ImportError:  # imported outside Triton
    pb_utils = None


class TritonMetrics:
    def __init__(self, model: str) -> None:
        gauge = pb_utils.MetricFamily.GAUGE
        self.requests = pb_utils.MetricFamily(name="precast_request_metrics", description="precast requests by state", kind=gauge)
        self.kv = pb_utils.MetricFamily(name="precast_kv_cache_block_metrics", description="precast KV cache blocks", kind=gauge)
        self.general = pb_utils.MetricFamily(name="precast_general_metrics", description="precast executor counters", kind=gauge)
        self.tokens = pb_utils.MetricFamily(name="precast_token_metrics", description="precast token counts", kind=gauge)
        self.values: dict[tuple[str, str], Any] = {}
        for family, label, names in (
            (self.requests, "request_type", ("active", "queued", "scheduled", "context", "decode", "max")),
            (self.kv, "kv_cache_block_type", ("max", "free", "used", "reused", "tokens_per")),
            (self.general, "general_type", ("iteration_counter", "preemptions")),
            (self.tokens, "token_type", ("input", "output")),
        ):
            for n in names:
                self.values[(label, n)] = family.Metric(labels={"model": model, label: n})

    def update(self, llm: Any) -> None:
        s = llm.stats()
        kv = s.kv
        values = {
            ("request_type", "active"): s.active_requests,
            ("request_type", "queued"): s.queued_requests,
            ("request_type", "scheduled"): s.scheduled_requests,
            ("request_type", "context"): s.context_requests,
            ("request_type", "decode"): s.decode_requests,
            ("request_type", "max"): llm.engine.config.limits.max_batch_size,
            ("kv_cache_block_type", "max"): kv.max_blocks,
            ("kv_cache_block_type", "free"): kv.free_blocks,
            ("kv_cache_block_type", "used"): kv.used_blocks,
            ("kv_cache_block_type", "reused"): kv.reused_blocks,
            ("kv_cache_block_type", "tokens_per"): kv.tokens_per_block,
            ("general_type", "iteration_counter"): s.iterations,
            ("general_type", "preemptions"): s.preemptions,
            ("token_type", "input"): s.prompt_tokens,
            ("token_type", "output"): s.generated_tokens,
        }
        for key, v in values.items():
            self.values[key].set(float(v))

    async def run(self, llm: Any) -> None:
        while True:
            self.update(llm)
            await asyncio.sleep(0.2)
