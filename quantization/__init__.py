"""precast.quantization: weight formats and their conversion.

Only full-precision formats exist so far (float32, bfloat16, float16); the
quantized recipes (fp8, nvfp4, int4_awq) arrive with their own issue and plug in
through `dtypes.py` without changing the engine contract.
"""
