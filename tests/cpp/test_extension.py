"""The compiled module precast._C builds, imports and reports the CPU honestly."""

from __future__ import annotations

import platform

import precast
import precast._C as C


def test_version_matches_package():
    assert C.__version__ == precast.__version__


def test_cpu_features_are_consistent():
    f = C.cpu_features()
    assert f["logical_cores"] >= 1
    isa = C.best_isa()
    assert isa in ("avx512", "avx2", "scalar")
    if isa == "avx512":
        assert f["avx512f"] and f["avx512bw"] and f["avx512vl"] and f["avx2"]
    if f["avx512_bf16"] or f["avx512_vnni"]:
        assert f["avx512f"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags = open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""
        if " avx2" in flags:
            assert f["avx2"]
        if " avx512f" in flags:
            assert f["avx512f"]


def test_thread_pool_finishes_every_job_when_threads_are_oversubscribed():
    """Thousands of tiny parallel loops, with more pool threads than cores and a busy competitor
    process: a lost wake-up or a miscounted job would hang, so it runs in a child with a deadline."""
    import subprocess
    import sys

    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        script = "from precast import _C; print(_C.memory_bandwidth('read', 4096, num_threads=3, repeats=5000) > 0)"
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    finally:
        hog.kill()
    assert run.returncode == 0 and run.stdout.strip() == "True", run.stderr
