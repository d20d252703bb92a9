"""Quality of each quantization recipe on SmolLM2-135M-Instruct against the float32 engine.

Builds the float32 engine and one engine per recipe (full default calibration: precast's text,
16 x 256 tokens), then on the held-out text (quantization/data/heldout.txt, 512-token windows):
perplexity, its ratio to float32, mean per-token KL(float32 || recipe), top-1 agreement; plus
engine size and the calibration's time and peak memory (as the build recorded them).

    python benchmarks/quality.py [--recipes fp8 nvfp4 int4_awq] [--kv-fp8] [--weights-only] [--windows N]

--weights-only adds, for fp8 and nvfp4, the same engine run with activation quantization switched off: what the
weights alone cost (a diagnostic; the recipes always quantize activations).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# Each build runs in its own process, so its peak memory is its own.
_BUILD = """
import json, sys
from pathlib import Path
from precast.builder.build import BuildOptions, build_engine
from precast.quantization.calibration import peak_rss_mb
from precast.quantization.recipe import QuantOptions
gguf, out, recipe, kv = sys.argv[1:5]
r = build_engine(BuildOptions(Path(gguf), Path(out), max_seq_len=2048, progress=False,
                              quant=QuantOptions(recipe=recipe, kv_cache_dtype=kv)))
print(json.dumps({"seconds": r.seconds, "peak_rss_mb": peak_rss_mb(),
                  "calibration": r.config.quant.calibration or {}}))
"""


def build(gguf: Path, out: Path, recipe: str, kv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _BUILD, str(gguf), str(out), recipe, kv], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["fp8", "nvfp4", "int4_awq"])
    parser.add_argument("--kv-fp8", action="store_true", help="also each recipe with an fp8 KV cache, and fp32 weights with one")
    parser.add_argument("--weights-only", action="store_true", help="also fp8 / nvfp4 with activation quantization off")
    parser.add_argument("--windows", type=int, default=None, help="held-out windows (default: all)")
    args = parser.parse_args()

    from precast.builder.build import BuildOptions, build_engine
    from precast.engine.directory import load_engine
    from precast.packaged import packaged_model_path
    from precast.quantization.quality import compare, heldout_windows

    gguf = packaged_model_path("smollm2-135m-instruct")
    variants = [(r, "auto") for r in args.recipes]
    if args.kv_fp8:
        variants += [("none", "fp8")] + [(r, "fp8") for r in args.recipes]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        reference = Path(tmp) / "float32"
        build_engine(BuildOptions(gguf, reference, max_seq_len=2048, progress=False))
        windows = heldout_windows(load_engine(reference), 512, args.windows)
        ref_size = (reference / "weights.safetensors").stat().st_size
        for recipe, kv in variants:
            out = Path(tmp) / f"{recipe}-{kv}"
            built = build(gguf, out, recipe, kv)
            ours, ref = compare(out, reference, windows)
            size = (out / "weights.safetensors").stat().st_size
            rows.append(
                (
                    recipe,
                    kv,
                    f"{ours.perplexity:.3f}",
                    f"{ours.perplexity / ref.perplexity:.4f}",
                    f"{ours.mean_kl:.4f}",
                    f"{ours.top1_agreement:.3f}",
                    f"{size / 2**20:.1f}",
                    f"{built['seconds']:.1f}",
                    f"{built['calibration'].get('seconds', 0):.1f}",
                    f"{built['peak_rss_mb']}",
                )
            )
            if args.weights_only and recipe in ("fp8", "nvfp4") and kv == "auto":
                w, _ = compare(out, reference, windows, quantize_activations=False)
                rows.append(
                    (
                        f"{recipe} weights only (diagnostic)",
                        kv,
                        f"{w.perplexity:.3f}",
                        f"{w.perplexity / ref.perplexity:.4f}",
                        f"{w.mean_kl:.4f}",
                        f"{w.top1_agreement:.3f}",
                        "",
                        "",
                        "",
                        "",
                    )
                )
        print(
            f"\nSmolLM2-135M-Instruct, held-out text {windows and len(windows)} x 512 tokens "
            f"({sum(len(w) - 1 for w in windows)} predictions); float32 perplexity {ref.perplexity:.3f}, "
            f"{ref_size / 2**20:.1f} MiB\n"
        )
        print(
            "| recipe | KV cache | perplexity | vs float32 | mean KL (nats) | top-1 agreement | weights MiB | build s | calibration s | build peak RSS MB |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
