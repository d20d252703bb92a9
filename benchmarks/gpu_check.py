"""The CUDA backend's device check (docs/gpu.md): correctness and speed on an NVIDIA GPU.

python benchmarks/gpu_check.py reference    here, once: a SmolLM2-shaped random-weight checkpoint (numpy,
                                            seeded), float32 and bf16 engines, the CPU runner's greedy tokens
                                            -> benchmarks/gpu_reference.json (committed)
python benchmarks/gpu_check.py device --out DIR [--work DIR]
                                            on the GPU (benchmarks/gpu_check.sh): the same checkpoint remade
                                            from the seed; greedy tokens of backend "cuda" against the
                                            reference; batch-1 and batch-64 decode timed with CUDA events
                                            against PyTorch eager (transformers, bf16, sdpa) on the same weights
                                            and against the bandwidth limit (weight bytes per step / measured
                                            copy bandwidth), at SmolLM2 shape and for 4 layers of Llama-3-8B
                                            shape made in GPU memory (bf16 and fp8); a table last
--small                                     both at a tiny shape: checks this script on the CPU under
                                            TRITON_INTERPRET=1 (by hand; about 5 minutes)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REFERENCE = HERE / "gpu_reference.json"
SEED = 20261206
SMOLLM2 = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152
)
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
CONTEXT = 512  # tokens cached per sequence when decode is timed
TOKENS_PER_BLOCK = 32
STEPS = 30


def llama_config(shape: dict[str, int]) -> dict[str, Any]:
    return dict(
        shape,
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,  # a tied head copies the last token here (random weights); SmolLM2 ties its head
        hidden_act="silu",
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
    )


def write_checkpoint(out: Path, shape: dict[str, int]) -> Path:
    """A Hugging Face Llama directory with numpy-seeded weights (the same on every machine and numpy >= 1.17):
    unit-variance embeddings, projections scaled by 1/sqrt(fan-in), a head scaled up so greedy choices have wide
    margins."""
    from safetensors.numpy import save_file

    config = llama_config(shape)
    rng = np.random.default_rng(SEED)
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    d = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def w(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.float32(np.sqrt(cols))).astype(np.float32)

    tensors = {"model.embed_tokens.weight": rng.standard_normal((config["vocab_size"], h), dtype=np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(q, h),
            p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.o_proj.weight": w(h, q),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
            p + "input_layernorm.weight": (1 + 0.1 * rng.standard_normal(h, dtype=np.float32)).astype(np.float32),
            p + "post_attention_layernorm.weight": (1 + 0.1 * rng.standard_normal(h, dtype=np.float32)).astype(np.float32),
        }
    tensors["model.norm.weight"] = np.ones(h, np.float32)
    tensors["lm_head.weight"] = w(config["vocab_size"], h) * np.float32(4.0)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


def build(checkpoint: Path, out: Path, dtype: str) -> Path:
    from precast.builder.build import BuildOptions, build_engine

    build_engine(BuildOptions(checkpoint, out, dtype=dtype, max_seq_len=1024, max_batch_size=64, progress=False, force=True))
    return out


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, vocab, n).tolist() for n in (5, 33, 120, 300)]


def greedy(engine: Path, backend: str, **options: Any) -> list[list[int]]:
    from precast.runtime import LLM, SamplingParams

    with LLM(engine, backend=backend, **options) as llm:
        vocab = llm.engine.config.model.vocab_size
        outs = llm.generate(prompts(vocab), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        return [o.token_ids for o in outs]


def make_reference(work: Path, shape: dict[str, int], out: Path) -> dict[str, Any]:
    ckpt = write_checkpoint(work / "ckpt", shape)
    record: dict[str, Any] = {"seed": SEED, "shape": shape, "tokens": {}}
    for dtype in ("float32", "bfloat16"):
        record["tokens"][dtype] = greedy(build(ckpt, work / f"engine-{dtype}", dtype), "cpu")
    out.write_text(json.dumps(record) + "\n")
    return record


# --- timing ---------------------------------------------------------------------------------------
class Clock:
    """CUDA events on a GPU, perf_counter otherwise (the --small check on CPU)."""

    def __init__(self, torch: Any, device: Any, steps: int = STEPS):
        self.torch, self.cuda, self.steps = torch, device.type == "cuda", steps

    def median_ms(self, fn: Any, warmup: int = 3) -> float:
        for _ in range(warmup if self.cuda else 1):
            fn()
        times = []
        for _ in range(self.steps):
            if self.cuda:
                start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def copy_bandwidth(torch: Any, device: Any) -> float:
    """Bytes per second a device-to-device copy moves (read + write), the limit decode is held to."""
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = Clock(torch, device, steps=10).median_ms(lambda: dst.copy_(src))
    return 2 * n / (ms / 1e3)


def sequence(i: int, context_len: int, num_tokens: int, token_offset: int, blocks_per_seq: int) -> SimpleNamespace:
    """Sequence i of an executor batch, owning blocks [i * blocks_per_seq, (i + 1) * blocks_per_seq)."""
    blocks = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
    return SimpleNamespace(
        request_id=i, context_len=context_len, num_tokens=num_tokens, token_offset=token_offset, sample=True,
        all_logits=False, block_table=blocks,
    )  # fmt: skip


def time_precast(runner: Any, batch_size: int, clock: Clock) -> float:
    """Decode tokens per second of the runner at this batch size (graphs on a GPU, where it takes them): each
    sequence's cache filled with CONTEXT tokens (one sequence per step), then steps of one new token each."""
    per_seq = -(-(CONTEXT + 1) // TOKENS_PER_BLOCK)
    runner.configure_kv(batch_size * per_seq, TOKENS_PER_BLOCK)
    for i in range(batch_size):
        prompt = SimpleNamespace(token_ids=[7] * CONTEXT, positions=list(range(CONTEXT)), sequences=[sequence(i, 0, CONTEXT, 0, per_seq)])
        runner.forward(prompt)
    seqs = [sequence(i, CONTEXT, 1, i, per_seq) for i in range(batch_size)]
    batch = SimpleNamespace(token_ids=[5] * batch_size, positions=[CONTEXT] * batch_size, sequences=seqs)
    return batch_size / (clock.median_ms(lambda: runner.forward(batch)) / 1e3)


def time_eager(model: Any, batch_size: int, clock: Clock, torch: Any, device: Any) -> float:
    """PyTorch eager (transformers, sdpa) decode tokens per second with a CONTEXT-token cache."""
    ids = torch.full((batch_size, CONTEXT), 7, dtype=torch.long, device=device)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        step = torch.full((batch_size, 1), 5, dtype=torch.long, device=device)

        def one() -> None:
            model(step, past_key_values=cache, use_cache=True)
            cache.crop(-1)  # the step's token dropped again: every step decodes at the same length

        return batch_size / (clock.median_ms(one) / 1e3)


def weight_bytes(weights: Any) -> int:
    """Bytes one decode step reads: every matrix but the embedding (one row each), unless it is the head (tied)."""
    tied = "lm_head" not in weights.linears
    return sum(w.nbytes for name, w in weights.linears.items() if name != "embed" or tied)


def llama8b_layers(torch: Any, device: Any, small: bool, fp8: bool) -> tuple[Any, Any]:
    """(transformers model, CudaRunner) for 4 layers of Llama-3-8B shape, random bf16 weights made in GPU memory;
    fp8: the runner's linear layers per-tensor E4M3 (the head stays bf16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from precast.engine.spec import ModelSpec
    from precast.plugins.triton import LinearWeight
    from precast.runtime.cuda.runner import CudaRunner
    from precast.runtime.cuda.weights import DeviceWeights

    shape = dict(SMALL if small else LLAMA3_8B, num_hidden_layers=4)
    config = LlamaConfig(**shape, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    h, heads, kvh = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    spec = ModelSpec(
        architecture="llama", vocab_size=shape["vocab_size"], hidden_size=h, intermediate_size=shape["intermediate_size"],
        num_layers=4, num_heads=heads, num_kv_heads=kvh, head_dim=h // heads, norm_eps=1e-5, activation="silu",
        rope_theta=500000.0, rope_scaling=None, max_position_embeddings=8192, qkv_bias=False, qk_norm=False,
        sliding_window=None, sliding_window_layers=(), tie_word_embeddings=False,
    )  # fmt: skip
    state = model.state_dict()
    weights = DeviceWeights()

    def linear(name: str, w: Any, quantize: bool) -> None:
        if quantize:
            scale = float(w.float().abs().max()) / 448.0
            values = (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            weights.linears[name] = LinearWeight("fp8", values, *w.shape, weight_scale=scale, input_quant="fp8", input_scale=0.05)
        else:
            weights.linears[name] = LinearWeight("dense", w.contiguous(), *w.shape)

    linear("embed", state["model.embed_tokens.weight"], False)
    linear("lm_head", state["lm_head.weight"], False)
    weights.vectors["final_norm.weight"] = state["model.norm.weight"].float()
    for i in range(4):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        a = p + "self_attn."
        linear(q + "attn.qkv", torch.cat([state[a + "q_proj.weight"], state[a + "k_proj.weight"], state[a + "v_proj.weight"]]), fp8)
        linear(q + "attn.o", state[a + "o_proj.weight"], fp8)
        linear(q + "mlp.gate_up", torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]), fp8)
        linear(q + "mlp.down", state[p + "mlp.down_proj.weight"], fp8)
        weights.vectors[q + "attn_norm.weight"] = state[p + "input_layernorm.weight"].float()
        weights.vectors[q + "mlp_norm.weight"] = state[p + "post_attention_layernorm.weight"].float()
    engine = SimpleNamespace(
        config=SimpleNamespace(
            model=spec, limits=SimpleNamespace(max_seq_len=1024, max_batch_size=64), dtype="bfloat16",
            quant=SimpleNamespace(kv_cache=None), embedding_scale=1.0,
        )
    )  # fmt: skip
    return model, CudaRunner(engine, device, "weights", cuda_graphs=device.type == "cuda", weights=weights)


def device_check(out: Path, work: Path, small: bool) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from precast.engine.directory import load_engine
    from precast.plugins.triton import interpreting
    from precast.runtime.cuda import make_cuda_runner

    device = torch.device("cpu" if interpreting() else "cuda")
    out.mkdir(parents=True, exist_ok=True)
    shape = SMALL if small else SMOLLM2
    reference = make_reference(work / "ref", shape, work / "reference.json") if small else json.loads(REFERENCE.read_text())
    ckpt = write_checkpoint(work / "ckpt", shape)
    lines, ok = [], True

    # 1. greedy tokens against the CPU runner's, computed where the reference was made
    for dtype, precision in (("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "weights")):
        engine = build(ckpt, work / f"engine-{dtype}", dtype)
        got = greedy(engine, "cuda", matmul_precision=precision)
        want = reference["tokens"][dtype]
        same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
        total = sum(len(w) for w in want)
        exact = got == want
        ok &= exact or precision == "weights"  # bf16 operands may pick other tokens; reported, not failed
        lines.append(f"greedy {dtype} engine, matmul {precision}: {'identical' if exact else 'DIFFERENT'} ({same}/{total} tokens equal)")

    # 2. decode speed against PyTorch eager and the bandwidth limit
    clock = Clock(torch, device, steps=2 if small else STEPS)
    bandwidth = copy_bandwidth(torch, device)
    rows = []
    engine = load_engine(work / "engine-bfloat16")  # built above
    eager = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).to(device).eval()
    for batch_size in (1, 64) if not small else (1, 4):
        runner = make_cuda_runner(engine, "weights")
        ours = time_precast(runner, batch_size, clock)
        theirs = time_eager(eager, batch_size, clock, torch, device)
        limit = bandwidth / weight_bytes(runner.weights) * batch_size
        rows.append(("SmolLM2 shape", "bf16", batch_size, ours, theirs, limit))
    del eager
    for fp8 in (False, True):
        for batch_size in (1, 64) if not small else (1, 4):
            model, runner = llama8b_layers(torch, device, small, fp8)
            ours = time_precast(runner, batch_size, clock)
            theirs = time_eager(model, batch_size, clock, torch, device)
            limit = bandwidth / weight_bytes(runner.weights) * batch_size
            rows.append(("Llama-3-8B shape, 4 layers", "fp8" if fp8 else "bf16", batch_size, ours, theirs, limit))
            del model, runner
            if device.type == "cuda":
                torch.cuda.empty_cache()

    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter; timings mean nothing)"
    table = [
        f"device: {name}; torch {torch.__version__}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; decode at {CONTEXT} cached tokens, median of {clock.steps}",
        "",
        "| model | weights | batch | precast tok/s | PyTorch eager bf16 tok/s | ratio | bandwidth limit tok/s | % of limit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model_name, fmt, b, ours, theirs, limit in rows:
        table.append(
            f"| {model_name} | {fmt} | {b} | {ours:,.0f} | {theirs:,.0f} | {ours / theirs:.2f}x | {limit:,.0f} | {100 * ours / limit:.0f}% |"
        )
    report = "\n".join(lines + [""] + table)
    (out / "gpu_check.md").write_text(report + "\n")
    print(report)
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["reference", "device"])
    parser.add_argument("--out", type=Path, default=Path("/tmp/precast-gpu-check"), help="the report (gpu_check.md)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/precast-gpu-work"), help="checkpoints and engines")
    parser.add_argument("--small", action="store_true", help="a tiny shape: check this script on the CPU (TRITON_INTERPRET=1)")
    args = parser.parse_args()
    if args.what == "reference":
        record = make_reference(
            args.work / "ref", SMALL if args.small else SMOLLM2, REFERENCE if not args.small else args.work / "reference.json"
        )
        print(f"reference tokens for {len(record['tokens']['float32'])} prompts written")
        return 0
    return device_check(args.out, args.work, args.small)


if __name__ == "__main__":
    sys.exit(main())
