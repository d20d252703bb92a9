"""Building a TensorRT plan for an engine directory: `precast build ... --target tensorrt`.

The plan is built from the engine's own weights (so the CPU and TensorRT targets run the same
numbers), with one optimization profile from the engine's build limits, and lands beside them:

    ENGINE/rank0.plan            the serialized TensorRT engine (GPU-only: never run here)
    ENGINE/tensorrt_build.json   the build report: builder and version, compute capabilities,
                                 precision per layer, build time, plan size
    ENGINE/timing.cache          TensorRT's timing cache, read back by the next build (full TensorRT;
                                 TensorRT-RTX does not time kernels and keeps none)
    config.json targets.tensorrt what the runtime checks before loading the plan
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from precast.engine.directory import CONFIG_FILE, EngineConfig, load_engine, write_json
from precast.engine.tensors import linear_shapes
from precast.errors import PrecastError
from precast.runtime.tensorrt.lowering import check_supported, lower
from precast.runtime.tensorrt.trt_ops import TrtOps, import_tensorrt, quiet_logger

PLAN_FILE = "rank0.plan"
REPORT_FILE = "tensorrt_build.json"
TIMING_CACHE_FILE = "timing.cache"

# What each TensorRT-RTX target can run (its builder's errors, measured here): FP4 needs Blackwell (sm120+), FP8
# Ada (sm89+), bfloat16 and float32 matrix products Ampere (sm80+; Turing has no FP32 GEMM there).
_AMPERE_ON = ("SM80", "SM86", "SM89", "SM120", "SM121")
_RTX_TARGETS = {"fp4": ("SM120", "SM121"), "fp8": ("SM89", "SM120", "SM121"), "bfloat16": _AMPERE_ON, "float32": _AMPERE_ON}
_RTX_ALL = ("SM75", "SM80", "SM86", "SM89", "SM120", "SM121")


def rtx_compute_capabilities(dtypes: set[str]) -> list[str]:
    """The TensorRT-RTX targets able to run every dtype the network uses."""
    return [cc for cc in _RTX_ALL if all(cc in _RTX_TARGETS.get(d, _RTX_ALL) for d in dtypes)]


def layer_precisions(config: Any, act_dtype: str) -> dict[str, str]:
    """Per linear layer: weight and input precision as lowered (the report's precision table)."""
    out = {}
    for name in linear_shapes(config.model):
        record = config.quant.layers.get(name)
        out[name] = f"{act_dtype} weights, {act_dtype} inputs" if record is None else record.precision(act_dtype)
    return out


def build_plan(engine_dir: Path, previous: Path | None = None, act_dtype: str | None = None) -> tuple[dict[str, Any], EngineConfig]:
    """Build ENGINE/rank0.plan (+ report, timing cache) and record it in ENGINE/config.json (the engine is being
    written in its build's temporary directory); returns the report and the updated config.
    `previous`: an older build of the same engine whose timing cache seeds this one."""
    trt = import_tensorrt()
    engine = load_engine(engine_dir)
    act = act_dtype or engine.config.dtype
    check_supported(engine.config, act)
    limits = engine.config.limits
    start = time.perf_counter()
    logger = quiet_logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    ops = TrtOps(trt, network)
    lower(ops, engine, act)

    config = builder.create_builder_config()
    S, tokens = limits.max_batch_size, limits.max_num_tokens
    profile = builder.create_optimization_profile()
    for name in ("input_ids", "position_ids"):  # [slots, step]: a decode step up to a full chunk of prefill
        profile.set_shape(name, (S, 1), (S, 1), (S, tokens))
    profile.set_shape("last_token_ids", (1,), (S,), (S,))
    config.add_optimization_profile(profile)

    targets: list[str] | str = "the GPU present at build time"
    if trt.__name__ == "tensorrt_rtx":
        targets = rtx_compute_capabilities({e.dtype for e in ops.trace} | {act})
        config.num_compute_capabilities = len(targets)
        for i, cc in enumerate(targets):
            config.set_compute_capability(getattr(trt.ComputeCapability, cc), i)

    # Full TensorRT keeps a timing cache beside the engine and seeds the next build with it (from the engine being
    # replaced, on --force). TensorRT-RTX chooses kernels without timing: its timing cache calls are no-ops.
    cache_path, cache_state = engine_dir / TIMING_CACHE_FILE, "not used by tensorrt_rtx (it does not time kernels)"
    use_cache = trt.__name__ == "tensorrt"
    if use_cache:
        seed = next((p for p in (cache_path, (previous or engine_dir) / TIMING_CACHE_FILE) if p.is_file()), None)
        config.set_timing_cache(config.create_timing_cache(seed.read_bytes() if seed else b""), ignore_mismatch=False)
        cache_state = "reused" if seed else "new"

    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise PrecastError(f"{trt.__name__} could not build a plan for {engine_dir} (its log above says why)")
    plan = bytes(serialized)
    seconds = time.perf_counter() - start
    _atomic_write(engine_dir / PLAN_FILE, plan)
    if use_cache:
        _atomic_write(cache_path, bytes(config.get_timing_cache().serialize()))

    record = {
        "plan": PLAN_FILE,
        "report": REPORT_FILE,
        "builder": trt.__name__,
        "builder_version": trt.__version__,
        "compute_capabilities": targets,
        "activation_dtype": act,
        "cache_len": limits.max_seq_len + limits.max_num_tokens,
        "plan_bytes": len(plan),
        "plan_sha256": hashlib.sha256(plan).hexdigest(),
    }
    report = {
        **record,
        "build_seconds": round(seconds, 2),
        "network_layers": len(ops.trace),
        "timing_cache": cache_state,
        "layer_precision": layer_precisions(engine.config, act),
        "kv_cache": f"{act}, [{S}, {engine.config.model.num_kv_heads}, {record['cache_len']}, {engine.config.model.head_dim}] per layer",
    }
    write_json(engine_dir / REPORT_FILE, report)
    engine_config = replace(engine.config, targets={**engine.config.targets, "tensorrt": record})
    write_json(engine_dir / CONFIG_FILE, engine_config.to_dict())
    return report, engine_config


def _atomic_write(path: Path, content: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(content)
    tmp.replace(path)
