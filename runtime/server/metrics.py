"""Prometheus metrics: executor state read at scrape time, latencies observed per request."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _ExecutorCollector(Collector):
    def __init__(self, llm: Any, model: str) -> None:
        self.llm = llm
        self.model = model

    def collect(self) -> Iterator[Any]:
        s = self.llm.stats()
        kv = s.kv
        labels = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"precast_{name}", doc, labels=labels)
            g.add_metric([self.model], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"precast_{name}", doc, labels=labels)
            c.add_metric([self.model], value)
            return c

        yield gauge("num_requests_running", "Requests holding KV cache (being generated).", s.active_requests)
        yield gauge("num_requests_waiting", "Requests queued for admission.", s.queued_requests)
        yield gauge("kv_cache_blocks_used", "KV cache blocks referenced by requests.", kv.used_blocks)
        yield gauge("kv_cache_blocks_free", "KV cache blocks available (free or cached and evictable).", kv.free_blocks)
        yield gauge("kv_cache_blocks_max", "KV cache blocks in the pool.", kv.max_blocks)
        yield gauge("kv_cache_usage_ratio", "Fraction of KV cache blocks in use.", kv.used_blocks / max(kv.max_blocks, 1))
        yield gauge("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens looked up.", kv.hit_rate)
        yield counter("prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).", s.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", s.generated_tokens)
        yield counter("num_preemptions", "Requests preempted for lack of KV cache blocks.", s.preemptions)
        yield counter("iterations", "Executor steps run.", s.iterations)


class ServerMetrics:
    def __init__(self, llm: Any, model: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_ExecutorCollector(llm, model))
        self.model = model
        self.ttft = Histogram(
            "precast_time_to_first_token_seconds",
            "Time from request arrival to its first token.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "precast_inter_token_latency_seconds",
            "Time between consecutive output tokens of a request.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "precast_e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def observe_token(self, arrival: float, last: float | None, now: float, num_new: int) -> None:
        if last is None:
            self.ttft.labels(self.model).observe(now - arrival)
        elif num_new > 0:
            gap = (now - last) / num_new
            for _ in range(num_new):
                self.itl.labels(self.model).observe(gap)

    def observe_finished(self, arrival: float, now: float) -> None:
        self.e2e.labels(self.model).observe(now - arrival)
