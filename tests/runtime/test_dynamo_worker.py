"""precast under NVIDIA Dynamo: two precast workers (one thread each) behind Dynamo's own frontend, KV-aware routing
from precast's KV events, on one machine (file discovery: no etcd or NATS needed by Dynamo 1.6)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from dynamo.llm.exceptions import InvalidArgument  # noqa: F401  (the suite needs ai-dynamo; --fast leaves this out)

from tests.runtime.test_server import free_port, start_server, stop_server, wait_for

MODEL = "smol"


@pytest.fixture(scope="module")
def dynamo(smollm2_bf16_engine, tmp_path_factory):
    store = tmp_path_factory.mktemp("dynamo-store")
    env = os.environ | {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(store), "DYN_LOG": "warn"}
    port = free_port()
    logs = tmp_path_factory.mktemp("dynamo-logs")
    procs = []
    for i in range(2):
        cmd = [sys.executable, "-m", "precast.runtime.replicas.dynamo_worker", str(smollm2_bf16_engine), "--served-model-name", MODEL]
        cmd += ["--threads", "1", "--kv-cache-memory", "256MiB"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=open(logs / f"worker{i}.log", "w"), stderr=subprocess.STDOUT))
    frontend = [sys.executable, "-m", "dynamo.frontend", "--http-port", str(port), "--router-mode", "kv", "--discovery-backend", "file"]
    procs.append(subprocess.Popen(frontend, env=env, stdout=open(logs / "frontend.log", "w"), stderr=subprocess.STDOUT))
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a Dynamo process exited: {[(f.name, f.read_text()[-2000:]) for f in logs.iterdir()]}")
        try:
            r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}, timeout=5)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, 120, what="Dynamo's frontend to serve the precast workers")
        instances = store / "v1" / "instances"
        wait_for(lambda: len(list(instances.glob("dynamo%2Fprecast%2Fgenerate%2F*"))) == 2, 60, what="both workers registered")
        yield base
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def chat(base: str, content: str, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 24, "temperature": 0} | extra
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_answers_equal_precast_serve(dynamo, smollm2_bf16_engine):
    proc, direct = start_server(smollm2_bf16_engine)
    try:
        for content in ["What is the capital of France?", "Write one sentence about rivers."]:
            via_dynamo = chat(dynamo, content)
            plain = httpx.post(
                f"{direct}/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 24, "temperature": 0},
                timeout=120,
            ).json()
            assert via_dynamo["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
            assert via_dynamo["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
            assert via_dynamo["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    finally:
        stop_server(proc)


def test_streaming_stop_strings_and_logprobs(dynamo):
    whole = chat(dynamo, "Count from one to ten in words.", max_tokens=40)["choices"][0]["message"]["content"]
    text, logprobs = "", []
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count from one to ten in words."}], "max_tokens": 40,
            "temperature": 0, "stream": True, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    with httpx.stream("POST", f"{dynamo}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or ""
                logprobs += (choice.get("logprobs") or {}).get("content") or []
    assert text == whole and len(logprobs) >= len(text.split())
    assert all(len(lp["top_logprobs"]) == 2 and lp["logprob"] <= 0 for lp in logprobs)
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]  # a stop string in the middle of the greedy answer
    stopped = chat(dynamo, "Count from one to ten in words.", max_tokens=40, stop=[stop])["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["message"]["content"] == whole[: whole.index(stop)], (stop, whole)


def test_structured_output_through_dynamo(dynamo):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    out = chat(dynamo, "Name a big city and its population as JSON.", max_tokens=60, response_format=fmt)["choices"][0]
    value = json.loads(out["message"]["content"])
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)


def test_kv_aware_routing_reuses_a_workers_cache(dynamo):
    """Dynamo's KV router learns from precast's KV events where each prefix is cached: every repeat of a long prompt
    goes to the worker that holds it (a round robin would miss about half the time)."""
    documents = [
        f"Document {d}: " + " ".join(f"fact {d}.{k} is that item {k} weighs {k * d + 3} grams." for k in range(30)) for d in range(4)
    ]
    for doc in documents:
        first = chat(dynamo, doc + " Question 0: summarise.", max_tokens=1)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < 32, first["usage"]
    time.sleep(1)  # the KV events reach the router
    for q in range(1, 4):
        for doc in documents:
            usage = chat(dynamo, doc + f" Question {q}: summarise.", max_tokens=1)["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 64, usage


def test_unsupported_requests_are_refused_with_the_reason(dynamo):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2}
    r = httpx.post(f"{dynamo}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "one sequence per request" in r.text, r.text


class FakePublisher:
    def __init__(self):
        self.stored: list[tuple[list[int], list[int], list[int], int | None]] = []
        self.removed: list[list[int]] = []

    def publish_stored(self, token_ids, num_block_tokens, block_hashes, parent_hash=None):
        self.stored.append((token_ids, num_block_tokens, block_hashes, parent_hash))

    def publish_removed(self, block_hashes):
        self.removed.append(block_hashes)


def test_kv_events_reach_dynamos_publisher_as_it_expects(smollm2_bf16_engine, tmp_path, smollm2_block_bytes):
    """What the worker hands Dynamo's KvEventPublisher: one call per stored block with its tokens, its hash as a signed
    64-bit integer and its parent's, in chain order; removals by the same hashes."""
    import argparse
    import threading

    from precast.runtime import LLM, SamplingParams
    from precast.runtime.replicas.dynamo_worker import PrecastDynamoEngine

    B = 32
    args = argparse.Namespace(no_kv_events=False)
    engine = PrecastDynamoEngine(args, "smol", tmp_path)
    # a pool of 8 blocks: the second prompt evicts the first one's cached blocks
    engine.llm = LLM(smollm2_bf16_engine, kv_cache_memory=8 * smollm2_block_bytes, kv_events=True)
    publisher = FakePublisher()
    thread = threading.Thread(target=engine._publish, args=(publisher,))
    thread.start()
    try:
        prompts = [list(range(500 + 300 * i, 500 + 300 * i + 3 * B + 5)) for i in range(3)]
        for p in prompts:
            engine.llm.generate(p, SamplingParams(max_tokens=1, temperature=0))
        time.sleep(0.3)
    finally:
        engine.stop.set()
        thread.join()
        engine.llm.shutdown()
    first = [s for s in publisher.stored if s[0] == prompts[0][:B]]
    assert len(first) == 1 and first[0][1] == [B] and first[0][3] is None
    chain = [first[0]]
    for k in range(1, 3):
        nxt = [s for s in publisher.stored if s[3] == chain[-1][2][0]]
        assert len(nxt) == 1 and nxt[0][0] == prompts[0][k * B : (k + 1) * B]
        chain.append(nxt[0])
    hashes = {s[2][0] for s in publisher.stored}
    assert all(-(1 << 63) <= h < (1 << 63) for h in hashes)
    assert publisher.removed and all(r[0] in hashes for r in publisher.removed)
