"""Replicas behind Ray Serve (runtime/replicas) against one `precast serve`, at the same total thread count.

SmolLM2-135M-Instruct (bfloat16 engine, built here from the packaged GGUF). The workload: chat requests from five
tenants, each with its own long system prompt (~330 tokens), a short question and `--max-tokens` generated (EOS
ignored), `--concurrency` clients streaming at once. Configurations, each run `--rounds` times in alternation:

    plain        precast serve, one process, --threads T
    ray 1x       Ray Serve, 1 replica with T threads (the ingress's cost alone)
    ray 2x rr    Ray Serve, 2 replicas with T/2 threads each, round robin
    ray 2x pfx   Ray Serve, 2 replicas with T/2 threads each, prefix affinity (the default)

Printed per configuration (medians over rounds): generated tokens/s, TTFT median and p90, and the prefix-cache hit
rate (prompt tokens served from the replicas' caches / prompt tokens looked up, from their own metrics).

    python benchmarks/replicas.py [--threads 2] [--requests 40] [--concurrency 8] [--max-tokens 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from compare_cpu import cpu_name, smollm2_bf16_engine  # benchmarks/ is on sys.path when a script here runs
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smol"


def system_prompt(tenant: int) -> str:
    return f"You are assistant {tenant} of the ACME help desk. " + " ".join(
        f"Rule {tenant}.{k}: answer the customer's question about product line {k} politely, briefly and exactly." for k in range(14)
    )


async def one(client: httpx.AsyncClient, base: str, i: int, max_tokens: int) -> tuple[float, int]:
    messages = [{"role": "system", "content": system_prompt(i % 5)}, {"role": "user", "content": f"Question {i}: how do I reset it?"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    start, ttft, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                ttft = ttft if ttft is not None else time.perf_counter() - start
                tokens += 1
    return ttft or 0.0, tokens


async def load(base: str, requests: int, concurrency: int, max_tokens: int) -> tuple[float, list[float]]:
    """Generated tokens/s over the whole run, and each request's TTFT."""
    queue = list(range(requests))
    ttfts: list[float] = []
    total = 0

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal total
        while queue:
            ttft, tokens = await one(client, base, queue.pop(0), max_tokens)
            ttfts.append(ttft)
            total += tokens

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return total / (time.perf_counter() - start), ttfts


def cache_counters(metrics_urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in metrics_urls:
        for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
            for s in family.samples:
                hits += s.value if s.name == "vllm:prefix_cache_hits_total" else 0
                queries += s.value if s.name == "vllm:prefix_cache_queries_total" else 0
    return hits, queries


def measure(base: str, metrics_urls: list[str], args: argparse.Namespace) -> dict[str, float]:
    h0, q0 = cache_counters(metrics_urls)
    rate, ttfts = asyncio.run(load(base, args.requests, args.concurrency, args.max_tokens))
    h1, q1 = cache_counters(metrics_urls)
    ttfts.sort()
    return {
        "tok/s": rate,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
        "hit": (h1 - h0) / (q1 - q0),
    }


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_plain(engine: Path, args: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    cmd = [sys.executable, "-m", "precast", "serve", str(engine), "--port", str(port), "--served-model-name", MODEL]
    proc = subprocess.Popen([*cmd, "--threads", str(args.threads), "--kv-cache-memory", "512MiB", "--log-level", "warning"])
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        return measure(base, [f"{base}/metrics"], args)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run_ray(engine: Path, args: argparse.Namespace, base: str, replicas: int, routing: str) -> dict[str, float]:
    from ray import serve

    from precast.runtime.replicas.app import APP_NAME, ReplicaOptions, ScaleOptions, build_app

    options = ReplicaOptions(str(engine), MODEL, num_threads=args.threads // replicas, kv_cache_memory=512 << 20)
    serve.run(build_app(options, ScaleOptions(replicas=replicas, routing=routing)), name=APP_NAME, route_prefix="/")
    deadline = time.time() + 120
    while len(targets := httpx.get(f"{base}/replicas", timeout=10).json()) != replicas and time.time() < deadline:
        time.sleep(0.3)
    try:
        return measure(base, [f"http://{t['targets'][0]}/metrics" for t in targets], args)
    finally:
        serve.delete(APP_NAME)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="total CPU threads of every configuration")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import ray
    from ray import serve

    with tempfile.TemporaryDirectory() as tmp:
        engine = smollm2_bf16_engine(Path(tmp) / "engine", 2048)
        ray.init(num_cpus=args.threads, include_dashboard=False, logging_level="warning", log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "WARNING"})
        base = f"http://127.0.0.1:{port}"
        configs = {
            "plain precast serve": lambda: run_plain(engine, args),
            f"ray 1x{args.threads}t": lambda: run_ray(engine, args, base, 1, "prefix"),
            f"ray 2x{args.threads // 2}t round robin": lambda: run_ray(engine, args, base, 2, "round_robin"),
            f"ray 2x{args.threads // 2}t prefix affinity": lambda: run_ray(engine, args, base, 2, "prefix"),
        }
        results: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
        for round_ in range(args.rounds):
            for name, run in configs.items():
                results[name].append(run())
                r = results[name][-1]
                print(f"round {round_ + 1} {name}: {r['tok/s']:.1f} tok/s, TTFT p50 {r['ttft_p50']:.2f} s, hit {r['hit']:.0%}", flush=True)
        serve.shutdown()
        ray.shutdown()

    print(f"\nCPU: {cpu_name()}; {args.threads} threads in total per configuration; SmolLM2-135M bf16")
    print(
        f"{args.requests} chat requests, 5 tenants (~330-token system prompts), {args.concurrency} streaming clients, {args.max_tokens} tokens each"
    )
    print(f"medians of {args.rounds} rounds\n")
    print(f"| {'configuration':32} | tok/s | vs plain | TTFT p50 (s) | TTFT p90 (s) | prefix hit rate |")
    print(f"| {'-' * 32} | ----: | -------: | -----------: | -----------: | --------------: |")
    plain = statistics.median(r["tok/s"] for r in results["plain precast serve"])
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"| {name:32} | {med['tok/s']:5.1f} | {med['tok/s'] / plain:7.2f}x | {med['ttft_p50']:12.2f} | {med['ttft_p90']:12.2f} | {med['hit']:14.0%} |"
        )


if __name__ == "__main__":
    main()
