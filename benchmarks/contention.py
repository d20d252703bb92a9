"""Decode speed when another process shares the cores (the thread pool's bounded spin, plugins/cpu/thread_pool.cpp).

SmolLM2-135M-Instruct (bfloat16 engine, built here from the packaged GGUF), batch-1 greedy decode of
--tokens tokens, with 0, 1 and 2 busy competitor processes (pure-Python loops). Printed per thread
count: tokens/s (median of --repeats) and the ratio to the uncontended run.

    python benchmarks/contention.py [--threads 1 2] [--tokens 96] [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

from compare_cpu import cpu_name, smollm2_bf16_engine  # benchmarks/ is on sys.path when a script here runs


def busy(stop) -> None:  # a competitor: one core's worth of work until told to stop
    while not stop.is_set():
        sum(range(10_000))


def decode_rate(llm, tokens: int) -> float:
    from precast.runtime import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate("Once upon a time", SamplingParams(max_tokens=4, temperature=0))  # warm
    start = time.perf_counter()
    out = llm.generate("Once upon a time", params)
    return len(out.token_ids) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--competitors", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from precast.runtime import LLM

    with tempfile.TemporaryDirectory() as scratch:
        engine = smollm2_bf16_engine(Path(scratch) / "smollm2-bf16", max_seq_len=512)
        rows = []
        for threads in args.threads:
            with LLM(engine, num_threads=threads, kv_cache_memory=64 << 20) as llm:
                rates = {}
                for n in args.competitors:
                    spawn = multiprocessing.get_context("spawn")  # not fork: this process runs C++ threads
                    stop = spawn.Event()
                    procs = [spawn.Process(target=busy, args=(stop,)) for _ in range(n)]
                    for p in procs:
                        p.start()
                    try:
                        rates[n] = statistics.median(decode_rate(llm, args.tokens) for _ in range(args.repeats))
                    finally:
                        stop.set()
                        for p in procs:
                            p.join(timeout=10)
                            if p.is_alive():
                                p.kill()
                rows.append((threads, rates))
    print(f"\nCPU: {cpu_name()}; {multiprocessing.cpu_count()} cores; SmolLM2-135M bf16, batch-1 decode of {args.tokens} tokens")
    print("| threads | " + " | ".join(f"{n} competitor(s): tok/s (x alone)" for n in args.competitors) + " |")
    print("| --- |" + " --- |" * len(args.competitors))
    for threads, rates in rows:
        alone = rates[args.competitors[0]]
        print(f"| {threads} | " + " | ".join(f"{rates[n]:.1f} ({rates[n] / alone:.2f})" for n in args.competitors) + " |")


if __name__ == "__main__":
    main()
