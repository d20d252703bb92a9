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

__all__ = ["__version__"]
