"""`precast serve` under hostile and unlucky clients: oversized bodies, hang-ups, bad text, SIGTERM, keys.

Each test runs against a real server process (tests/runtime/test_server.py's start_server).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import pytest

from precast.runtime.server.serve import resolve_api_key
from tests.runtime import test_server
from tests.runtime.test_server import MODEL, metric, start_server, stop_server, wait_for

KEY = {"Authorization": "Bearer sk-test"}
server = test_server.server  # the fixture: a real server with the default limits and key sk-test


@pytest.fixture(scope="module")
def limited(smollm2_bf16_engine):
    """A server with a 64 KiB request limit."""
    proc, base = start_server(smollm2_bf16_engine, "--api-key", "sk-test", "--max-request-bytes", "64KiB")
    yield base
    stop_server(proc)


def test_oversized_body_gets_413_naming_the_limit(limited):
    big = json.dumps({"model": MODEL, "prompt": list(range(20000)), "max_tokens": 1}).encode()  # ~118 KB of token ids
    r = httpx.post(f"{limited}/v1/completions", content=big, headers=KEY | {"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "65,536 bytes" in r.json()["error"]["message"] and "--max-request-bytes" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    r = httpx.post(f"{limited}/v1/completions", content=chunked(), headers=KEY, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    ok = httpx.post(f"{limited}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, headers=KEY, timeout=30)
    assert ok.status_code == 200


def test_lone_surrogate_is_a_400_not_a_500(limited):
    for path, body in [
        ("/v1/completions", '{"model": "smol", "prompt": "a\\ud800b", "max_tokens": 2}'),
        ("/v1/chat/completions", '{"model": "smol", "messages": [{"role": "user", "content": "\\udfff"}]}'),
    ]:
        r = httpx.post(f"{limited}{path}", content=body.encode(), headers=KEY | {"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 400, r.text
        assert "surrogate" in r.json()["error"]["message"]


def test_health_answers_while_maximal_requests_are_parsed_and_tokenized(server, smollm2_bf16_engine):
    """Requests as large as the defaults allow (a text prompt just under the character bound beyond which
    tokenizing is refused; ~4 MiB of token ids) are parsed and tokenized off the event loop: /health keeps
    answering while they are. Judged as a ratio to how long they take, never as an absolute time."""
    from precast.runtime import LLM

    with LLM(smollm2_bf16_engine, kv_cache_memory=1 << 24) as llm:
        most_chars = llm.max_seq_len * llm.tokenizer.max_token_chars * 4
    # The senders run in their own process, so the client's GIL does not slow this one's /health calls.
    proc = subprocess.Popen([sys.executable, "-c", _SENDER, server, str(most_chars - 10)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "ready"
    idle = [_health_ms(server) for _ in range(20)]
    start = time.perf_counter()
    proc.stdin.write("go\n")
    proc.stdin.flush()
    busy = []
    while proc.poll() is None:
        busy.append(_health_ms(server))
    span = (time.perf_counter() - start) * 1000
    assert proc.returncode == 0, proc.stdout.read()
    print(f"/health idle median {statistics.median(idle):.1f} ms; while 4 maximal requests ran ({span:.0f} ms): "
          f"{len(busy)} answers, median {statistics.median(busy):.1f} ms, worst {max(busy):.1f} ms")  # fmt: skip
    # On the event loop, the requests would hold /health for about their whole span.
    assert len(busy) >= 5 and max(busy) < span / 3


_SENDER = """
import json, sys, threading, httpx
base, chars = sys.argv[1], int(sys.argv[2])
text = ("lorem ipsum dolor sit amet " * (chars // 27 + 1))[:chars]
bodies = [json.dumps({"model": "smol", "prompt": text, "max_tokens": 1}).encode(),  # tokenized, then too long
          json.dumps({"model": "smol", "prompt": [1] * 1_300_000, "max_tokens": 1}).encode()]  # 3.9 MB
headers = {"Authorization": "Bearer sk-test", "Content-Type": "application/json"}
codes = []
def send(body):
    codes.append(httpx.post(base + "/v1/completions", content=body, headers=headers, timeout=120).status_code)
print("ready", flush=True)
sys.stdin.readline()
threads = [threading.Thread(target=send, args=(b,)) for b in bodies * 2]
[t.start() for t in threads]
[t.join() for t in threads]
assert codes == [400] * 4, codes
"""


_PROBE = httpx.Client(timeout=60)  # one kept-alive connection: the time measured is the server's, not a new client's


def _health_ms(base: str) -> float:
    start = time.perf_counter()
    assert _PROBE.get(f"{base}/health").status_code == 200
    return (time.perf_counter() - start) * 1000


def test_non_streaming_hang_up_cancels_the_request(server):
    """A client that gives up on a non-streaming request costs a few tokens, not all it asked for."""
    before = metric(server, "precast_generation_tokens_total")
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}).encode()
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-test\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for(lambda: metric(server, "precast_generation_tokens_total") > before + 5)
    # The socket is closed: the server notices, cancels, and stops generating.
    wait_for(lambda: metric(server, "precast_num_requests_running") == 0)
    time.sleep(0.5)
    generated = metric(server, "precast_generation_tokens_total") - before
    assert generated < 1500 / 2, generated
    assert metric(server, "precast_kv_cache_blocks_used") == 0


def test_sigterm_drains_then_ends_every_open_stream_with_done_or_an_error(smollm2_bf16_engine):
    proc, base = start_server(smollm2_bf16_engine, "--drain-timeout", "8")
    events: dict[str, list[str]] = {"short": [], "long": []}
    started = {name: threading.Event() for name in events}

    def stream(name: str, max_tokens: int) -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events[name].append(line[6:])
                    started[name].set()

    # "long" runs far past the drain timeout and is cut by it; "short" ends within it.
    threads = [threading.Thread(target=stream, args=("short", 16)), threading.Thread(target=stream, args=("long", 1900))]
    for t in threads:
        t.start()
    for event in started.values():
        assert event.wait(60)
    proc.send_signal(signal.SIGTERM)
    # While draining: alive, not ready, and new requests are refused. uvicorn closes the listening socket at
    # once, so a request may find the port closed (ConnectError) or, if the kernel accepted the connection
    # just before, see it closed unread (RemoteProtocolError / ReadError): a load balancer retries either.
    try:
        health = httpx.get(f"{base}/health", timeout=5)
        assert health.status_code == 200 and health.json()["status"] == "draining"
        assert httpx.get(f"{base}/ready", timeout=5).status_code == 503
        refused = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "Hi"}, timeout=5)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        pass
    for t in threads:
        t.join(timeout=60)
    assert proc.wait(timeout=60) == 0, proc.stdout.read()
    assert events["short"][-1] == "[DONE]"  # finished within the drain timeout
    last = json.loads(events["long"][-1])
    assert last["error"]["code"] == "shutting_down", events["long"][-3:]  # cut, and says so


def test_api_key_from_a_file_or_the_environment(smollm2_bf16_engine, tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    proc, base = start_server(smollm2_bf16_engine, "--api-key-file", str(key_file))
    try:
        assert "sk-from-file" not in open(f"/proc/{proc.pid}/cmdline").read()
        assert httpx.get(f"{base}/v1/models").status_code == 401
        assert httpx.get(f"{base}/openapi.json").status_code == 401
        assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer sk-from-file"}).status_code == 200
        assert httpx.get(f"{base}/health").status_code == 200 and httpx.get(f"{base}/metrics").status_code == 200
        assert httpx.get(f"{base}/ready").json()["status"] == "ready"
    finally:
        stop_server(proc)
    monkeypatch.setenv("PRECAST_API_KEY", "sk-env")
    assert resolve_api_key(None, None) == "sk-env"
    assert resolve_api_key("sk-flag", None) == "sk-flag"
    assert resolve_api_key(None, str(key_file)) == "sk-from-file"
    monkeypatch.delenv("PRECAST_API_KEY")
    assert resolve_api_key(None, None) is None
    proc, base = start_server(smollm2_bf16_engine, env=os.environ | {"PRECAST_API_KEY": "sk-env"})
    try:
        assert httpx.get(f"{base}/v1/models").status_code == 401
        assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer sk-env"}).status_code == 200
    finally:
        stop_server(proc)
