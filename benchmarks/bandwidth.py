"""The memory-bandwidth limit, checked: precast's probe (precast._C.memory_bandwidth, which benchmarks quote as "% of
the bandwidth limit") against an independent measurement in the same run, PyTorch streaming the same bytes with the
same threads.

This machine's bandwidth moves by up to 2x from one second to the next (a shared host), so the two are measured in
alternating rounds, each the best of --passes passes over --mib MiB per array, and reported as the median and range
over --rounds rounds. The probe is trustworthy when its median read is about torch's.

    python benchmarks/bandwidth.py [--threads 1 2] [--mib 1024] [--rounds 7] [--passes 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from compare_cpu import cpu_name  # benchmarks/ is on sys.path when a script here runs


class TorchStreams:
    def __init__(self, mib: int) -> None:
        import torch

        n = (mib << 20) // 4
        self.torch = torch
        self.a = torch.ones(n, dtype=torch.float32)
        self.b = torch.empty_like(self.a).fill_(2.0)

    def rates(self, threads: int, passes: int) -> dict[str, float]:
        self.torch.set_num_threads(threads)
        nbytes = self.a.numel() * 4
        read = copy = 0.0
        for _ in range(passes):
            t = time.perf_counter()
            float(self.a.sum())
            read = max(read, nbytes / (time.perf_counter() - t))
            t = time.perf_counter()
            self.b.copy_(self.a)
            copy = max(copy, 2 * nbytes / (time.perf_counter() - t))
        return {"read": read, "copy": copy}


def summary(values: list[float]) -> str:
    return f"{statistics.median(values) / 1e9:.1f} ({min(values) / 1e9:.1f}..{max(values) / 1e9:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()

    from precast import _C

    streams = TorchStreams(args.mib)
    print(
        f"\n{cpu_name()}; {args.mib} MiB per array; median (min..max) over {args.rounds} alternating rounds of best-of-{args.passes}; GB/s\n"
    )
    print("| threads | precast read | torch sum (read) | read: precast / torch | precast copy | torch copy_ | copy: precast / torch |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for threads in args.threads:
        ours: dict[str, list[float]] = {"read": [], "copy": []}
        theirs: dict[str, list[float]] = {"read": [], "copy": []}
        for _ in range(args.rounds):
            for kind in ours:
                ours[kind].append(_C.memory_bandwidth(kind, args.mib << 20, threads, args.passes))
            for kind, rate in streams.rates(threads, args.passes).items():
                theirs[kind].append(rate)
        ratio = {k: statistics.median(ours[k]) / statistics.median(theirs[k]) for k in ours}
        print(
            f"| {threads} | {summary(ours['read'])} | {summary(theirs['read'])} | {ratio['read']:.2f} | {summary(ours['copy'])} | "
            f"{summary(theirs['copy'])} | {ratio['copy']:.2f} |"
        )


if __name__ == "__main__":
    main()
