"""The Triton model's custom metrics, refreshed from executor stats: precast's own families, and the same numbers
under tensorrtllm_backend's `nv_trt_llm_*` names and labels, so dashboards made for it read precast too."""

from __future__ import annotations

import asyncio
import time
from typing import Any

try:
    import triton_python_backend_utils as pb_utils  # provided by Triton's python backend stub
except ImportError:  # imported outside Triton
    pb_utils = None


# family -> (description, label, {label value: quantity in TritonMetrics.quantities}). precast's own families, then
# tensorrtllm_backend's, which also carry version="1". Counters come first: an update sets the metrics one by one
# while Triton may be scraping, and a scrape that shows a request gone (the gauges) must already show every token it
# produced (the counters).
FAMILIES: dict[str, tuple[str, str, dict[str, str]]] = {
    "precast_token_metrics": ("precast token counts", "token_type", {"input": "prompt_tokens", "output": "generated_tokens"}),
    "precast_general_metrics": ("precast executor counters", "general_type",
                                {"iteration_counter": "iterations", "preemptions": "preemptions"}),
    "precast_speculative_metrics": ("precast speculative decoding", "speculative_type",
                                    {"draft_tokens": "draft_tokens", "accepted_draft_tokens": "accepted_draft_tokens",
                                     "steps": "speculative_steps", "acceptance_rate": "acceptance_rate"}),
    "nv_trt_llm_general_metrics": ("General TRT LLM metrics", "general_type",
                                   {"iteration_counter": "iterations", "timestamp": "timestamp_us"}),
    "precast_request_metrics": ("precast requests by state", "request_type",
                                {"active": "active", "queued": "queued", "scheduled": "scheduled", "context": "context",
                                 "decode": "decode", "max": "max_requests"}),
    "precast_kv_cache_block_metrics": ("precast KV cache blocks", "kv_cache_block_type",
                                       {"max": "max_blocks", "free": "free_blocks", "used": "used_blocks",
                                        "reused": "reused_blocks", "tokens_per": "tokens_per_block"}),
    "nv_trt_llm_request_metrics": ("TRT LLM request metrics", "request_type",
                                   {"active": "active", "max": "max_requests", "scheduled": "scheduled", "context": "context",
                                    "waiting": "queued"}),
    "nv_trt_llm_kv_cache_block_metrics": ("TRT LLM KV cache block metrics", "kv_cache_block_type",
                                          {"max": "max_blocks", "free": "free_blocks", "used": "used_blocks",
                                           "tokens_per": "tokens_per_block", "fraction": "used_fraction"}),
    "nv_trt_llm_inflight_batcher_metrics": ("TRT LLM inflight batcher metrics", "inflight_batcher_specific_metric",
                                            {"total_context_tokens": "step_prompt_tokens", "generation_requests": "decode",
                                             "micro_batch_id": "micro_batch_id"}),
}  # fmt: skip


class TritonMetrics:
    def __init__(self, model: str) -> None:
        self.families: list[Any] = []  # a family that is garbage collected takes its metrics with it
        self.metrics: list[tuple[Any, str]] = []  # (metric, quantity it shows)
        for family, (description, label, shown) in FAMILIES.items():
            # Gauges throughout, counters too, as tensorrtllm_backend exports them.
            metric_family = pb_utils.MetricFamily(name=family, description=description, kind=pb_utils.MetricFamily.GAUGE)
            self.families.append(metric_family)
            labels = {"model": model} | ({"version": "1"} if family.startswith("nv_trt_llm") else {})
            for value, quantity in shown.items():
                self.metrics.append((metric_family.Metric(labels=labels | {label: value}), quantity))

    @staticmethod
    def quantities(llm: Any) -> dict[str, float]:
        s = llm.stats()
        kv = s.kv
        return {
            "active": s.active_requests,
            "queued": s.queued_requests,
            "scheduled": s.scheduled_requests,
            "context": s.context_requests,
            "decode": s.decode_requests,
            "max_requests": llm.engine.config.limits.max_batch_size,
            "max_blocks": kv.max_blocks,
            "free_blocks": kv.free_blocks,
            "used_blocks": kv.used_blocks,
            "reused_blocks": kv.reused_blocks,
            "tokens_per_block": kv.tokens_per_block,
            "used_fraction": kv.used_blocks / max(kv.max_blocks, 1),
            "iterations": s.iterations,
            "preemptions": s.preemptions,
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "step_prompt_tokens": s.step_prompt_tokens,
            "draft_tokens": s.draft_tokens,
            "accepted_draft_tokens": s.accepted_draft_tokens,
            "speculative_steps": s.speculative_steps,
            "acceptance_rate": s.accepted_draft_tokens / max(s.draft_tokens, 1),
            "micro_batch_id": 0,  # one micro-batch: no pipeline parallelism
            "timestamp_us": time.time() * 1e6,
        }

    def update(self, llm: Any) -> None:
        values = self.quantities(llm)
        for metric, quantity in self.metrics:
            metric.set(float(values[quantity]))

    async def run(self, llm: Any) -> None:
        while True:
            self.update(llm)
            await asyncio.sleep(0.2)
