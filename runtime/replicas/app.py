"""precast as a Ray Serve application: an ingress deployment in front of N replica deployments, each replica one
LLM with its own threads serving precast's own OpenAI app (server/app.py).

    client -> Ray's HTTP proxy -> PrecastIngress (one, no CPU) --handle, routed by PrecastRouter--> PrecastReplica x N

The ingress reads the body, takes the prompt out of it for the router (router.py: prefix affinity or round robin;
"least_loaded" keeps Ray's own power-of-two router) and streams the replica's answer back. A replica that dies before
its answer's first byte costs nothing: the ingress retries on another replica (Ray replaces the dead one); one that dies
mid-stream ends that stream with an error event. Replicas announce themselves to the ingress every few seconds (their
Prometheus and KV-event endpoints), which is how the ingress's /metrics shows every replica's metrics and /replicas
gives Prometheus (HTTP service discovery) and KV-aware routers the endpoints.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import ray
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from precast.engine.directory import load_engine
from precast.errors import PrecastError
from precast.runtime.llm import LLM
from precast.runtime.replicas import ROUTINGS
from precast.runtime.replicas.affinity import DECISIONS
from precast.runtime.replicas.proxy import ProxiedRequest, routing_text, run_app
from precast.runtime.replicas.router import PrecastRouter
from precast.runtime.server.app import make_app
from precast.runtime.server.defaults import DEFAULT_DRAIN_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES
from precast.runtime.server.intake import read_body
from precast.runtime.server.kv_events import KvEventPublisher
from precast.runtime.server.translate import OpenAIError

APP_NAME = "precast"
INGRESS, REPLICA = "PrecastIngress", "PrecastReplica"
ANNOUNCE_PERIOD_S = 2.0  # a replica re-announces itself this often; forgotten after 5 periods of silence
REPLICA_GONE = (RayActorError, ActorUnavailableError)


@dataclass
class ReplicaOptions:
    """What every replica serves, and how (the `precast serve` settings that are per process)."""

    engine: str
    model_name: str
    num_threads: int = 1
    kv_cache_memory: int | None = None
    api_key: str | None = None
    max_concurrency: int | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    chat_template: str | None = None  # Jinja source, read once by the caller
    kv_events: bool = False  # publish KV-cache events on an ephemeral port of the replica's node (listed by /replicas)
    backend: str = "cpu"
    speculative: str | None = None  # runtime/speculative.py: ngram | draft=ENGINE_DIR
    num_draft_tokens: int | None = None


@dataclass
class ScaleOptions:
    """How many replicas, how requests reach them, and Ray Serve's health and shutdown settings."""

    replicas: int = 1  # fixed count, unless max_replicas is set (autoscaling)
    min_replicas: int = 1
    max_replicas: int | None = None
    target_ongoing_requests: float = 16  # autoscaling aims for this many requests in flight per replica
    max_ongoing_requests: int | None = None  # per replica; default: the engine's max_batch_size (the rest queue)
    routing: str = "prefix"  # prefix | round_robin | least_loaded (Ray's power of two choices)
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT  # Ray's graceful_shutdown_timeout_s for a stopping replica
    max_attempts: int = 3  # replicas tried for a request whose replica died before answering


class PrecastReplica:
    """One LLM and precast's app over it. Ray Serve constructs it in the replica's actor process."""

    def __init__(self, options: ReplicaOptions):
        self.llm = LLM(
            options.engine,
            backend=options.backend,
            kv_cache_memory=options.kv_cache_memory,
            num_threads=options.num_threads,
            chat_template=options.chat_template,
            kv_events=options.kv_events,
            speculative=options.speculative,
            num_draft_tokens=options.num_draft_tokens,
        )
        self.app = make_app(
            self.llm, options.model_name, options.api_key, options.max_concurrency, options.max_request_bytes
        )  # fmt: skip
        context = serve.get_replica_context()
        host = ray.util.get_node_ip_address()
        self.metrics_server, _ = start_http_server(0, addr="0.0.0.0", registry=self.app.state.metrics.registry)
        self.publisher = KvEventPublisher(self.llm, f"tcp://{host}:*") if options.kv_events else None
        self.info = {
            "replica": context.replica_id.unique_id,
            "pid": os.getpid(),
            "metrics_url": f"http://{host}:{self.metrics_server.server_port}/metrics",
            "kv_events_endpoint": self.publisher.endpoint if self.publisher else None,
            "model_name": options.model_name,
        }
        self.stop = threading.Event()
        ingress = serve.get_deployment_handle(INGRESS, app_name=context.app_name, _check_exists=False)
        self.announcer = threading.Thread(target=self._announce, args=(ingress,), name="precast-announce", daemon=True)
        self.announcer.start()

    def _announce(self, ingress: Any) -> None:
        while True:
            try:
                ingress.register.remote(self.info).result(timeout_s=5)
            except Exception:  # the ingress is starting or restarting: next period
                pass
            if self.stop.wait(ANNOUNCE_PERIOD_S):
                return

    async def handle(self, request: ProxiedRequest) -> Any:
        async for item in run_app(self.app, request):
            yield item

    def check_health(self) -> None:
        """Ray Serve's health check: raising marks the replica unhealthy and Ray replaces it."""
        self.llm.check_alive()

    def __del__(self) -> None:
        # Ray calls this after the replica's requests drained (graceful_shutdown_timeout_s); also after a failed
        # __init__, so each part is closed only if it was made.
        for part, close in [("stop", "set"), ("publisher", "close"), ("metrics_server", "shutdown"), ("llm", "shutdown")]:
            if getattr(self, part, None) is not None:
                getattr(getattr(self, part), close)()


class _Families(Collector):
    def __init__(self, families: list[Any]):
        self.families = families

    def collect(self) -> Any:
        return iter(self.families)


class PrecastIngress:
    """Forwards every request to a replica through the router; answers /health, /ready, /metrics, /replicas itself."""

    def __init__(self, replicas: Any, scale: ScaleOptions, max_request_bytes: int):
        self.replicas = replicas.options(stream=True)
        self.scale, self.max_request_bytes = scale, max_request_bytes
        self.directory: dict[str, tuple[float, dict[str, Any]]] = {}  # replica id -> (last announcement, info)
        self.http = httpx.AsyncClient(timeout=3)
        self.retried = 0  # requests sent again because their replica died before answering
        self.failed_streams = 0  # streams cut by a replica's death (ended with an error event)

    def register(self, info: dict[str, Any]) -> None:
        self.directory[info["replica"]] = (time.monotonic(), info)

    def known_replicas(self) -> list[dict[str, Any]]:
        cutoff = time.monotonic() - 5 * ANNOUNCE_PERIOD_S
        for rid in [rid for rid, (seen, _) in self.directory.items() if seen < cutoff]:
            del self.directory[rid]
        return [info for _, info in sorted(self.directory.values(), key=lambda e: e[1]["replica"])]

    async def __call__(self, request: Request) -> Response:
        path, root = request.scope["path"], request.scope.get("root_path", "")
        if root and path.startswith(root):  # deployed under a route prefix: precast's routes are below it
            path = path[len(root) :] or "/"
        if path == "/health":
            return JSONResponse({"status": "ok", "replicas": len(self.known_replicas())})
        if path == "/ready":
            count = len(self.known_replicas())
            return JSONResponse({"status": "ready" if count else "no_replicas", "replicas": count}, status_code=200 if count else 503)
        if path == "/metrics":
            return Response(await self.metrics(), media_type=CONTENT_TYPE_LATEST)
        if path == "/replicas":
            return JSONResponse(self.service_discovery())
        try:
            body = await read_body(request, self.max_request_bytes)
        except OpenAIError as e:
            return e.response()
        text = routing_text(body) if len(body) < 65536 else await asyncio.to_thread(routing_text, body)
        proxied = ProxiedRequest(request.method, path, request.url.query.encode(), list(request.headers.raw), body, text)
        return await self.forward(proxied)

    async def forward(self, proxied: ProxiedRequest) -> Response:
        failure: Exception | None = None
        for _ in range(self.scale.max_attempts):
            stream = self.replicas.handle.remote(proxied)
            try:
                status, headers = await stream.__anext__()
                first = await anext(stream, None)  # the first byte: until here, a dead replica is retried elsewhere
            except REPLICA_GONE as e:
                stream.cancel()
                failure = e
                self.retried += 1
                continue
            except BaseException:
                stream.cancel()  # the client hung up (Ray cancels this call) or the replica failed
                raise
            named = dict(headers)
            if b"content-length" in named or first is None:
                chunks = [first or b""] + [chunk async for chunk in stream]
                response = Response(b"".join(chunks), status_code=status)
            else:
                sse = named.get(b"content-type", b"").startswith(b"text/event-stream")
                response = StreamingResponse(self._relay(stream, first, sse), status)
            response.raw_headers = headers
            return response
        message = f"no replica could serve the request ({self.scale.max_attempts} tried; last: {type(failure).__name__}); retry"
        return OpenAIError(503, message, "server_error", code="replica_failed").response()

    async def _relay(self, stream: Any, first: bytes, sse: bool) -> Any:
        try:
            yield first
            async for chunk in stream:
                yield chunk
        except REPLICA_GONE:  # mid-stream: the client gets an error event, never a bare cut
            self.failed_streams += 1
            if sse:
                error = {"message": "the replica serving this stream failed; retry the request", "type": "server_error", "param": None}
                yield b"data: " + orjson.dumps({"error": error | {"code": "replica_failed"}}) + b"\n\n"
        finally:
            stream.cancel()

    def service_discovery(self) -> list[dict[str, Any]]:
        """Prometheus HTTP service discovery: one target per replica (its metrics endpoint); the KV-event endpoint as
        a meta label for relabelling (and for KV-aware routers)."""
        targets = []
        for info in self.known_replicas():
            labels = {"replica": info["replica"], "model_name": info["model_name"], "__metrics_path__": "/metrics"}
            if info["kv_events_endpoint"]:
                labels["__meta_precast_kv_events_endpoint"] = info["kv_events_endpoint"]
            labels["__meta_precast_pid"] = str(info["pid"])
            targets.append({"targets": [info["metrics_url"].split("/")[2]], "labels": labels})
        return targets

    async def metrics(self) -> bytes:
        """Every replica's metrics with a `replica` label, and the router's decisions."""
        infos = self.known_replicas()
        answers = await asyncio.gather(*(self.http.get(i["metrics_url"]) for i in infos), return_exceptions=True)
        families: dict[str, Any] = {}
        for info, answer in zip(infos, answers):
            if isinstance(answer, BaseException) or answer.status_code != 200:
                self.directory.pop(info["replica"], None)  # gone; it re-announces itself if it is not
                continue
            for family in text_string_to_metric_families(answer.text):
                merged = families.setdefault(family.name, family)
                samples = [s._replace(labels=s.labels | {"replica": info["replica"]}) for s in family.samples]
                merged.samples = (merged.samples if merged is not family else []) + samples
        decisions = CounterMetricFamily("precast_router_decisions", "Requests routed, by decision.", labels=["decision"])
        for decision, count in sorted(DECISIONS.items()):
            decisions.add_metric([decision], count)
        replicas = GaugeMetricFamily("precast_replicas", "Replicas that announced themselves recently.", value=len(infos))
        retried = CounterMetricFamily(
            "precast_ingress_retries", "Requests sent again: their replica died before answering.", value=self.retried
        )
        cut = CounterMetricFamily("precast_ingress_failed_streams", "Streams ended by their replica's death.", value=self.failed_streams)
        registry = CollectorRegistry()
        registry.register(_Families([*families.values(), decisions, replicas, retried, cut]))
        return generate_latest(registry)


def build_app(options: ReplicaOptions, scale: ScaleOptions | None = None) -> Any:
    """The Ray Serve application (for serve.run, or a `serve run` config's import path)."""
    scale = scale or ScaleOptions()
    engine = load_engine(options.engine)  # fails here, clearly, before any replica starts
    if scale.routing not in ROUTINGS:
        raise PrecastError(f"unknown routing {scale.routing!r}; one of {', '.join(ROUTINGS)}")
    options = ReplicaOptions(**(asdict(options) | {"engine": str(Path(options.engine).resolve())}))
    replica_options: dict[str, Any] = {
        "name": REPLICA,
        "ray_actor_options": {"num_cpus": options.num_threads},
        "max_ongoing_requests": scale.max_ongoing_requests or engine.config.limits.max_batch_size,
        "health_check_period_s": scale.health_check_period_s,
        "health_check_timeout_s": scale.health_check_timeout_s,
        "graceful_shutdown_timeout_s": scale.drain_timeout,
    }
    if scale.max_replicas is not None:
        if not 0 < scale.min_replicas <= scale.max_replicas:
            raise PrecastError(f"need 0 < min_replicas ({scale.min_replicas}) <= max_replicas ({scale.max_replicas})")
        replica_options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=scale.min_replicas, max_replicas=scale.max_replicas, target_ongoing_requests=scale.target_ongoing_requests
        )
    else:
        if scale.replicas < 1:
            raise PrecastError(f"replicas must be at least 1, got {scale.replicas}")
        replica_options["num_replicas"] = scale.replicas
    if scale.routing != "least_loaded":
        replica_options["request_router_config"] = RequestRouterConfig(
            request_router_class=f"{PrecastRouter.__module__}.{PrecastRouter.__qualname__}",
            request_router_kwargs={"mode": scale.routing},
        )
    replica = serve.deployment(PrecastReplica).options(**replica_options)
    ingress = serve.deployment(PrecastIngress).options(
        name=INGRESS, num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000
    )
    return ingress.bind(replica.bind(options), scale, options.max_request_bytes)
