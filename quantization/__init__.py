"""precast.quantization: quantized weight formats, recipes, calibration and AWQ.

formats.py      the numerics (fp8, nvfp4, int4 groups), bit-exact with ml_dtypes
recipe.py       what `--quant` asks for, which layers get which format, the engine's `quant` section
calibration.py  activation statistics from a full-precision engine run by precast's own CPU runner
awq.py          activation-aware scaling for int4_awq
quantize.py     a full-precision engine -> a quantized one (used by `precast build --quant`)
"""
