"""`precast serve` against the official openai client, and `precast bench` against it."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

MODEL = "smol"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(engine, *flags: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """A real `precast serve` process on a loopback port, once /health answers: (process, base URL)."""
    port = free_port()
    exe = shutil.which("precast")
    cmd = [exe] if exe else [sys.executable, "-m", "precast"]
    proc = subprocess.Popen(
        [*cmd, "serve", str(engine), "--port", str(port), "--served-model-name", MODEL, "--kv-cache-memory", "512MiB",
         "--log-level", "warning", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.2)
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()}")
    proc.kill()
    raise RuntimeError("server did not answer /health within 60 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server(smollm2_bf16_engine):
    proc, base = start_server(smollm2_bf16_engine, "--api-key", "sk-test")
    yield base
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="sk-test", max_retries=0)


def metric(server: str, name: str) -> float:
    for line in httpx.get(f"{server}/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_for(predicate, timeout: float = 10.0, what: str = "the condition") -> None:
    """Polls `predicate` until it holds; fails naming `what` after `timeout` seconds."""
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = httpx.get(f"{server}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/health").status_code == 200  # open without a key


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30)
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop" and r.object == "chat.completion"
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt="The capital of Germany is", temperature=0, max_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert "Berlin" in r.choices[0].text


def test_streaming_chat_equals_non_streamed(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Name three colours."}], temperature=0, max_tokens=40)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_n_stop_and_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0.8, seed=3, n=2, max_tokens=20)
    assert len(r.choices) == 2 and {c.index for c in r.choices} == {0, 1}
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30, stop=[" is"])
    assert r.choices[0].message.content == "The capital of France" and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    assert content[0].token == content[0].top_logprobs[0].token  # greedy takes the most likely
    r = client.completions.create(model=MODEL, prompt="One, two,", temperature=0, max_tokens=3, logprobs=2)
    assert len(r.choices[0].logprobs.tokens) == 3 and len(r.choices[0].logprobs.top_logprobs[0]) == 2


def test_concurrent_streaming_clients(server):
    from openai import OpenAI

    results: list[str | Exception] = []

    def one(i: int) -> None:
        try:
            c = OpenAI(base_url=f"{server}/v1", api_key="sk-test", max_retries=0)
            stream = c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}], temperature=0, max_tokens=24, stream=True
            )
            results.append("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices))
        except Exception as e:  # collected and reported below
            results.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == 32 and all(isinstance(r, str) and r for r in results), results[:3]


def test_disconnect_mid_stream_frees_blocks(server):
    headers = {"Authorization": "Bearer sk-test"}
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=headers, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        wait_for(lambda: metric(server, "precast_kv_cache_blocks_used") > 0)
    # The connection is closed: the server cancels the request and frees its blocks.
    wait_for(lambda: metric(server, "precast_kv_cache_blocks_used") == 0 and metric(server, "precast_num_requests_running") == 0)


@pytest.mark.parametrize(
    "body,status,text",
    [
        (b"{not json", 400, "not valid JSON"),
        ({"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
        ({"model": MODEL, "prompt": "hi " * 3000, "max_tokens": 10}, 400, "maximum context length"),
        ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt is empty"),
        ({"model": MODEL}, 400, "prompt"),
        ({"model": MODEL, "messages": []}, 400, "messages"),
    ],
)
def test_bad_requests_get_openai_errors_and_server_keeps_serving(server, client, body, status, text):
    headers = {"Authorization": "Bearer sk-test", "Content-Type": "application/json"}
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server}{path}", content=content, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert text in err["message"] and err["type"]
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_metrics_move(server, client):
    before = metric(server, "precast_generation_tokens_total")
    ttft_before = metric(server, "precast_time_to_first_token_seconds_count")
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    assert metric(server, "precast_generation_tokens_total") - before == 7
    assert metric(server, "precast_time_to_first_token_seconds_count") == ttft_before + 1
    for name in (
        "precast_num_requests_waiting",
        "precast_kv_cache_usage_ratio",
        "precast_prefix_cache_hit_rate",
        "precast_prompt_tokens_total",
        "precast_num_preemptions_total",
        "precast_inter_token_latency_seconds_count",
        "precast_e2e_request_latency_seconds_count",
        "precast_kv_cache_blocks_free",
    ):
        metric(server, name)


def test_bench_online_and_offline(server, smollm2_bf16_engine, tmp_path):
    exe = shutil.which("precast")
    cmd = [exe] if exe else [sys.executable, "-m", "precast"]
    common = ["--num-prompts", "6", "--input-len", "16", "--output-len", "8", "--concurrency", "3"]
    online = subprocess.run(
        [*cmd, "bench", "--url", server, "--api-key", "sk-test", *common, "--json", str(tmp_path / "on.json")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert online.returncode == 0, online.stderr
    offline = subprocess.run(
        [*cmd, "bench", "--engine", str(smollm2_bf16_engine), *common, "--json", str(tmp_path / "off.json")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert offline.returncode == 0, offline.stderr
    for name in ("on.json", "off.json"):
        s = json.loads((tmp_path / name).read_text())
        assert s["requests"] == 6 and s["failed"] == 0
        assert s["output_tokens"] == 6 * 8 and s["input_tokens"] == 6 * 16  # counts match what was generated
        assert 0 < s["ttft_s"]["p50"] <= s["e2e_s"]["p50"] and s["itl_s"]["mean"] > 0
        assert s["output_token_throughput"] > 0
    assert "output token throughput" in online.stdout


def test_openai_client_example(server):
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "openai_client.py"
    r = subprocess.run([sys.executable, str(script), f"{server}/v1", "sk-test"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "chat: The capital of France is Paris." in r.stdout and "stream: " in r.stdout


def test_bench_dataset_and_request_rate(smollm2_bf16_engine, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p, "max_tokens": 4}) for p in ["Hello", "The sky is", "One, two,"]) + "\n")
    exe = shutil.which("precast")
    cmd = [exe] if exe else [sys.executable, "-m", "precast"]
    r = subprocess.run(
        [
            *cmd,
            "bench",
            "--engine",
            str(smollm2_bf16_engine),
            "--dataset",
            str(data),
            "--num-prompts",
            "3",
            "--request-rate",
            "20",
            "--json",
            str(tmp_path / "s.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["requests"] == 3 and s["failed"] == 0 and 0 < s["output_tokens"] <= 12 and s["mode"] == "offline"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    r = subprocess.run(
        [*cmd, "bench", "--engine", str(smollm2_bf16_engine), "--dataset", str(bad)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 2 and "bad.jsonl:1" in r.stderr


def test_vllm_metric_names_match_precast_ones(server, client):
    """What llm-d's scheduler and Dynamo's planner read: the same values under vLLM's names."""
    shared = "Reply briefly. " * 40  # a prefix of several KV blocks, looked up twice
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=shared + "Hi", max_tokens=2, temperature=0)
    pairs = [
        ("precast_num_requests_running", "vllm:num_requests_running"),
        ("precast_num_requests_waiting", "vllm:num_requests_waiting"),
        ("precast_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc"),
        ("precast_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
        ("precast_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
        ("precast_prompt_tokens_total", "vllm:prompt_tokens_total"),
        ("precast_generation_tokens_total", "vllm:generation_tokens_total"),
        ("precast_num_preemptions_total", "vllm:num_preemptions_total"),
        ("precast_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
        ("precast_inter_token_latency_seconds_count", "vllm:inter_token_latency_seconds_count"),
        ("precast_e2e_request_latency_seconds_count", "vllm:e2e_request_latency_seconds_count"),
    ]
    for ours, theirs in pairs:  # idle now: nothing moves between the two reads
        assert metric(server, ours) == metric(server, theirs), (ours, theirs)
    assert metric(server, "vllm:prefix_cache_hits_total") >= 32  # the second request reused the shared prefix
    assert metric(server, "vllm:prefix_cache_queries_total") >= metric(server, "vllm:prefix_cache_hits_total")
