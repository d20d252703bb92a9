"""precast against HF transformers on SmolLM2-135M-Instruct, same dtype, same threads, one run.

Measures, for each dtype (float32, bfloat16) and each quantization recipe asked for:
  decode   batch-1 decode tokens/s (128 tokens after a short chat prompt, prefill excluded)
  prefill  tokens/s on a 512-token prompt (one forward pass producing the first token)
  32-way   output tokens/s with 32 concurrent requests of 128 prompt / 128 output tokens
           (HF: one padded batch through `generate`)
Each number is the median of --repeats runs; the spread (min..max) is printed beside it.

    python benchmarks/generate_cpu.py [--dtypes float32 bfloat16] [--quant fp8 nvfp4 int4_awq] [--quant-dtype bfloat16]
                                      [--quantize-lm-head] [--repeats 3] [--threads N] [--skip-hf-batch]

Quantized engines (--quant) are precast only; their rows also give the engine's size.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import compare_cpu  # the measuring loops, shared (benchmarks/ is on sys.path when a script here runs)
from compare_cpu import BATCH, BATCH_IN, BATCH_OUT, PREFILL_TOKENS


def median_spread(values: list[float]) -> tuple[float, str]:
    return statistics.median(values), f"{min(values):.1f}..{max(values):.1f}"


def bench_precast(engine: Path, threads: int, repeats: int, prompt_ids: list[int]) -> dict[str, list[float]]:
    r = compare_cpu.bench_precast(engine.name, engine, threads, repeats, prompt_ids)
    return {"decode": r.decode, "prefill": r.prefill, "batch": r.batch}


def bench_hf(model, threads: int, repeats: int, prompt_ids: list[int], batch: bool) -> dict[str, list[float]]:
    r = compare_cpu.bench_hf("hf", model, threads, repeats, prompt_ids, 0, batch)
    return {"decode": r.decode, "prefill": r.prefill, "batch": r.batch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument(
        "--quant",
        nargs="*",
        default=[],
        choices=["fp8", "nvfp4", "int4_awq"],
        help="also quantized engines (precast only: HF has no such formats on CPU)",
    )
    parser.add_argument(
        "--quant-dtype",
        default="bfloat16",
        choices=["float32", "bfloat16"],
        help="dtype of what a recipe leaves unquantized (embeddings, LM head, norms); default bfloat16",
    )
    parser.add_argument("--quantize-lm-head", action="store_true", help="quantize the (tied) LM head too")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="default: all cores this process may use")
    parser.add_argument("--skip-hf-batch", action="store_true", help="skip HF's 32-way batch (slow)")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from precast.builder.build import BuildOptions, build_engine
    from precast.engine.directory import load_engine
    from precast.packaged import packaged_model_path
    from precast.quantization.recipe import QuantOptions
    from precast.runtime.cpu_backend import default_num_threads
    from precast.runtime.tokenizer import Tokenizer

    threads = args.threads or default_num_threads()
    from precast import _C

    bandwidth = _C.memory_bandwidth("copy", 256 << 20, threads, 5)  # read + write counted, all threads
    gguf = packaged_model_path("smollm2-135m-instruct")
    hf_fp32 = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    variants = [(d, "none") for d in args.dtypes] + [(args.quant_dtype, q) for q in args.quant]
    rows = []
    hf_decode: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype, recipe in variants:
            engine = Path(tmp) / f"{dtype}-{recipe}"
            quant = QuantOptions(recipe=recipe, quantize_lm_head=args.quantize_lm_head and recipe != "none")
            build_engine(BuildOptions(gguf, engine, dtype=dtype, max_seq_len=2048, progress=False, quant=quant))
            tok = Tokenizer(load_engine(engine))
            prompt = tok.encode(
                tok.apply_chat_template([{"role": "user", "content": "Tell me a long story about a dragon."}]), add_special_tokens=False
            )
            ours = bench_precast(engine, threads, args.repeats, prompt)
            theirs: dict[str, list[float]] = {"decode": [], "prefill": [], "batch": []}
            if recipe == "none":
                hf_model = hf_fp32 if dtype == "float32" else hf_fp32.to(torch.bfloat16)
                theirs = bench_hf(hf_model, threads, args.repeats, prompt, not args.skip_hf_batch)
                hf_decode[dtype] = statistics.median(theirs["decode"])
            weight_bytes = (engine / "weights.safetensors").stat().st_size
            limit = bandwidth / weight_bytes  # tokens/s if every step streamed all weights at copy speed
            name = dtype if recipe == "none" else f"{recipe} (rest {dtype}{', head quantized' if quant.quantize_lm_head else ''})"
            for key, label in (
                ("decode", "batch-1 decode tok/s"),
                ("prefill", f"prefill tok/s ({PREFILL_TOKENS} tokens)"),
                ("batch", f"{BATCH}-way output tok/s ({BATCH_IN} in / {BATCH_OUT} out)"),
            ):
                p, p_spread = median_spread(ours[key])
                if theirs[key]:
                    h, h_spread = median_spread(theirs[key])
                    hf_cell, ratio = f"{h:.1f} ({h_spread})", f"{p / h:.2f}x"
                else:
                    hf_cell, ratio = "-", "-"
                extra = ""
                if key == "batch" and hf_decode:
                    base = hf_decode.get(dtype) or max(hf_decode.values())
                    extra = f"{p / base:.1f}x HF {dtype if dtype in hf_decode else 'best'} batch-1"
                if key == "decode":
                    extra = f"{weight_bytes / 2**20:.0f} MiB of weights; bandwidth limit {limit:.0f} tok/s: precast at {p / limit:.0%}"
                rows.append((name, label, f"{p:.1f} ({p_spread})", hf_cell, ratio, extra))
    print(
        f"\nSmolLM2-135M-Instruct, {threads} threads, median of {args.repeats} (min..max); "
        f"memory copy bandwidth {bandwidth / 1e9:.1f} GB/s\n"
    )
    print("| engine | measure | precast | HF transformers (same dtype) | precast / HF | note |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
