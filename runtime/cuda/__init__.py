"""The CUDA backend: precast's Triton kernels (plugins/triton) behind the ModelRunner seam (runner.py).

Nothing here is imported by the CPU runtime; `make_cuda_runner` imports torch and triton when it is called.
"""

from precast.runtime.cuda.runner import make_cuda_runner

__all__ = ["make_cuda_runner"]
