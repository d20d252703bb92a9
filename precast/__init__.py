"""precast: ahead-of-time LLM engine builder and runtime.

The import package is assembled from the repository's top-level folders (see
pyproject.toml): `precast.builder`, `precast.quantization`, `precast.runtime`,
and the compiled `precast._C`.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("precast")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):  # `precast.LLM` without importing the runtime on `import precast`
    if name in ("LLM", "SamplingParams", "RequestOutput"):
        from precast import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'precast' has no attribute {name!r}")
