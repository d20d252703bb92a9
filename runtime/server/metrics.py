"""Prometheus metrics: executor state read at scrape time, latencies observed per request.

Every family is exported twice: under precast's names, and under the vLLM names that llm-d's scheduler, Dynamo's
planner and existing dashboards read (`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, the prefix-cache
counters, TTFT / ITL histograms), with the same `model_name` label.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# (kind, precast name, vLLM name or None, help, quantity in _ExecutorCollector.quantities)
_EXECUTOR_FAMILIES = [
    ("gauge", "precast_num_requests_running", "vllm:num_requests_running", "Requests holding KV cache (being generated).", "running"),
    ("gauge", "precast_num_requests_waiting", "vllm:num_requests_waiting", "Requests queued for admission.", "waiting"),
    ("gauge", "precast_kv_cache_blocks_used", None, "KV cache blocks referenced by requests.", "used_blocks"),
    ("gauge", "precast_kv_cache_blocks_free", None, "KV cache blocks available (free or cached and evictable).", "free_blocks"),
    ("gauge", "precast_kv_cache_blocks_max", None, "KV cache blocks in the pool.", "max_blocks"),
    ("gauge", "precast_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 is all).", "usage"),
    ("gauge", "precast_prefix_cache_hit_rate", None, "Prompt tokens served from the prefix cache / prompt tokens looked up.", "hit_rate"),
    ("counter", "precast_prefix_cache_queries", "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "queries"),
    ("counter", "precast_prefix_cache_hits", "vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", "hits"),
    ("counter", "precast_prompt_tokens", "vllm:prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).", "prompt_tokens"),
    ("counter", "precast_generation_tokens", "vllm:generation_tokens", "Tokens generated.", "generated_tokens"),
    ("counter", "precast_num_preemptions", "vllm:num_preemptions", "Requests preempted for lack of KV cache blocks.", "preemptions"),
    ("counter", "precast_iterations", None, "Executor steps run.", "iterations"),
    # Speculative decoding (zero without it); vLLM's spec_decode counters.
    ("counter", "precast_spec_decode_draft_tokens", "vllm:spec_decode_num_draft_tokens", "Proposed tokens checked by the target.", "draft_tokens"),
    ("counter", "precast_spec_decode_accepted_tokens", "vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.", "accepted_draft_tokens"),
    ("counter", "precast_spec_decode_drafts", "vllm:spec_decode_num_drafts", "Request-steps that checked proposed tokens.", "speculative_steps"),
    ("gauge", "precast_spec_decode_acceptance_rate", None, "Accepted / proposed tokens so far.", "acceptance_rate"),
    ("gauge", "precast_spec_decode_mean_accepted_tokens", None, "Accepted proposed tokens per request-step that checked some.", "mean_accepted"),
    ("counter", "precast_spec_decode_draft_seconds", None, "Time spent proposing tokens.", "draft_seconds"),
    ("counter", "precast_spec_decode_verify_seconds", None, "Time in forward passes that checked proposed tokens.", "verify_seconds"),
]  # fmt: skip


class _ExecutorCollector(Collector):
    def __init__(self, llm: Any, model: str) -> None:
        self.llm = llm
        self.model = model

    def quantities(self) -> dict[str, float]:
        s = self.llm.stats()
        kv = s.kv
        return {
            "running": s.active_requests,
            "waiting": s.queued_requests,
            "used_blocks": kv.used_blocks,
            "free_blocks": kv.free_blocks,
            "max_blocks": kv.max_blocks,
            "usage": kv.used_blocks / max(kv.max_blocks, 1),
            "hit_rate": kv.hit_rate,
            "queries": kv.prefix_query_tokens,
            "hits": kv.prefix_hit_tokens,
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "preemptions": s.preemptions,
            "iterations": s.iterations,
            "draft_tokens": s.draft_tokens,
            "accepted_draft_tokens": s.accepted_draft_tokens,
            "speculative_steps": s.speculative_steps,
            "acceptance_rate": s.accepted_draft_tokens / max(s.draft_tokens, 1),
            "mean_accepted": s.accepted_draft_tokens / max(s.speculative_steps, 1),
            "draft_seconds": s.draft_seconds,
            "verify_seconds": s.verify_seconds,
        }

    def collect(self) -> Iterator[Any]:
        values = self.quantities()  # one snapshot: both names of a family show the same value
        for kind, name, vllm_name, doc, quantity in _EXECUTOR_FAMILIES:
            for metric_name in (name, vllm_name):
                if metric_name is None:
                    continue
                family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(metric_name, doc, labels=["model_name"])
                family.add_metric([self.model], values[quantity])
                yield family


class ServerMetrics:
    def __init__(self, llm: Any, model: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_ExecutorCollector(llm, model))
        self.model = model

        def histograms(suffix: str, doc: str) -> list[Histogram]:
            made = [
                Histogram(prefix + suffix, doc, ["model_name"], buckets=_LATENCY_BUCKETS, registry=self.registry)
                for prefix in ("precast_", "vllm:")
            ]
            for h in made:
                h.labels(model)  # exported from the start (zero counts), not from the first request on
            return made

        self.ttft = histograms("time_to_first_token_seconds", "Time from request arrival to its first token.")
        self.itl = histograms("inter_token_latency_seconds", "Time between consecutive output tokens of a request.")
        self.e2e = histograms("e2e_request_latency_seconds", "Time from request arrival to its last token.")

    def _observe(self, histograms: list[Histogram], value: float) -> None:
        for h in histograms:
            h.labels(self.model).observe(value)

    def observe_token(self, arrival: float, last: float | None, now: float, num_new: int) -> None:
        if last is None:
            self._observe(self.ttft, now - arrival)
        elif num_new > 0:
            gap = (now - last) / num_new
            for _ in range(num_new):
                self._observe(self.itl, gap)

    def observe_finished(self, arrival: float, now: float) -> None:
        self._observe(self.e2e, now - arrival)
