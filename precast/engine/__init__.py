"""precast.engine: the engine contract that every other part reads (docs/engine-format.md).

spec.py             ModelSpec: the backend-neutral description of a decoder
rope.py             the spec's RoPE fields -> inverse frequencies + attention factor
limits.py           build limits (batch, sequence, step, block size, KV dtype) and their defaults
tensors.py          the canonical tensor table: names, shapes, the linear layers
formats.py          the numerics of the quantized formats (fp8, nvfp4, int4), bit-exact with ml_dtypes
quant.py            the typed `quant` section; one class per stored format, found through FORMATS
safetensors_file.py reading and streaming-writing weights.safetensors
directory.py        the engine directory: EngineConfig, load_engine, atomic writes

It imports nothing else of precast but precast.errors and precast._C: builder, quantization and
runtime all sit above it (tests/test_layering.py).
"""

from precast.engine.directory import Engine, EngineConfig, load_engine
from precast.engine.limits import BuildLimits
from precast.engine.quant import QuantSection
from precast.engine.spec import ModelSpec, RopeScaling

__all__ = ["BuildLimits", "Engine", "EngineConfig", "ModelSpec", "QuantSection", "RopeScaling", "load_engine"]
