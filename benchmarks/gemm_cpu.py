"""precast's linear kernels against PyTorch's GEMM (oneDNN) on a model's layer shapes.

Two tables, precast / torch rounds alternating (3 calls each), median of --repeats rounds, same thread count; precast's
weight packing (done once at engine load) is excluded:
  float32    y = x @ W.T on the float32 FMA path against torch float32, --rows rows (a prefill)
  bf16 dots  bf16 / fp8 / int4 weights on each dot-product unit this host has (float32 FMAs, AVX512-BF16, AMX;
             plugins/cpu/bf16_gemm.h) against torch bfloat16, at --rows rows and at 1 row (a decode step)

    python benchmarks/gemm_cpu.py [--model smollm2|qwen2.5-coder-1.5b] [--rows 512] [--repeats 9] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from compare_cpu import cpu_name  # benchmarks/ is on sys.path when a script here runs

SHAPES = {  # (out, in) of each linear layer
    "smollm2": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)},
    "qwen2.5-coder-1.5b": {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)},
}


def rounds(ours_call, torch_call, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds per call of each, alternating rounds; the first round warms up."""
    ours, theirs = [], []
    for _ in range(repeats + 1):
        ours.append(ours_call())
        t0 = time.perf_counter()
        for _ in range(3):
            torch_call()
        theirs.append((time.perf_counter() - t0) / 3)
    return ours[1:], theirs[1:]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}..{max(values):.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(SHAPES), default="smollm2")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    import ml_dtypes
    import torch

    from precast import _C
    from precast.engine.formats import quantize_fp8, quantize_int4
    from precast.runtime.cpu_backend import default_num_threads

    threads = args.threads or default_num_threads()
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    shapes = SHAPES[args.model]
    print(f"{cpu_name()}, {threads} threads, {args.model} layer shapes, median of {args.repeats} (min..max) GFLOP/s\n")
    print(f"float32 y = x @ W.T, {args.rows} rows\n")
    print("| layer | out x in | precast | torch (oneDNN) | precast / torch |")
    print("| --- | --- | --- | --- | --- |")
    for name, (out, cols) in shapes.items():
        w = rng.standard_normal((out, cols)).astype(np.float32)
        x = rng.standard_normal((args.rows, cols)).astype(np.float32)
        flops = 2.0 * args.rows * out * cols
        tx, tw = torch.from_numpy(x), torch.from_numpy(w)
        values = w.view(np.uint8).reshape(-1)
        ours, theirs = rounds(
            lambda: _C.linear(x, _C.WeightDtype.F32, out, cols, values, num_threads=threads, repeats=-3, dot="float32")[1],  # noqa: B023
            lambda: torch.nn.functional.linear(tx, tw),  # noqa: B023
            args.repeats,
        )
        ours, theirs = [flops / s / 1e9 for s in ours], [flops / s / 1e9 for s in theirs]
        m, t = statistics.median(ours), statistics.median(theirs)
        print(f"| {name} | {out} x {cols} | {spread(ours)} | {spread(theirs)} | {m / t:.2f}x |")

    units = _C.dot_units()
    print(f"\nbf16 / fp8 / int4 weights on each dot-product unit ({', '.join(units)}) against torch bfloat16\n")
    print(f"| layer | rows | weights | {' | '.join(units)} | torch bf16 | best unit / torch |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in units) + " | --- | --- |")
    for name, (out, cols) in shapes.items():
        w = (rng.standard_normal((out, cols)) * 0.05).astype(np.float32)
        fp8, int4 = quantize_fp8(w), quantize_int4(w, 128)
        formats = {
            "bf16": (_C.WeightDtype.BF16, w.astype(ml_dtypes.bfloat16).view(np.uint8).reshape(-1), None, 0, 1.0),
            "fp8": (_C.WeightDtype.FP8, fp8.values.view(np.uint8), None, 0, fp8.scale),
            "int4": (_C.WeightDtype.INT4, int4.packed, int4.scales, 128, 1.0),
        }
        tw = torch.from_numpy(w).bfloat16()
        for rows in (args.rows, 1):
            x = rng.standard_normal((rows, cols)).astype(np.float32)
            tx = torch.from_numpy(x).bfloat16()
            flops = 2.0 * rows * out * cols
            calls = 3 if rows > 1 else 30
            for fmt, (dtype, values, scales, group, scale) in formats.items():
                cells, torch_all = [], []
                for unit in units:
                    ours, theirs = rounds(
                        lambda: _C.linear(x, dtype, out, cols, values, scales, group, scale, num_threads=threads, repeats=-calls, dot=unit)[  # noqa: B023
                            1
                        ],
                        lambda: torch.nn.functional.linear(tx, tw),  # noqa: B023
                        args.repeats,
                    )
                    cells.append([flops / s / 1e9 for s in ours])
                    torch_all += [flops / s / 1e9 for s in theirs]
                best = max(statistics.median(c) for c in cells)
                print(
                    f"| {name} | {rows} | {fmt} | {' | '.join(spread(c) for c in cells)} | {spread(torch_all)} | "
                    f"{best / statistics.median(torch_all):.2f}x |"
                )


if __name__ == "__main__":
    main()
