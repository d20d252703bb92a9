"""Dependencies run one way: every precast module imports only its own layer or the layers below.

    precast.cli                          the command line (may import anything)
    precast.builder                      checkpoints -> engines; the TensorRT plan build
    precast.quantization                 recipes, calibration, AWQ, quality
    precast.runtime.replicas             replicas behind Ray Serve; the Dynamo worker
    precast.runtime.{server,triton,bench}   the servers and the load generator
    precast.runtime                      LLM, backends (CPU, CUDA), tokenizer, the TensorRT network and runner
    precast.engine                       the engine contract every layer reads
    precast.plugins                      the GPU kernels (plugins/triton): torch and triton, nothing of precast
    precast, precast.errors, precast.packaged, precast._C

The test reads the source (ast), so an import hidden inside a function counts like any other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source folder -> import package (pyproject's [tool.scikit-build.wheel.packages]).
PACKAGES = {
    "precast": "precast",
    "builder": "precast.builder",
    "quantization": "precast.quantization",
    "runtime": "precast.runtime",
    "plugins/triton": "precast.plugins.triton",
}
# Highest first; a module belongs to the longest prefix that names it.
LAYERS = [
    ("precast.cli", "precast.__main__"),
    ("precast.builder",),
    ("precast.quantization",),
    ("precast.runtime.replicas",),
    ("precast.runtime.server", "precast.runtime.triton", "precast.runtime.bench"),
    ("precast.runtime",),
    ("precast.engine",),
    ("precast.plugins",),
    ("precast", "precast.errors", "precast.packaged", "precast.units", "precast._C"),
]
# `import precast` stays light: the root re-exports LLM / SamplingParams lazily (PEP 562 __getattr__).
ALLOWED = {("precast", "precast.runtime")}


def layer_of(module: str) -> int:
    best, rank = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    assert rank >= 0, f"{module} is in no layer; add it to LAYERS"
    return rank


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def precast_imports(module: str, path: Path) -> list[tuple[str, int]]:
    out = []
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(anchor[: len(anchor) - node.level + 1] + ([node.module] if node.module else []))
            # `from precast.engine import formats` imports precast.engine.formats
            out += [(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base, node.lineno) for alias in node.names]
    return [(name, line) for name, line in out if name == "precast" or name.startswith("precast.")]


MODULES = modules()


def test_every_module_is_in_a_layer():
    for module in MODULES:
        layer_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_downward(module):
    here = layer_of(module)
    upward = [
        f"{MODULES[module].relative_to(ROOT)}:{line} imports {name}"
        for name, line in precast_imports(module, MODULES[module])
        if layer_of(name) < here and (module, name) not in ALLOWED
    ]
    assert not upward, "imports against the layering (tests/test_layering.py):\n" + "\n".join(upward)


def test_the_checker_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from precast.builder.build import build_engine\n")
    assert precast_imports("precast.engine.bad", bad) == [("precast.builder.build", 2)]
    assert layer_of("precast.builder.build") < layer_of("precast.engine.bad")


def test_serving_path_imports_no_heavy_optional_package():
    """`precast serve` / `precast run` load without Ray (the serve extra), Dynamo, torch, transformers or triton."""
    import subprocess
    import sys

    code = (
        "import sys, precast.cli, precast.runtime.server.serve, precast.runtime.llm; "
        "print([m for m in ('ray', 'dynamo', 'torch', 'transformers', 'triton') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
