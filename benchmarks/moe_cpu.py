"""Batch-1 decode of a mixture of experts against a dense model with the same active parameters: is only what a token
is routed to streamed?

Two synthetic checkpoints (random bf16 weights, made at run time) with Qwen3-30B-A3B's layer shapes: hidden 2048,
32 query / 4 KV heads of 128, qk-norm; the mixture has 128 experts of 768, top 8 renormalised, in every layer; the
dense model has one MLP of 8 x 768 = 6144 in every layer, so a token of either touches the same number of
parameters. --layers of them (default 4: a mixture layer holds 604M parameters, 1.2 GB in bf16), a 2,000-token
vocabulary for both (so the LM head does not dominate either). Both are built with `precast build --dtype bfloat16`
and decode 64 tokens after a 16-token prompt on --threads threads, alternating model per repeat (the host is noisy);
medians and spreads are printed, the ratio last, with each model's active bytes per token against the read
bandwidth measured just before each run.

    python benchmarks/moe_cpu.py [--layers 4] [--repeats 5] [--threads 2] [--keep DIR]

Reading every expert per token would make the mixture 16x slower than the dense model; reading only the routed
ones makes them about equal (within 1.3x is the target).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from build_memory import write_tokenizer  # benchmarks/ is on sys.path when a script here runs
from compare_cpu import cpu_name, read_bandwidth_now

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 32, 4, 128, 2000
EXPERTS, TOP_K, EXPERT_SIZE = 128, 8, 768
PROMPT, DECODE = 16, 64
COMMON = {
    "hidden_size": HIDDEN,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def configs(layers: int) -> dict[str, dict]:
    moe = {
        **COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_hidden_layers": layers,
        "intermediate_size": TOP_K * EXPERT_SIZE,
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "moe_intermediate_size": EXPERT_SIZE,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    dense = {
        **COMMON,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "num_hidden_layers": layers,
        "intermediate_size": TOP_K * EXPERT_SIZE,
    }
    return {"moe": moe, "dense": dense}


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, q, kv = HIDDEN, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {"model.embed_tokens.weight": (VOCAB, h), "model.norm.weight": (h,), "lm_head.weight": (VOCAB, h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (HEAD_DIM,),
            p + "self_attn.k_norm.weight": (HEAD_DIM,),
        }
        if c["model_type"] == "qwen3_moe":
            shapes[p + "mlp.gate.weight"] = (EXPERTS, h)
            for e in range(EXPERTS):
                x = f"{p}mlp.experts.{e}."
                shapes |= {
                    x + "gate_proj.weight": (EXPERT_SIZE, h),
                    x + "up_proj.weight": (EXPERT_SIZE, h),
                    x + "down_proj.weight": (h, EXPERT_SIZE),
                }
        else:
            inter = c["intermediate_size"]
            shapes |= {p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h), p + "mlp.down_proj.weight": (h, inter)}
    return shapes


def write_checkpoint(root: Path, config: dict) -> int:
    """One safetensors file per layer (random bf16, norms 1); returns the parameter count."""
    from precast.engine.safetensors_file import SafetensorsWriter

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(root)
    shapes = tensor_shapes(config)
    groups: dict[str, list[str]] = {}
    for name in shapes:
        key = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        groups.setdefault(key, []).append(name)
    rng = np.random.default_rng(0)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    weight_map = {}
    for key, names in groups.items():
        file = f"model-{key}.safetensors"
        with open(root / file, "wb") as f:
            w = SafetensorsWriter(f, [(n, bf16, shapes[n]) for n in names], {"format": "pt"})
            for n in names:
                if len(shapes[n]) == 1:
                    w.write(n, np.ones(shapes[n], dtype=bf16))
                else:
                    w.write(n, (rng.standard_normal(shapes[n], dtype=np.float32) * 0.02).astype(bf16))
                weight_map[n] = file
            w.finish()
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sum(math.prod(s) for s in shapes.values())


def decode_rate(llm, prompt: list[int]) -> float:
    from precast.runtime import SamplingParams

    first = None
    for _ in llm.stream(prompt, SamplingParams(max_tokens=DECODE + 1, temperature=0, ignore_eos=True)):
        if first is None:
            first = time.perf_counter()
    return DECODE / (time.perf_counter() - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="build here and keep the checkpoints and engines")
    args = parser.parse_args()

    from precast.builder.build import BuildOptions, build_engine
    from precast.engine.directory import load_engine
    from precast.runtime import LLM

    root = args.keep or Path(tempfile.mkdtemp(prefix="precast-moe-"))
    engines, totals, active_bytes = {}, {}, {}
    try:
        for name, config in configs(args.layers).items():
            ckpt, engine = root / f"{name}-hf", root / f"{name}-engine"
            if not (engine / "config.json").exists():
                t0 = time.perf_counter()
                write_checkpoint(ckpt, config)
                build_engine(BuildOptions(ckpt, engine, dtype="bfloat16", max_seq_len=256, max_batch_size=4, progress=False))
                shutil.rmtree(ckpt)
                print(f"{name}: checkpoint + build {time.perf_counter() - t0:.0f} s", flush=True)
            spec = load_engine(engine).config.model
            engines[name] = engine
            totals[name] = spec.num_parameters()
            active_bytes[name] = 2 * (spec.num_parameters(active=True) - spec.vocab_size * spec.hidden_size)  # no gather
        prompt = np.random.default_rng(1).integers(0, VOCAB, PROMPT).tolist()
        rates: dict[str, list[float]] = {n: [] for n in engines}
        shares: dict[str, list[float]] = {n: [] for n in engines}
        llms = {n: LLM(e, num_threads=args.threads, prefix_reuse=False, kv_cache_memory=256 << 20) for n, e in engines.items()}
        try:
            for llm in llms.values():
                decode_rate(llm, prompt)  # warm-up: pages in every weight the first tokens touch
            for _ in range(args.repeats):
                for name, llm in llms.items():
                    bandwidth = read_bandwidth_now(args.threads)
                    rate = decode_rate(llm, prompt)
                    rates[name].append(rate)
                    shares[name].append(rate * active_bytes[name] / bandwidth)
        finally:
            for llm in llms.values():
                llm.shutdown()
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)

    print(f"\nCPU: {cpu_name()}, {args.threads} threads; {args.layers} layers of Qwen3-30B-A3B's shapes, bf16, vocabulary {VOCAB}")
    print(f"batch-1 decode, {DECODE} tokens after {PROMPT}; median (min..max) of {args.repeats}, models alternating\n")
    print(f"{'model':<8} {'params':>9} {'active/token':>13} {'decode tok/s':>20} {'active bytes / read bw':>23}")
    for name in engines:
        r = rates[name]
        print(
            f"{name:<8} {totals[name] / 1e9:8.2f}B {active_bytes[name] / 2 / 1e6:11.0f}M "
            f"{statistics.median(r):8.1f} ({min(r):.1f}..{max(r):.1f}) {statistics.median(shares[name]):22.0%}"
        )
    ratio = statistics.median(rates["dense"]) / statistics.median(rates["moe"])
    print(f"\ndense / mixture decode speed: {ratio:.2f}x (target <= 1.3x: only routed experts streamed)")


if __name__ == "__main__":
    main()
