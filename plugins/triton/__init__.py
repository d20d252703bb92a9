"""precast's GPU kernels, written in Triton: the CPU kernels' twins (plugins/cpu) for the CUDA runner.

Each module is one kernel family with a small host wrapper that takes torch tensors:
  numerics.py    rounding onto E4M3 / E2M1 / bf16 grids and unpacking 4-bit weights (shared helpers)
  norm.py        RMSNorm, optionally adding the residual first
  rope_cache.py  q/k RMSNorm (qk-norm models), RoPE from cos/sin tables, K/V written into the paged pool
  attention.py   paged attention over block tables: prefill, chunked prefill and decode in one kernel
  activation.py  SiLU / GELU-tanh gated activation
  embedding.py   embedding gather from any stored format
  linear.py      GEMMs for every engine format and the run-time activation quantizers (fp8, nvfp4)

Importing this package imports torch and triton; the CPU runtime never does. Under TRITON_INTERPRET=1 the
kernels run on CPU tensors through Triton's interpreter (the tests' mode); `interpreting()` tells the host
wrappers which mode they are in, and kernels take it as a constexpr where the interpreter needs another path
(it mis-rounds float32 -> bf16 / fp8 conversions and computes tl.dot on bf16 operands wrongly).
"""

from precast.plugins.triton.activation import gated_activation
from precast.plugins.triton.attention import paged_attention
from precast.plugins.triton.embedding import embedding_gather
from precast.plugins.triton.linear import LinearWeight, linear, quantize_fp8_input, quantize_nvfp4_input
from precast.plugins.triton.norm import rms_norm
from precast.plugins.triton.numerics import interpreting
from precast.plugins.triton.rope_cache import rope_and_cache

__all__ = [
    "LinearWeight",
    "embedding_gather",
    "gated_activation",
    "interpreting",
    "linear",
    "paged_attention",
    "quantize_fp8_input",
    "quantize_nvfp4_input",
    "rms_norm",
    "rope_and_cache",
]
