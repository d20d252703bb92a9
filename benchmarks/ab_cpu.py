"""Two or more builds of precast's native library, or engines, compared in alternation on one engine.

This shared host's memory bandwidth swings up to 2x from one second to the next (benchmarks/bandwidth.py), so two
runs minutes apart cannot show a 5-10% kernel change. Here each contender is a process with its engine loaded once;
the parent asks them in turn for one short burst (a decode of --tokens tokens, a prefill of --tokens, or a 32-way
generate of --tokens each), reversing the order every round, and reports each contender's median and its median
ratio to the first per round (min..max): a ratio whose min stays above 1 is a real gain.

A contender is LIBRARY[@ENGINE]: a copy of precast/_C*.so (e.g. saved before a change) loaded in place of the
installed one, or `installed`; ENGINE overrides --engine for that contender.

    cp .venv/lib/python3.11/site-packages/precast/_C*.so /tmp/_C.before.so   # before the change, then rebuild
    python benchmarks/ab_cpu.py --engine ENGINE_DIR --kind decode --rounds 20 /tmp/_C.before.so installed
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path


def load_library(path: str) -> None:
    """Makes `precast._C` the extension module at `path` (before anything imports the installed one)."""
    import importlib.machinery
    import importlib.util

    import precast

    loader = importlib.machinery.ExtensionFileLoader("precast._C", path)
    spec = importlib.util.spec_from_file_location("precast._C", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules["precast._C"] = module
    precast._C = module


def worker(engine: str, kind: str, tokens: int, threads: int) -> None:
    """Loads the engine, says `ready`, then runs one burst per line read and prints its tokens/s."""
    import numpy as np

    from precast.runtime import LLM, SamplingParams

    rng = np.random.default_rng(0)
    greedy = dict(temperature=0, ignore_eos=True)
    chat = rng.integers(100, 40000, 20).tolist()
    with LLM(engine, num_threads=threads, prefix_reuse=False, kv_cache_memory=2 << 30) as llm:
        llm.generate(chat, SamplingParams(max_tokens=8))  # warm-up
        print("ready", flush=True)
        for _ in sys.stdin:
            if kind == "decode":
                first = None
                for _out in llm.stream(chat, SamplingParams(max_tokens=tokens + 1, **greedy)):
                    first = first or time.perf_counter()
                rate = tokens / (time.perf_counter() - first)
            elif kind == "prefill":
                t0 = time.perf_counter()
                llm.generate(rng.integers(100, 40000, tokens).tolist(), SamplingParams(max_tokens=1, **greedy))
                rate = tokens / (time.perf_counter() - t0)
            else:  # 32-way: 32 prompts of 128 tokens, `tokens` out each
                prompts = [rng.integers(100, 40000, 128).tolist() for _ in range(32)]
                t0 = time.perf_counter()
                llm.generate(prompts, SamplingParams(max_tokens=tokens, **greedy))
                rate = 32 * tokens / (time.perf_counter() - t0)
            print(f"{rate:.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("contenders", nargs="*", help="LIBRARY[@ENGINE]: a copy of precast's _C*.so, or `installed`")
    parser.add_argument("--engine", help="the engine directory of contenders that name none")
    parser.add_argument("--kind", choices=["decode", "prefill", "32-way"], default="decode")
    parser.add_argument("--tokens", type=int, default=None, help="decode: 64, prefill: 512, 32-way: 128 by default")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)  # LIBRARY ENGINE, in a contender's process
    args = parser.parse_args()
    tokens = args.tokens or {"decode": 64, "prefill": 512, "32-way": 128}[args.kind]
    if args.worker:
        if args.worker[0] != "installed":
            load_library(args.worker[0])
        return worker(args.worker[1], args.kind, tokens, args.threads)

    if len(args.contenders) < 2:
        parser.error("give at least two contenders")
    contenders = []
    for spec in args.contenders:
        library, _, engine = spec.partition("@")
        engine = engine or args.engine
        if not engine or not (Path(engine) / "weights.safetensors").exists():
            parser.error(f"{spec}: no engine directory (give --engine or LIBRARY@ENGINE)")
        if library != "installed" and not Path(library).is_file():
            parser.error(f"{spec}: {library} is not a file")
        contenders.append((spec, library, engine))
    procs = []
    for _, library, engine in contenders:
        command = [sys.executable, __file__, "--worker", library, engine, "--kind", args.kind, "--tokens", str(tokens)]
        command += ["--threads", str(args.threads)]
        procs.append(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    try:
        for (spec, _, _), proc in zip(contenders, procs):
            if proc.stdout.readline().strip() != "ready":
                sys.exit(f"{spec}: the worker failed to load (its error is above)")
        rates: list[list[float]] = [[] for _ in contenders]
        for r in range(args.rounds):
            for i in range(len(procs)) if r % 2 == 0 else reversed(range(len(procs))):
                procs[i].stdin.write("go\n")
                procs[i].stdin.flush()
                rates[i].append(float(procs[i].stdout.readline()))
    finally:
        for proc in procs:
            proc.stdin.close()
            proc.wait()

    # Here, not at the top: compare_cpu imports precast, which a worker must not do before load_library.
    from compare_cpu import cpu_name  # benchmarks/ is on sys.path when a script here runs

    print(f"\n{args.kind} ({tokens} tokens), {args.rounds} rounds alternating, {cpu_name()}, {args.threads} threads")
    print("| contender | median tok/s (min..max) | ratio to the first, median (min..max) |")
    print("| --- | --- | --- |")
    for (spec, _, _), rs in zip(contenders, rates):
        ratios = [a / b for a, b in zip(rs, rates[0])]
        print(
            f"| {spec} | {statistics.median(rs):.2f} ({min(rs):.2f}..{max(rs):.2f}) | "
            f"{statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f}) |"
        )


if __name__ == "__main__":
    main()
