"""A full-precision stand-in for a packaged model whose weights are already quantized (quality.py --dither).

The packaged GGUFs are quantized (SmolLM2: Q4_1, Qwen2.5-Coder: Q4_K_M). Dequantized and used as the reference, their
weights sit on one format's grid: requantizing to that format, or to one that can store its blocks (int4 groups of 32
with offsets), gives the reference back and scores near lossless by construction, so such a reference cannot rank
formats. `dither_gguf` writes an F16 GGUF of the same model in which every quantized weight tensor is dequantized and
each value moved by uniform noise of +-half its block's quantization step (the block's range over its format's number
of steps): the weights then lie anywhere within their step, as a full-precision checkpoint's lie relative to any grid,
and no format reproduces them. The result is a different model, about as far from the shipped one as one more round of
its own quantization, so its rows rank quantizers against each other on a common, grid-free reference; they are not
the shipped model's quality.

    python benchmarks/dithered_source.py --model qwen2.5-coder-1.5b-instruct OUT.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

# Per GGUF quantized type: (values sharing one step: its sub-block, steps across the sub-block's largest range).
# From the formats' definitions (ggml's block layouts); types not listed are copied as they are (F32, F16, BF16).
_GRIDS = {
    "Q4_0": (32, 15),
    "Q4_1": (32, 15),
    "Q5_0": (32, 31),
    "Q5_1": (32, 31),
    "Q8_0": (32, 254),
    "Q2_K": (16, 3),
    "Q3_K": (16, 7),
    "Q4_K": (32, 15),
    "Q5_K": (32, 31),
    "Q6_K": (16, 63),
}
_MOSTLY_F16 = 1  # general.file_type of an F16 file (llama_ftype)


def dither(values: np.ndarray, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """`values` (a dequantized tensor, rows along the last axis) plus uniform noise of +-half the step of each
    sub-block, estimated as the sub-block's range over `type_name`'s steps."""
    sub, steps = _GRIDS[type_name]
    blocks = values.reshape(-1, sub)
    step = (blocks.max(axis=1, keepdims=True) - blocks.min(axis=1, keepdims=True)) / steps
    noisy = blocks + (rng.random(blocks.shape, dtype=np.float32) - 0.5) * step
    return noisy.reshape(values.shape)


def dither_gguf(source: Path, target: Path, seed: int = 0) -> Path:
    """`source` rewritten as an F16 GGUF (norms and other F32 tensors kept) with its quantized tensors dithered;
    metadata copied. Streams one tensor at a time. Returns `target`."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(target, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind, sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    writer.add_file_type(_MOSTLY_F16)

    def converted(index: int, tensor) -> np.ndarray:
        name = tensor.tensor_type.name
        if name in ("F32", "F16", "BF16"):
            return np.asarray(tensor.data)  # written as its bytes
        if name not in _GRIDS:
            raise SystemExit(f"{source}: tensor {tensor.name} is {name}; dithered_source.py knows {', '.join(_GRIDS)}")
        values = dequantize(tensor.data, tensor.tensor_type)
        return dither(values, name, np.random.default_rng([seed, index])).astype(np.float16).reshape(shapes[index])

    shapes = []
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
        kept = tensor.tensor_type.name in ("F32", "F16", "BF16")
        dtype = tensor.tensor_type if kept else GGMLQuantizationType.F16
        itemsize = {"F32": 4, "F16": 2, "BF16": 2}[dtype.name]
        writer.add_tensor_info(tensor.name, shape, np.dtype(np.float16), int(np.prod(shape)) * itemsize, raw_dtype=dtype)
        shapes.append(shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, tensor in enumerate(reader.tensors):
        writer.write_tensor_data(converted(index, tensor))
    writer.close()
    return target


def main() -> None:
    from compare_cpu import MODELS, model_arg  # benchmarks/ is on sys.path

    from precast.packaged import packaged_model_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=model_arg, default=MODELS[0], help=f"a packaged model: {', '.join(MODELS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    print(dither_gguf(packaged_model_path(args.model), args.out, args.seed))


if __name__ == "__main__":
    main()
