"""precast's float32 linear kernel against PyTorch's GEMM (oneDNN) on SmolLM2-135M's layer shapes, 512 rows.

Alternating precast / torch rounds of 3 calls each, median of --repeats rounds, same thread count; precast's weight packing (done once at
engine load) is excluded. Prints GFLOP/s and the ratio.

    python benchmarks/gemm_cpu.py [--rows 512] [--repeats 9] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (out, in)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    import torch

    from precast import _C
    from precast.runtime.cpu_backend import default_num_threads

    threads = args.threads or default_num_threads()
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    print(f"float32 y = x @ W.T, {args.rows} rows, {threads} threads, median of {args.repeats} (min..max) GFLOP/s\n")
    print("| layer | out x in | precast | torch (oneDNN) | precast / torch |")
    print("| --- | --- | --- | --- | --- |")
    for name, (out, cols) in SHAPES.items():
        w = rng.standard_normal((out, cols)).astype(np.float32)
        x = rng.standard_normal((args.rows, cols)).astype(np.float32)
        flops = 2.0 * args.rows * out * cols
        tx, tw = torch.from_numpy(x), torch.from_numpy(w)
        ours, theirs = [], []
        for _ in range(args.repeats + 1):  # the first round warms up
            _, seconds = _C.linear(x, _C.WeightDtype.F32, out, cols, w.view(np.uint8).reshape(-1), num_threads=threads, repeats=-3)
            ours.append(flops / seconds / 1e9)
            t0 = time.perf_counter()
            for _ in range(3):
                torch.nn.functional.linear(tx, tw)
            theirs.append(3 * flops / (time.perf_counter() - t0) / 1e9)
        ours, theirs = ours[1:], theirs[1:]
        m, t = statistics.median(ours), statistics.median(theirs)
        print(
            f"| {name} | {out} x {cols} | {m:.0f} ({min(ours):.0f}..{max(ours):.0f}) | {t:.0f} ({min(theirs):.0f}..{max(theirs):.0f}) "
            f"| {m / t:.2f}x |"
        )


if __name__ == "__main__":
    main()
