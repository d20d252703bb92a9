"""Structured outputs' cost: 32-way throughput with every request JSON-schema constrained against the same requests
unconstrained, and the grammar time per token (runtime/guided.py: llguidance masks and token advances).

SmolLM2-135M-Instruct (bfloat16 engine, built here from the packaged GGUF). Each round runs the 32 requests free,
then constrained (a 10-item array of bounded strings, so both generate a similar number of tokens); rounds alternate
so drift on a shared machine hits both alike. Printed: generated tokens/s per round, the median, the ratio
constrained / free, and the mask and advance time per constrained token.

    python benchmarks/structured_cpu.py [--requests 32] [--max-tokens 160] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from compare_cpu import cpu_name, smollm2_bf16_engine  # benchmarks/ is on sys.path when a script here runs

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "items": {"type": "array", "items": {"type": "string", "minLength": 3, "maxLength": 30}, "minItems": 10, "maxItems": 10},
    },
    "required": ["title", "items"],
    "additionalProperties": False,
}


def run(llm, prompts: list[str], params) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    tokens = sum(len(o.token_ids) for o in outs)
    return tokens / (time.perf_counter() - start), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from precast.runtime import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as scratch:
        engine = smollm2_bf16_engine(Path(scratch) / "smollm2-bf16", max_seq_len=1024)
        with LLM(engine, num_threads=args.threads, kv_cache_memory=1 << 30) as llm:
            prompts = [
                llm.apply_chat_template([{"role": "user", "content": f"List ten things to pack for trip number {i}, as JSON."}])
                for i in range(args.requests)
            ]
            free = [
                SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=i, repetition_penalty=1.1) for i in range(args.requests)
            ]
            guided = [
                SamplingParams(json_schema=SCHEMA, max_tokens=args.max_tokens, temperature=0.8, seed=i, repetition_penalty=1.1)
                for i in range(args.requests)
            ]
            run(llm, prompts[:4], guided[:4])  # warm: llguidance's tokenizer and the compiled schema
            stats = llm._guided
            rates: dict[str, list[float]] = {"free": [], "json_schema": []}
            tokens: dict[str, list[int]] = {"free": [], "json_schema": []}
            guided_tokens, mask_s, advance_s = 0, 0.0, 0.0
            for _ in range(args.rounds):
                for name, params in (("free", free), ("json_schema", guided)):
                    rows0, mask0, adv0 = stats.mask_rows, stats.mask_seconds, stats.advance_seconds
                    rate, n = run(llm, prompts, params)
                    rates[name].append(rate)
                    tokens[name].append(n)
                    if name == "json_schema":
                        guided_tokens += stats.mask_rows - rows0
                        mask_s += stats.mask_seconds - mask0
                        advance_s += stats.advance_seconds - adv0
    print(f"\n{args.requests}-way, SmolLM2-135M-Instruct bf16, {args.threads} threads, {cpu_name()}\n")
    print("| requests | tokens per round | tok/s per round | median tok/s |")
    print("| --- | --- | --- | --- |")
    for name in rates:
        per_round = ", ".join(f"{r:.0f}" for r in rates[name])
        print(f"| {name} | {statistics.median(tokens[name]):.0f} | {per_round} | {statistics.median(rates[name]):.0f} |")
    ratio = statistics.median(rates["json_schema"]) / statistics.median(rates["free"])
    print(f"\nconstrained / free throughput: {ratio:.2f}x (aim: >= 0.8x)")
    print(f"grammar time per constrained token: mask {1e6 * mask_s / max(guided_tokens, 1):.0f} us, "
          f"advance {1e6 * advance_s / max(guided_tokens, 1):.0f} us ({guided_tokens} tokens)")  # fmt: skip


if __name__ == "__main__":
    main()
