#!/usr/bin/env bash
# The CUDA backend's device check (docs/gpu.md), for a task lent an NVIDIA GPU: one call of the device tool,
#   run(command="bash benchmarks/gpu_check.sh", timeout_s=560)
# It needs only what that machine's image holds (python3 with torch, triton, transformers, numpy, safetensors,
# ml_dtypes, tokenizers, cmake, scikit-build-core, pybind11): precast is built there without the network.
# Logs and the table come back under $OUT; the engines and checkpoints stay in /tmp.
set -euo pipefail
OUT=${OUT:-/tmp/precast-gpu-check}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/device.txt"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"

echo "== build precast (C++ runtime and bindings) against this machine's Python"
"$PY" -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }

echo "== the kernel tests, compiled for this GPU"
PRECAST_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider tests/plugins/test_triton_kernels.py >"$OUT/kernel_tests.log" 2>&1 \
    || echo "KERNEL TESTS FAILED (see kernel_tests.log)"
tail -3 "$OUT/kernel_tests.log"

echo "== greedy tokens against the CPU runner's, decode speed against PyTorch eager and the bandwidth limit"
"$PY" benchmarks/gpu_check.py device --out "$OUT" --work /tmp/precast-gpu-work 2>&1 | tee "$OUT/gpu_check.log"
