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
