"""precast behind Ray Serve: two real replicas (one thread each) of SmolLM2 on a local Ray cluster.

The tests share one cluster and run in order: spreading, prefix affinity against round robin, streaming against a
plain `precast serve`, metrics and KV events, and last a replica killed under load.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import msgspec
import pytest
import ray
import zmq
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from precast.errors import PrecastError
from precast.runtime.replicas.app import APP_NAME, ReplicaOptions, ScaleOptions, build_app
from tests.runtime.test_server import free_port, start_server, stop_server, wait_for

MODEL = "smol"
B = 32  # tokens per block of the test engine
STATE: dict[str, str] = {}


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()
    STATE.clear()


def precast_cli(*args: str, **kw) -> subprocess.Popen:
    exe = shutil.which("precast")
    cmd = [exe] if exe else [sys.executable, "-m", "precast"]
    return subprocess.Popen([*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def test_cli_refuses_bad_settings_before_starting_ray(tmp_path, smollm2_bf16_engine):
    for args, message in [
        ([str(tmp_path / "missing"), "--replicas", "2"], "does not exist"),
        ([str(smollm2_bf16_engine), "--replicas", "2", "--kv-events-endpoint", "tcp://*:5557"], "use --kv-events"),
        ([str(smollm2_bf16_engine), "--kv-events"], "--kv-events is for --replicas"),
        ([str(smollm2_bf16_engine), "--max-replicas", "2", "--min-replicas", "3"], "min_replicas (3) <= max_replicas (2)"),
    ]:
        proc = precast_cli("serve", *args)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode != 0 and message in out, out


def test_settings_reach_ray_serves_deployments(smollm2_bf16_engine):
    """Autoscaling, per-replica capacity, CPUs and health settings as Ray Serve reads them (autoscaling itself is Ray's)."""
    options = ReplicaOptions(str(smollm2_bf16_engine), MODEL, num_threads=2)
    scale = ScaleOptions(min_replicas=1, max_replicas=4, target_ongoing_requests=8, max_ongoing_requests=24, health_check_period_s=3)
    replica = build_app(options, scale)._bound_deployment.init_args[0]._bound_deployment
    autoscaling = replica._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas, autoscaling.target_ongoing_requests) == (1, 4, 8)
    assert replica._deployment_config.max_ongoing_requests == 24 and replica.ray_actor_options["num_cpus"] == 2
    assert replica._deployment_config.health_check_period_s == 3
    fixed = build_app(options, ScaleOptions(replicas=3))._bound_deployment.init_args[0]._bound_deployment
    assert fixed.num_replicas == 3 and fixed._deployment_config.max_ongoing_requests == 64  # the engine's max_batch_size
    for bad, message in [(ScaleOptions(routing="random"), "unknown routing"), (ScaleOptions(replicas=0), "at least 1")]:
        with pytest.raises(PrecastError, match=message):
            build_app(options, bad)


def test_cli_serves_replicas_and_stops_on_sigterm(smollm2_bf16_engine):
    """`precast serve --replicas 2` end to end, in its own Ray cluster (before this module's cluster starts)."""
    port = free_port()
    proc = precast_cli(
        "serve", str(smollm2_bf16_engine), "--replicas", "2", "--threads", "1", "--port", str(port),
        "--served-model-name", MODEL, "--kv-cache-memory", "256MiB", "--log-level", "warning",
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _ready(base, proc), 120, what="the CLI's two replicas")
        assert complete(base, "The capital of France is")["choices"][0]["text"]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, out
        assert "2 replicas behind Ray Serve" in out and "stopping" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()


def _ready(base: str, proc: subprocess.Popen) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"precast serve exited: {proc.stdout.read()}")
    try:
        return httpx.get(f"{base}/ready", timeout=2).json().get("replicas") == 2
    except (httpx.HTTPError, ValueError):
        return False


def replicas(base: str) -> list[dict]:
    return httpx.get(f"{base}/replicas", timeout=10).json()


def deploy(base: str, engine, routing: str) -> str:
    """The app with two replicas routed by `routing`, once both announced themselves (redeployed if it differs)."""
    if STATE.get("routing") != routing:
        options = ReplicaOptions(str(engine), MODEL, num_threads=1, kv_cache_memory=256 << 20, kv_events=True)
        scale = ScaleOptions(replicas=2, routing=routing, health_check_period_s=2, health_check_timeout_s=10, drain_timeout=5)
        serve.run(build_app(options, scale), name=APP_NAME, route_prefix="/")
        STATE["routing"] = routing
        wait_for(lambda: len(replicas(base)) == 2, 60, what="two replicas announced")
    return base


def per_replica(base: str) -> dict[str, dict[str, float]]:
    """{replica id: {sample name: value}} from the ingress's merged /metrics."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=10).text):
        for s in family.samples:
            if "replica" in s.labels and "le" not in s.labels:
                out.setdefault(s.labels["replica"], {})[s.name] = s.value
    return out


def complete(base: str, prompt, max_tokens: int = 4, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0} | extra
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_requests_spread_over_both_replicas(cluster, smollm2_bf16_engine):
    base = deploy(cluster, smollm2_bf16_engine, "prefix")
    before = per_replica(base)
    threads = [threading.Thread(target=complete, args=(base, f"Question {i}: name a colour.", 16)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = per_replica(base)
    assert set(after) == {r["labels"]["replica"] for r in replicas(base)}
    generated = {
        rid: after[rid]["vllm:generation_tokens_total"] - before.get(rid, {}).get("vllm:generation_tokens_total", 0) for rid in after
    }
    assert all(n > 0 for n in generated.values()), generated


def prefix_hit_rate(base: str) -> float:
    """Tokens served from the replicas' prefix caches / tokens looked up, over a workload of five long system prompts
    (tenants) each used by four chat requests, tenants interleaved."""
    before = per_replica(base)
    for round_ in range(4):
        for tenant in range(5):
            system = f"You are assistant number {tenant} of the ACME corporation. " + f"Rule {tenant}: be brief and exact. " * 12
            messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Round {round_}: say hello."}]
            r = httpx.post(f"{base}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1}, timeout=120)
            assert r.status_code == 200, r.text
    after = per_replica(base)

    def total(name: str) -> float:
        return sum(after[r][name] - before.get(r, {}).get(name, 0) for r in after)

    return total("vllm:prefix_cache_hits_total") / total("vllm:prefix_cache_queries_total")


def test_prefix_affinity_beats_round_robin(cluster, smollm2_bf16_engine):
    round_robin = prefix_hit_rate(deploy(cluster, smollm2_bf16_engine, "round_robin"))
    affinity = prefix_hit_rate(deploy(cluster, smollm2_bf16_engine, "prefix"))
    # Round robin sends each tenant's second request to the other replica (one more cold prompt per tenant).
    assert affinity > round_robin + 0.1, (affinity, round_robin)
    decisions = {
        s.labels["decision"]: s.value
        for f in text_string_to_metric_families(httpx.get(f"{cluster}/metrics").text)
        for s in f.samples
        if s.name == "precast_router_decisions_total"
    }
    assert decisions.get("affinity", 0) >= 15 and decisions.get("least_loaded", 0) >= 5, decisions


def stream_chat(base: str, messages: list[dict], **extra) -> list[dict]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0, "stream": True} | extra
    events = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_streaming_equals_precast_serve(cluster, smollm2_bf16_engine):
    base = deploy(cluster, smollm2_bf16_engine, "prefix")
    proc, direct = start_server(smollm2_bf16_engine)
    try:
        for content in ["What is the capital of France?", "Write one sentence about rivers."]:
            messages = [{"role": "user", "content": content}]
            via_ray = stream_chat(base, messages, logprobs=True, top_logprobs=2)
            plain = stream_chat(direct, messages, logprobs=True, top_logprobs=2)
            strip = lambda events: [{k: v for k, v in e.items() if k not in ("id", "created")} for e in events]
            assert strip(via_ray) == strip(plain)
            assert "".join(e["choices"][0]["delta"].get("content") or "" for e in via_ray).strip()
    finally:
        stop_server(proc)


def test_metrics_and_kv_events_match_precasts_own(cluster, smollm2_bf16_engine):
    base = deploy(cluster, smollm2_bf16_engine, "prefix")
    targets = replicas(base)
    endpoints = [t["labels"]["__meta_precast_kv_events_endpoint"] for t in targets]
    assert len(endpoints) == 2 and all(e.startswith("tcp://") for e in endpoints)
    sub = zmq.Context.instance().socket(zmq.SUB)
    for e in endpoints:
        sub.connect(e)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.5)  # the subscriptions reach the publishers
    ids = list(range(400, 400 + 3 * B + 5))  # 3 full blocks + the 4th filled by the prompt's rest and a token
    try:
        complete(base, ids, max_tokens=1)
        sub.setsockopt(zmq.RCVTIMEO, 10_000)
        stored = []
        while len(stored) < 3:
            _, _, payload = sub.recv_multipart()
            _, events = msgspec.msgpack.decode(payload)
            stored += [e for e in events if e[0] == "BlockStored"]
    finally:
        sub.close(linger=0)
    assert [e[3] for e in stored[:3]] == [ids[k * B : (k + 1) * B] for k in range(3)]
    # Each replica's own metrics endpoint (a Prometheus target) agrees with the ingress's merged view, and the vLLM
    # names with precast's.
    merged = per_replica(base)
    for t in targets:
        own = {
            s.name: s.value for f in text_string_to_metric_families(httpx.get(f"http://{t['targets'][0]}/metrics").text) for s in f.samples
        }
        rid = t["labels"]["replica"]
        for precast_name, vllm_name in [
            ("precast_num_requests_running", "vllm:num_requests_running"),
            ("precast_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc"),
            ("precast_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
            ("precast_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
            ("precast_generation_tokens_total", "vllm:generation_tokens_total"),
        ]:
            assert own[precast_name] == own[vllm_name] == merged[rid][vllm_name], (rid, precast_name)
        assert own["vllm:time_to_first_token_seconds_count"] == merged[rid]["vllm:time_to_first_token_seconds_count"]


def test_client_hang_up_cancels_the_generation_on_its_replica(cluster, smollm2_bf16_engine):
    base = deploy(cluster, smollm2_bf16_engine, "prefix")
    body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 10:
                break  # hang up after a few tokens; 1500 would take tens of seconds
    running = lambda: sum(m["vllm:num_requests_running"] for m in per_replica(base).values())
    wait_for(lambda: running() == 0, 10, what="the replica to cancel the request")
    generated = sum(m["vllm:generation_tokens_total"] for m in per_replica(base).values())
    time.sleep(1)
    assert sum(m["vllm:generation_tokens_total"] for m in per_replica(base).values()) == generated


def test_killed_replica_loses_no_unstarted_request_and_is_replaced(cluster, smollm2_bf16_engine):
    base = deploy(cluster, smollm2_bf16_engine, "prefix")
    before = replicas(base)
    victim = int(before[0]["labels"]["__meta_precast_pid"])
    results: list[tuple[str, object]] = []

    def plain(i: int) -> None:
        body = {"model": MODEL, "prompt": f"Story {i}: once upon a time", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=180)
        results.append(("plain", r.status_code))

    def streamed(i: int) -> None:
        body = {"model": MODEL, "prompt": f"Poem {i}:", "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=180) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        results.append(("stream", lines[-1] if lines else "nothing"))

    threads = [threading.Thread(target=plain, args=(i,)) for i in range(10)]
    threads += [threading.Thread(target=streamed, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    rid = before[0]["labels"]["replica"]
    wait_for(lambda: per_replica(base)[rid]["vllm:num_requests_running"] > 0, 30, what="requests on the victim")
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(timeout=240)
    plain_status = [v for kind, v in results if kind == "plain"]
    assert plain_status == [200] * 10  # not started streaming: retried on the other replica
    for kind, last in results:
        if kind == "stream":  # finished, or told it failed: never a bare cut
            assert last == "data: [DONE]" or '"replica_failed"' in last, last
    # Ray replaces the killed replica; the replacement announces itself.
    wait_for(
        lambda: len(replicas(base)) == 2 and victim not in {int(r["labels"]["__meta_precast_pid"]) for r in replicas(base)},
        120,
        what="a replacement",
    )
    assert complete(base, "After the failure,")["choices"][0]["text"]
    ingress = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text) for s in f.samples}
    cut = sum(1 for kind, last in results if kind == "stream" and last != "data: [DONE]")
    assert ingress["precast_ingress_retries_total"] >= 1 and ingress["precast_ingress_failed_streams_total"] == cut
