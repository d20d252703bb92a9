"""Peak memory and time of `precast build` on a synthetic ~1.5B-parameter checkpoint.

The checkpoint (Qwen2-1.5B's shapes, random bf16 weights, sharded safetensors with an
index) is made at run time in a scratch directory, then `precast build` runs in a child
process whose peak RSS is read from the OS. Building streams tensor by tensor, so the
peak must stay under 2 GB plus the largest single tensor, whatever the model's size.

    python benchmarks/build_memory.py [--dtype bfloat16 float32] [--repeats 1] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

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


def measure_build(checkpoint: Path, output: Path, dtype: str) -> tuple[float, float]:
    """(seconds, peak RSS in bytes) of one `precast build` in a fresh child process."""
    cmd = [
        sys.executable,
        "-m",
        "precast",
        "build",
        "--checkpoint",
        str(checkpoint),
        "--output",
        str(output),
        "--dtype",
        dtype,
        "--force",
        "--quiet",
    ]
    # ru_maxrss of RUSAGE_CHILDREN is the largest of all waited-for children so far, so each
    # measurement runs under its own small wrapper process that reports its child's peak.
    wrapper = (
        "import resource, subprocess, sys, time; t = time.perf_counter(); "
        "subprocess.run(sys.argv[1:], check=True); "
        "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", wrapper, *cmd], check=True, capture_output=True, text=True).stdout
    seconds, maxrss_kib = out.split()[-2:]
    return float(seconds), int(maxrss_kib) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--keep", type=Path, help="keep the synthetic checkpoint here (and reuse it if present)")
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="precast-build-memory-"))
    ckpt = args.keep or scratch / "checkpoint"
    try:
        t = time.perf_counter()
        if not (ckpt / "config.json").exists():
            params = write_checkpoint(ckpt)
            print(f"made synthetic checkpoint: {params / 1e9:.2f}B parameters in {time.perf_counter() - t:.0f} s")
        else:
            params = sum(math.prod(s) for s in checkpoint_tensors(CONFIG).values())
        source_bytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
        largest = max(math.prod(s) for s in checkpoint_tensors(CONFIG).values())
        rows = []
        for dtype in args.dtype:
            itemsize = 4 if dtype == "float32" else 2
            runs = [measure_build(ckpt, scratch / f"engine-{dtype}", dtype) for _ in range(args.repeats)]
            engine_bytes = (scratch / f"engine-{dtype}" / "weights.safetensors").stat().st_size
            limit = 2e9 + largest * itemsize
            peak = statistics.median(r[1] for r in runs)
            secs = statistics.median(r[0] for r in runs)
            rows.append((dtype, params, source_bytes, engine_bytes, secs, peak, limit))
            shutil.rmtree(scratch / f"engine-{dtype}")
        print()
        print("| engine dtype | parameters | checkpoint | engine | build time | peak RSS | limit (2 GB + largest tensor) | peak / limit |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for dtype, p, src, eng, secs, peak, limit in rows:
            print(
                f"| {dtype} | {p / 1e9:.2f}B | {src / 1e9:.2f} GB | {eng / 1e9:.2f} GB | {secs:.1f} s "
                f"({eng / secs / 1e6:.0f} MB/s) | {peak / 1e9:.2f} GB | {limit / 1e9:.2f} GB | {peak / limit:.2f} |"
            )
        worst = max(r[5] / r[6] for r in rows)
        print(f"\n{'PASS' if worst < 1 else 'FAIL'}: peak RSS is {worst:.0%} of the bound at worst")
        if worst >= 1:
            sys.exit(1)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
