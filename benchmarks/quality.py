"""Quality of each quantization recipe against the float32 engine, beside llama.cpp's formats at equal bits.

Builds the float32 engine of a packaged model (SmolLM2-135M-Instruct by default; --model picks another) and one
engine per recipe (full default calibration: precast's text, 16 x 256 tokens), then on the held-out text
(quantization/data/heldout.txt, 512-token windows): perplexity, its ratio to float32, mean per-token
KL(float32 || recipe), top-1 agreement; plus engine size and the build's time and peak memory.

llama.cpp (--llamacpp, llama-cpp-python from the `bench` extra) reads the same token ids: its Q8_0 / Q4_K_M / Q4_0
files are made from the same packaged GGUF by its own quantizer (allow_requantize), and their logits at every
position are scored against the same float32 log-probabilities. The packaged GGUF is itself quantized (SmolLM2:
Q4_1, Qwen2.5-Coder: Q4_K_M), and the float32 reference is that file dequantized: a format equal to the shipped one
holds the reference's own weights (what it loses is llama.cpp's arithmetic) and says nothing about the format's
quality (the table marks it). The same holds for precast's asymmetric int4 with groups of 32 (int4_awq:g32): it can
store Q4_1's and Q4_K's 32-value blocks exactly (a float32 scale and offset per block), so on these references it
can come out near lossless by construction.

--dither scores every engine against a grid-free stand-in of the model instead (benchmarks/dithered_source.py: the
packaged weights dequantized and moved by uniform noise of +-half a quantization step, written as F16), from which
precast and llama.cpp both quantize: the way to rank formats against each other here, since no full-precision
checkpoint is packaged. Its rows are that stand-in's losses, not the shipped model's.

--chat adds KL and top-1 agreement on chat transcripts: the float32 engine's greedy answers to 24 prompts
(precast.quantization.quality.CHAT_PROMPTS) in its chat template, teacher-forced through each engine.

    python benchmarks/quality.py [--model qwen2.5-coder-1.5b-instruct] [--recipes fp8 nvfp4 int4_awq]
        [--quantize-lm-head] [--llamacpp [Q8_0 Q4_K_M Q4_0]] [--kv-fp8] [--weights-only] [--windows N] [--chat] [--dither]

--weights-only adds, for fp8 and nvfp4, the same engine run with activation quantization switched off: what the
weights alone cost (a diagnostic; the recipes always quantize activations).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from compare_cpu import FTYPES, MODELS, LlamaCpp, cpu_name, llamacpp_quantize, model_arg, shipped_type  # benchmarks/ is on sys.path
from dithered_source import dither_gguf

# Each build runs in its own process, so its peak memory is its own.
_BUILD = """
import json, sys
from pathlib import Path
from precast.builder.build import BuildOptions, build_engine
from precast.quantization.calibration import peak_rss_mb
from precast.quantization.recipe import QuantOptions
gguf, out, recipe, kv, head, variant, dtype = sys.argv[1:8]
r = build_engine(BuildOptions(Path(gguf), Path(out), max_seq_len=2048, progress=False, dtype=dtype or None,
                              quant=QuantOptions(recipe=recipe, kv_cache_dtype=kv, quantize_lm_head=head == "1",
                                                 **json.loads(variant))))
print(json.dumps({"seconds": r.seconds, "peak_rss_mb": peak_rss_mb(),
                  "calibration": r.config.quant.calibration or {}}))
"""


def recipe_variant(spec: str) -> tuple[str, dict]:
    """'fp8' -> ('fp8', {}); 'fp8:dynamic' -> ('fp8', QuantOptions fields); an unknown variant ends the script."""
    from precast.errors import PrecastError
    from precast.quantization.recipe import parse_recipe_variant

    try:
        return parse_recipe_variant(spec)
    except PrecastError as e:
        raise SystemExit(str(e)) from e


def build(gguf: Path, out: Path, spec: str, kv: str, quantize_lm_head: bool, dtype: str | None) -> dict:
    recipe, variant = recipe_variant(spec)
    cmd = [
        sys.executable,
        "-c",
        _BUILD,
        str(gguf),
        str(out),
        recipe,
        kv,
        "1" if quantize_lm_head else "0",
        json.dumps(variant),
        dtype or "",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"building {recipe} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llamacpp_rows(gguf: Path, formats: list[str], windows, reference, chat, tmp: Path, threads: int) -> list[tuple]:
    """llama.cpp's formats made from the packaged GGUF, scored on the same windows against the same reference (and on
    the chat transcripts: `chat` is (windows, reference log-probs) or None)."""
    from precast.quantization.quality import score

    shipped = shipped_type(gguf)
    rows = []
    for label in formats:
        t0 = time.perf_counter()
        path = gguf if label == shipped else llamacpp_quantize(gguf, tmp / f"{label}.gguf", label)
        seconds = time.perf_counter() - t0
        name = f"llama.cpp {label} (shipped: the reference's own format)" if label == shipped else f"llama.cpp {label}"
        ll = LlamaCpp(path, threads)  # its context holds a 512-token window, logits at every position
        try:
            q = score(ll.logits, windows, reference)
            chat_q = score(ll.logits, *chat) if chat else None
        finally:
            ll.close()
        size = f"{path.stat().st_size / 2**20:.1f}"
        rows.append((name, "f16", q, chat_q, size, f"{seconds:.1f}", "", ""))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=model_arg, default=MODELS[0], help=f"a packaged model or a prefix of one: {', '.join(MODELS)}")
    parser.add_argument(
        "--recipes",
        nargs="*",
        default=["fp8", "nvfp4", "int4_awq"],
        help="recipes, or variants (RECIPE:VARIANT, precast.quantization.recipe.RECIPE_VARIANTS)",
    )
    parser.add_argument("--quantize-lm-head", action="store_true", help="quantize the LM head too (as llama.cpp's files do)")
    parser.add_argument(
        "--llamacpp", nargs="*", choices=list(FTYPES), default=None, help="llama.cpp formats to score beside (no value: Q8_0 Q4_K_M Q4_0)"
    )
    parser.add_argument("--kv-fp8", action="store_true", help="also each recipe with an fp8 KV cache, and fp32 weights with one")
    parser.add_argument("--weights-only", action="store_true", help="also fp8 / nvfp4 with activation quantization off")
    parser.add_argument("--windows", type=int, default=None, help="held-out windows (default: all)")
    parser.add_argument(
        "--chat", action="store_true", help="also KL and top-1 on the float32 engine's own greedy chat answers to 24 prompts"
    )
    parser.add_argument(
        "--dither", action="store_true", help="quantize from and score against a grid-free F16 stand-in (dithered_source.py)"
    )
    parser.add_argument("--threads", type=int, default=None, help="default: all cores this process may use")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="the recipes' engines' base dtype (default: the build's, float32 for GGUF); bfloat16 engines multiply on "
        "the CPU's dot-product unit (int4 on int8 dots on AVX512-BF16 hosts), so their rows measure that arithmetic too",
    )
    args = parser.parse_args()

    from precast import _C
    from precast.builder.build import BuildOptions, build_engine
    from precast.engine.directory import load_engine
    from precast.packaged import packaged_model_path
    from precast.quantization.quality import chat_windows, compare, heldout_windows, reference_log_probs, reference_quality
    from precast.runtime.cpu_backend import default_num_threads

    threads = args.threads or default_num_threads()
    if args.llamacpp is not None:  # before minutes of builds
        try:
            import llama_cpp  # noqa: F401
        except ImportError as e:
            raise SystemExit(f"--llamacpp needs llama-cpp-python ({e}): pip install -e '.[bench]' (builds from source, minutes)") from e
    for spec in args.recipes:  # before minutes of builds
        recipe_variant(spec)
    packaged = packaged_model_path(args.model)
    variants = [(r, "auto") for r in args.recipes]
    if args.kv_fp8:
        variants += [("none", "fp8")] + [(r, "fp8") for r in args.recipes]
    rows = []  # (name, KV cache, Quality, chat Quality or None, weights MiB, build s, calibration s, peak RSS MB)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = dither_gguf(packaged, Path(tmp) / "dithered.gguf") if args.dither else packaged
        reference = Path(tmp) / "float32"
        build_engine(BuildOptions(gguf, reference, max_seq_len=2048, progress=False))
        windows = heldout_windows(load_engine(reference), 512, args.windows)
        ref_size = (reference / "weights.safetensors").stat().st_size
        ref_lps = reference_log_probs(reference, windows, threads)
        ref = reference_quality(windows, ref_lps)
        chat = None
        if args.chat:
            transcripts = chat_windows(reference)
            chat = (transcripts, reference_log_probs(reference, transcripts, threads))
        for recipe, kv in variants:
            out = Path(tmp) / f"{recipe.replace(':', '-')}-{kv}"
            built = build(gguf, out, recipe, kv, args.quantize_lm_head, args.dtype)
            ours, _ = compare(out, reference, windows, threads, reference=ref_lps)
            ours_chat = compare(out, reference, chat[0], threads, reference=chat[1])[0] if chat else None
            size = f"{(out / 'weights.safetensors').stat().st_size / 2**20:.1f}"
            name = f"{recipe} (head too)" if args.quantize_lm_head and recipe != "none" else recipe
            if args.dtype:
                name += f", {args.dtype} engine"
            calibration = f"{built['calibration'].get('seconds', 0):.1f}"
            rows.append((name, kv, ours, ours_chat, size, f"{built['seconds']:.1f}", calibration, f"{built['peak_rss_mb']}"))
            if args.weights_only and recipe_variant(recipe)[0] in ("fp8", "nvfp4") and kv == "auto":
                w, _ = compare(out, reference, windows, threads, quantize_activations=False, reference=ref_lps)
                rows.append((f"{name} weights only (diagnostic)", kv, w, None, "", "", "", ""))
            shutil.rmtree(out)  # a 1.5B model's engines add up
        if args.llamacpp is not None:
            rows += llamacpp_rows(gguf, args.llamacpp or ["Q8_0", "Q4_K_M", "Q4_0"], windows, ref_lps, chat, Path(tmp), threads)

    source = ", dequantized and dithered to F16 (dithered_source.py): the reference and every row's source" if args.dither else ""
    print(
        f"\n{args.model} (packaged GGUF: {shipped_type(packaged)}{source}), {cpu_name()}, dot unit {_C.dot_unit()}, {threads} threads; held-out text "
        f"{len(windows)} x 512 tokens ({ref.tokens} predictions); float32 perplexity {ref.perplexity:.3f}, "
        f"{ref_size / 2**20:.1f} MiB\n"
    )
    if chat:
        print(f"chat: the float32 engine's greedy answers to {len(chat[0])} prompts, {sum(len(w) - 1 for w in chat[0])} predictions\n")
    chat_head = " chat KL | chat top-1 |" if chat else ""
    print(
        "| recipe | KV cache | perplexity | vs float32 | mean KL (nats) | top-1 agreement |"
        + chat_head
        + " weights MiB | build s | calibration s | build peak RSS MB |"
    )
    print("| --- " * (10 + 2 * bool(chat)) + "|")
    for name, kv, q, chat_q, *rest in rows:
        cells = [name, kv, f"{q.perplexity:.3f}", f"{q.perplexity / ref.perplexity:.4f}", f"{q.mean_kl:.4f}", f"{q.top1_agreement:.3f}"]
        if chat:
            cells += [f"{chat_q.mean_kl:.4f}", f"{chat_q.top1_agreement:.3f}"] if chat_q else ["", ""]
        print("| " + " | ".join(cells + list(rest)) + " |")


if __name__ == "__main__":
    main()
