"""The build pipeline: checkpoint -> ModelSpec + weight plan -> engine directory.

Streaming: each engine tensor is read from the checkpoint, converted and written before
the next is touched, so peak memory is about one (fused) tensor whatever the model size.

A quantized build (`--quant`, `--kv-cache-dtype fp8`) first builds the full-precision engine
into a temporary directory beside the output, calibrates on it with precast's CPU runner,
then writes the quantized engine from it (quantization/quantize.py).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tqdm import tqdm

import precast
from precast.builder import prequantized
from precast.builder.architectures import find_architecture
from precast.builder.checkpoint import Checkpoint, open_checkpoint
from precast.builder.tensorrt.plan import build_plan
from precast.builder.weights import PlannedTensor, plan_weights
from precast.engine.directory import (
    ENGINE_DTYPES,
    TARGETS,
    WEIGHTS_FILE,
    EngineConfig,
    atomic_directory,
    fsync_tree,
    load_engine,
    numpy_dtype,
    remove_stale_scratch,
    scratch_directory,
    write_json,
)
from precast.engine.limits import resolve_limits
from precast.engine.quant import DYNAMIC_CPU_ONLY, Int4Layer, Nvfp4Layer, QuantSection
from precast.engine.safetensors_file import DTYPES, SafetensorsWriter
from precast.errors import PrecastError
from precast.quantization import quantize
from precast.quantization.calibration import calibrate, calibration_sequences
from precast.quantization.recipe import QuantOptions, plan_layers
from precast.runtime.tensorrt.lowering import FP8_KV_REFUSAL
from precast.runtime.tensorrt.trt_ops import import_tensorrt


@dataclass(frozen=True)
class BuildOptions:
    checkpoint: Path
    output: Path
    dtype: str | None = None  # None: the rule in default_dtype()
    max_batch_size: int | None = None
    max_seq_len: int | None = None
    max_num_tokens: int | None = None
    tokens_per_block: int | None = None
    targets: tuple[str, ...] = ("cpu",)
    force: bool = False
    progress: bool = True
    quant: QuantOptions = field(default_factory=QuantOptions)


@dataclass(frozen=True)
class BuildResult:
    path: Path
    config: EngineConfig
    seconds: float
    weight_bytes: int


def default_dtype(checkpoint: Checkpoint) -> str:
    """The source's own precision when it is one an engine can store; float32 for GGUF
    (dequantized GGUF blocks are exact in float32, not in the 16-bit types)."""
    if checkpoint.format == "gguf":
        return "float32"
    declared = checkpoint.config.get("torch_dtype") or checkpoint.config.get("dtype")
    return declared if declared in ENGINE_DTYPES else "float32"


def build_engine(opts: BuildOptions) -> BuildResult:
    start = time.perf_counter()
    unknown_targets = [t for t in opts.targets if t not in TARGETS]
    if unknown_targets:
        raise PrecastError(f"unknown --target {', '.join(unknown_targets)}; available: {', '.join(TARGETS)}")
    if opts.dtype is not None and opts.dtype not in ENGINE_DTYPES:
        raise PrecastError(f"--dtype {opts.dtype!r} is not supported; choose from {', '.join(ENGINE_DTYPES)}")
    if opts.output.exists() and not opts.force:  # checked early: fail before minutes of work
        raise PrecastError(f"{opts.output} already exists; choose another --output or pass --force to replace it")
    opts.quant.check()
    for line in remove_stale_scratch(opts.output):
        print(f"precast build: {line}", file=sys.stderr)
    if "tensorrt" in opts.targets:  # fail before minutes of work when no TensorRT builder is installed
        if opts.quant.activation_scales == "dynamic":
            raise PrecastError(DYNAMIC_CPU_ONLY)
        import_tensorrt()
        if opts.quant.kv_cache_dtype == "fp8":
            raise PrecastError(FP8_KV_REFUSAL)
    if opts.quant.active:
        return _build_quantized(opts, start)

    checkpoint = open_checkpoint(opts.checkpoint)
    arch = find_architecture(checkpoint.config)
    spec = arch.to_spec(checkpoint.config)
    limits = resolve_limits(spec, opts.max_batch_size, opts.max_seq_len, opts.max_num_tokens, opts.tokens_per_block)
    quant = QuantSection()
    if checkpoint.prequantized:  # FP8 from modelopt: its scales, no recalibration (builder/prequantized.py)
        plan = plan_weights(spec, arch, checkpoint, also_used=prequantized.scale_tensors(checkpoint))
        layers = prequantized.quantized_layers(checkpoint, plan)
        quant = QuantSection(
            recipe="fp8",
            lm_head="lm_head" in layers or "embed" in layers,
            layers=layers,
            source=f"{checkpoint.prequantized['method']} {checkpoint.prequantized['algo']} export, not recalibrated",
        )
    else:
        plan = plan_weights(spec, arch, checkpoint)
    dtype = opts.dtype or default_dtype(checkpoint)
    tokenizer = checkpoint.tokenizer()

    config = EngineConfig(
        model=spec,
        dtype=dtype,
        limits=limits,
        targets={t: {} for t in opts.targets},
        tokenizer=None
        if tokenizer is None
        else {
            "files": sorted(tokenizer.files),
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_ids": tokenizer.eos_token_ids,
            "pad_token_id": tokenizer.pad_token_id,
            "chat_template": tokenizer.chat_template,
        },
        generation=_generation_defaults(checkpoint),
        quant=quant,
        provenance={
            "source": str(Path(opts.checkpoint).resolve()),
            "source_format": checkpoint.format,
            "source_sha256": checkpoint.digest(),
            "precast_version": precast.__version__,
            "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        },
    )
    expected = config.expected_tensors()
    layout = [(t.name, DTYPES[expected[t.name][1]], t.shape) for t in plan]
    total_bytes = sum(math.prod(shape) * np.dtype(dt).itemsize for _, dt, shape in layout)

    with atomic_directory(opts.output, opts.force) as tmp:
        with (
            open(tmp / WEIGHTS_FILE, "wb") as f,
            tqdm(total=total_bytes, unit="B", unit_scale=True, desc="precast build", disable=not opts.progress) as bar,
        ):
            writer = SafetensorsWriter(f, layout, metadata={"format": "precast"})
            fused = {}  # pre-quantized layers' records, completed with their scales as they are read
            for tensor, (_, target, _) in zip(plan, layout):
                layer = tensor.name[: -len(".weight")]
                if layer in quant.layers:
                    array, fused[layer] = prequantized.fuse_fp8(checkpoint, tensor)
                else:
                    array = _convert(_read_fused(checkpoint, tensor), target, tensor.name)
                writer.write(tensor.name, array)
                bar.update(array.nbytes)
            writer.finish()
        if tokenizer is not None:
            for name, content in tokenizer.files.items():
                (tmp / name).write_bytes(content)
        if fused:
            config = replace(config, quant=replace(quant, layers=fused))
        write_json(tmp / "config.json", config.to_dict())
        config = _build_other_targets(tmp, opts) or config
        fsync_tree(tmp)
    return BuildResult(opts.output, config, time.perf_counter() - start, total_bytes)


def _build_other_targets(tmp: Path, opts: BuildOptions) -> EngineConfig | None:
    """The TensorRT plan, built into the engine's temporary directory (so the engine appears whole or not at all)."""
    if "tensorrt" not in opts.targets:
        return None
    report, config = build_plan(tmp, previous=opts.output if opts.output.is_dir() else None)
    if opts.progress:
        print(
            f"tensorrt plan: {report['builder']} {report['builder_version']}, {report['plan_bytes'] / 2**20:.1f} MiB "
            f"in {report['build_seconds']} s, targets {report['compute_capabilities']}"
        )
    return config


def _build_quantized(opts: BuildOptions, start: float) -> BuildResult:
    q = opts.quant
    checkpoint = open_checkpoint(opts.checkpoint)
    if checkpoint.prequantized:
        raise PrecastError(
            f"{opts.checkpoint} is already quantized ({checkpoint.prequantized['method']} {checkpoint.prequantized['algo']}); "
            "build it without --quant / --kv-cache-dtype to use its own scales, or quantize the full-precision checkpoint"
        )
    spec = find_architecture(checkpoint.config).to_spec(checkpoint.config)
    plan = plan_layers(spec, q)  # shape problems are reported before any work
    needs_activations = any(p.quantizes_inputs for p in plan.values())
    needs_awq = any(isinstance(p, Int4Layer) for p in plan.values())
    needs_rows = needs_awq or (q.scale_search and any(isinstance(p, Nvfp4Layer) for p in plan.values()))  # the searches
    sequences, source = None, ""
    if needs_activations or needs_awq or q.kv_cache_dtype == "fp8":  # read the text before building anything
        if q.calib_tokens is not None:
            sequences, source = [list(t) for t in q.calib_tokens], "token ids given through the Python API"
        else:
            tokenizer = checkpoint.tokenizer()
            raw = tokenizer.files.get("tokenizer.json") if tokenizer else None
            tokenizer_json = raw.decode("utf-8") if raw else None
            sequences, source = calibration_sequences(tokenizer_json, q.calib_text, q.calib_samples, q.calib_seq_len)
    opts.output.parent.mkdir(parents=True, exist_ok=True)
    with scratch_directory(opts.output, "full") as work:
        full = build_engine(replace(opts, output=Path(work) / "engine", force=False, quant=QuantOptions(), targets=("cpu",)))
        engine = load_engine(full.path)
        calib = None
        if sequences is not None:
            calib = calibrate(engine, sequences, max_sample_rows=AWQ_SAMPLE_ROWS if needs_rows else 0, scratch=Path(work))
            calib.report["source"] = source
        section = quantize.quant_section(q, plan)
        if q.kv_cache_dtype == "fp8":
            assert calib is not None
            section = replace(section, kv_cache=quantize.kv_cache_scales(calib, spec.num_layers))
        config = replace(engine.config, quant=section, limits=replace(engine.config.limits, kv_cache_dtype=q.kv_cache_dtype))
        scales = quantize.awq_scales(engine, plan, calib, opts.progress) if needs_awq and calib else {}
        with atomic_directory(opts.output, opts.force) as tmp:
            total, records = quantize.write_quantized_weights(
                engine, tmp, config.expected_tensors(), plan, calib, scales, opts.progress, q.scale_search
            )
            for name in (config.tokenizer or {}).get("files", []):
                (tmp / name).write_bytes((engine.path / name).read_bytes())
            section = replace(section, layers=records, calibration=calib.report if calib is not None else None)
            config = replace(config, quant=section)
            write_json(tmp / "config.json", config.to_dict())
            config = _build_other_targets(tmp, opts) or config
            fsync_tree(tmp)
    return BuildResult(opts.output, config, time.perf_counter() - start, total)


AWQ_SAMPLE_ROWS = 512  # calibration rows kept per layer for the AWQ and scale searches (bounded memory)


def _read_fused(checkpoint: Checkpoint, tensor: PlannedTensor) -> np.ndarray:
    parts = [checkpoint.read(s) for s in tensor.sources]
    return tensor.arrange(parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0))


_FLOAT_SOURCES = (np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16), numpy_dtype("bfloat16"))


def _convert(array: np.ndarray, target: np.dtype, name: str) -> np.ndarray:
    """Cast to the engine dtype (round to nearest even), refusing NaN/Inf in or out."""
    if array.dtype not in _FLOAT_SOURCES:
        raise PrecastError(f"tensor for {name} has dtype {array.dtype}; only floating-point weights can be built")
    if not np.isfinite(array).all():
        raise PrecastError(f"tensor for {name} contains NaN or Inf in the checkpoint; the checkpoint is damaged")
    with np.errstate(over="ignore"):  # overflow is reported below, with advice
        out = array.astype(target, copy=False)
    if target == np.float16 and not np.isfinite(out).all():
        raise PrecastError(f"tensor for {name} has values beyond float16's range (65504); build with --dtype bfloat16 or float32")
    return out


# When the checkpoint has no sampling defaults (a GGUF file, or no generation_config.json): a mild
# repetition penalty, without which small models loop on sampled text ("a shore, a shore, ...").
FALLBACK_GENERATION = {"repetition_penalty": 1.1}


def _generation_defaults(checkpoint: Checkpoint) -> dict[str, object]:
    keep = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens")
    gen = checkpoint.generation_config()
    return {k: gen[k] for k in keep if gen.get(k) is not None} or dict(FALLBACK_GENERATION)
