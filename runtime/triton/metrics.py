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


class TritonMetrics:
    def __init__(self, model: str) -> None:
        gauge = pb_utils.MetricFamily.GAUGE  # counters too, as tensorrtllm_backend exports them
        self.values: dict[tuple[str, str, str], Any] = {}
        self.families: list[Any] = []  # a family that is garbage collected takes its metrics with it
        for family, description, label, names in (
            ("precast_request_metrics", "precast requests by state", "request_type", ("active", "queued", "scheduled", "context", "decode", "max")),
            ("precast_kv_cache_block_metrics", "precast KV cache blocks", "kv_cache_block_type", ("max", "free", "used", "reused", "tokens_per")),
            ("precast_general_metrics", "precast executor counters", "general_type", ("iteration_counter", "preemptions")),
            ("precast_token_metrics", "precast token counts", "token_type", ("input", "output")),
            ("nv_trt_llm_request_metrics", "TRT LLM request metrics", "request_type", ("active", "max", "scheduled", "context", "waiting")),
            ("nv_trt_llm_kv_cache_block_metrics", "TRT LLM KV cache block metrics", "kv_cache_block_type", ("max", "free", "used", "tokens_per", "fraction")),
            ("nv_trt_llm_inflight_batcher_metrics", "TRT LLM inflight batcher metrics", "inflight_batcher_specific_metric",
             ("total_context_tokens", "generation_requests", "micro_batch_id")),
            ("nv_trt_llm_general_metrics", "General TRT LLM metrics", "general_type", ("iteration_counter", "timestamp")),
        ):  # fmt: skip
            metric_family = pb_utils.MetricFamily(name=family, description=description, kind=gauge)
            self.families.append(metric_family)
            labels = {"model": model} | ({"version": "1"} if family.startswith("nv_trt_llm") else {})
            for n in names:
                self.values[(family, label, n)] = metric_family.Metric(labels=labels | {label: n})

    def update(self, llm: Any) -> None:
        s = llm.stats()
        kv = s.kv
        max_requests = llm.engine.config.limits.max_batch_size
        values = {
            ("precast_request_metrics", "active"): s.active_requests,
            ("precast_request_metrics", "queued"): s.queued_requests,
            ("precast_request_metrics", "scheduled"): s.scheduled_requests,
            ("precast_request_metrics", "context"): s.context_requests,
            ("precast_request_metrics", "decode"): s.decode_requests,
            ("precast_request_metrics", "max"): max_requests,
            ("precast_kv_cache_block_metrics", "max"): kv.max_blocks,
            ("precast_kv_cache_block_metrics", "free"): kv.free_blocks,
            ("precast_kv_cache_block_metrics", "used"): kv.used_blocks,
            ("precast_kv_cache_block_metrics", "reused"): kv.reused_blocks,
            ("precast_kv_cache_block_metrics", "tokens_per"): kv.tokens_per_block,
            ("precast_general_metrics", "iteration_counter"): s.iterations,
            ("precast_general_metrics", "preemptions"): s.preemptions,
            ("precast_token_metrics", "input"): s.prompt_tokens,
            ("precast_token_metrics", "output"): s.generated_tokens,
            ("nv_trt_llm_request_metrics", "active"): s.active_requests,
            ("nv_trt_llm_request_metrics", "max"): max_requests,
            ("nv_trt_llm_request_metrics", "scheduled"): s.scheduled_requests,
            ("nv_trt_llm_request_metrics", "context"): s.context_requests,
            ("nv_trt_llm_request_metrics", "waiting"): s.queued_requests,
            ("nv_trt_llm_kv_cache_block_metrics", "max"): kv.max_blocks,
            ("nv_trt_llm_kv_cache_block_metrics", "free"): kv.free_blocks,
            ("nv_trt_llm_kv_cache_block_metrics", "used"): kv.used_blocks,
            ("nv_trt_llm_kv_cache_block_metrics", "tokens_per"): kv.tokens_per_block,
            ("nv_trt_llm_kv_cache_block_metrics", "fraction"): kv.used_blocks / max(kv.max_blocks, 1),
            ("nv_trt_llm_inflight_batcher_metrics", "total_context_tokens"): s.step_prompt_tokens,
            ("nv_trt_llm_inflight_batcher_metrics", "generation_requests"): s.decode_requests,
            ("nv_trt_llm_inflight_batcher_metrics", "micro_batch_id"): 0,  # one micro-batch: no pipeline parallelism
            ("nv_trt_llm_general_metrics", "iteration_counter"): s.iterations,
            ("nv_trt_llm_general_metrics", "timestamp"): time.time() * 1e6,  # microseconds since the epoch
        }
        for (family, name), v in values.items():
            self.values[(family, self._label(family), name)].set(float(v))

    def _label(self, family: str) -> str:
        return next(label for (f, label, _) in self.values if f == family)

    async def run(self, llm: Any) -> None:
        while True:
            self.update(llm)
            await asyncio.sleep(0.2)
