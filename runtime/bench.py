"""`precast bench`: throughput and latency, in-process (--engine) or against a server (--url).

Prompts are synthetic (random token ids of --input-len, --output-len tokens generated with
EOS ignored, so every request does the same work) or read from a JSONL file of
{"prompt": str, "max_tokens": int}. Load is a fixed --concurrency or a Poisson
--request-rate. Reports request and token throughput, time to first token (TTFT),
inter-token latency (ITL) and end-to-end latency percentiles, as a table and as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from precast.errors import PrecastError
from precast.runtime.llm import LLM
from precast.runtime.sampling_params import SamplingParams


@dataclass
class Sample:
    prompt: str | list[int]
    max_tokens: int


@dataclass
class RequestResult:
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str | None = None


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--engine", help="benchmark in-process on this engine directory (offline)")
    target.add_argument("--url", help="benchmark a running server, e.g. http://127.0.0.1:8000 (online)")
    p.add_argument("--model", help="model name to send (online; default: the server's first model)")
    p.add_argument("--api-key")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dataset", help='JSONL file of {"prompt": ..., "max_tokens": ...} instead of synthetic prompts')
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--request-rate", type=float, help="Poisson arrivals per second instead of fixed concurrency")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", help="also write the results as JSON to this file")


def make_samples(args: argparse.Namespace, vocab_size: int) -> list[Sample]:
    rng = random.Random(args.seed)
    if args.dataset:
        samples = []
        with open(args.dataset, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    samples.append(Sample(row["prompt"], int(row.get("max_tokens", args.output_len))))
                except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                    raise PrecastError(f'{args.dataset}:{n}: expected {{"prompt": ..., "max_tokens": ...}} ({e})') from e
        if not samples:
            raise PrecastError(f"{args.dataset} holds no prompts")
        return samples[: args.num_prompts]
    # Token ids away from the special tokens at the start of most vocabularies.
    low = min(1000, vocab_size // 2)
    return [Sample([rng.randrange(low, vocab_size) for _ in range(args.input_len)], args.output_len) for _ in range(args.num_prompts)]


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    v = sorted(values)

    def pct(q: float) -> float:
        return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]

    return {"mean": statistics.fmean(v), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


async def drive(samples: list[Sample], one: Any, concurrency: int, rate: float | None, seed: int) -> tuple[list[RequestResult], float]:
    sem = asyncio.Semaphore(concurrency if rate is None else len(samples))
    rng = random.Random(seed)

    async def bounded(s: Sample) -> RequestResult:
        async with sem:
            return await one(s)

    start = time.perf_counter()
    tasks = []
    for s in samples:
        tasks.append(asyncio.create_task(bounded(s)))
        if rate:
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def offline(args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    with LLM(args.engine) as llm:
        samples = make_samples(args, llm.engine.config.model.vocab_size)

        async def one(s: Sample) -> RequestResult:
            r = RequestResult()
            t0 = last = time.perf_counter()
            params = SamplingParams(max_tokens=s.max_tokens, temperature=0.0, ignore_eos=not args.dataset)
            async for out in llm.generate_async(s.prompt, params):
                now = time.perf_counter()
                if out.delta_token_ids:
                    if r.output_tokens == 0:
                        r.ttft = now - t0
                    else:
                        r.itls += [(now - last) / len(out.delta_token_ids)] * len(out.delta_token_ids)
                    r.output_tokens += len(out.delta_token_ids)
                    last = now
                if out.finished:
                    r.prompt_tokens = len(out.prompt_token_ids)
                    r.error = out.error
            r.e2e = time.perf_counter() - t0
            return r

        return asyncio.run(drive(samples, one, args.concurrency, args.request_rate, args.seed))


def online(args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.url.rstrip("/")
    models = httpx.get(f"{base}/v1/models", headers=headers, timeout=30).json()
    model = args.model or models["data"][0]["id"]
    entry = next((m for m in models["data"] if m["id"] == model), models["data"][0])
    samples = make_samples(args, vocab_size=int(entry.get("vocab_size", 32000)))

    async def main() -> tuple[list[RequestResult], float]:
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=None) as client:

            async def one(s: Sample) -> RequestResult:
                r = RequestResult()
                body = {
                    "model": model,
                    "prompt": s.prompt,
                    "max_tokens": s.max_tokens,
                    "temperature": 0.0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "ignore_eos": not args.dataset,
                }
                t0 = last = time.perf_counter()
                chunks = 0
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        r.error = (await resp.aread()).decode()
                        return r
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        data = json.loads(line[6:])
                        now = time.perf_counter()
                        if "error" in data:
                            r.error = data["error"]["message"]
                        elif data.get("usage"):
                            r.prompt_tokens = data["usage"]["prompt_tokens"]
                            r.output_tokens = data["usage"]["completion_tokens"]
                        elif data["choices"] and data["choices"][0]["text"]:
                            if chunks == 0:
                                r.ttft = now - t0
                            else:
                                r.itls.append(now - last)
                            chunks += 1
                            last = now
                r.e2e = time.perf_counter() - t0
                return r

            return await drive(samples, one, args.concurrency, args.request_rate, args.seed)

    return asyncio.run(main())


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": out_tokens,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "ttft_s": percentiles([r.ttft for r in ok]),
        "itl_s": percentiles([x for r in ok for x in r.itls]),
        "e2e_s": percentiles([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def format_table(s: dict[str, Any]) -> str:
    lines = ["| metric | value |", "| --- | --- |"]
    for key in ("requests", "failed", "input_tokens", "output_tokens"):
        lines.append(f"| {key} | {s[key]} |")
    lines.append(f"| duration | {s['duration_s']:.2f} s |")
    lines.append(f"| request throughput | {s['request_throughput']:.2f} req/s |")
    lines.append(f"| output token throughput | {s['output_token_throughput']:.1f} tok/s |")
    lines.append(f"| total token throughput | {s['total_token_throughput']:.1f} tok/s |")
    for key, label in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("e2e_s", "end-to-end")):
        p = s[key]
        lines.append(
            f"| {label} mean / p50 / p90 / p99 | {p['mean'] * 1e3:.1f} / {p['p50'] * 1e3:.1f} / {p['p90'] * 1e3:.1f} / {p['p99'] * 1e3:.1f} ms |"
        )
    return "\n".join(lines)


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    if args.num_prompts < 1 or args.concurrency < 1 or args.input_len < 1 or args.output_len < 1:
        raise PrecastError("--num-prompts, --concurrency, --input-len and --output-len must be at least 1")
    results, duration = offline(args) if args.engine else online(args)
    summary = summarize(results, duration)
    summary["mode"] = "offline" if args.engine else "online"
    print(format_table(summary))
    if summary["errors"]:
        print("errors:", *summary["errors"], sep="\n  ")
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    return summary
