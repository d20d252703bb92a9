"""`precast triton`: start the `tritonserver` binary shipped in the nvidia-pytriton wheel.

The wheel is installed with `--no-deps` (its own Python package pins numpy<2 and is never
imported); only its files are used: bin/tritonserver, the python backend, and the
backend stub built for this Python version. The stub imports the model (and so precast)
from the environment of the `python` first on PATH, which must have numpy<2: the stub
was built against numpy 1's ABI and corrupts tensors under numpy 2 (checked here).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from precast.errors import PrecastError

INSTALL_HINT = "pip install --no-deps nvidia-pytriton==0.7.0"


def triton_root() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise PrecastError(f"tritonserver is not installed in this environment; run `{INSTALL_HINT}` (--no-deps matters)")
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise PrecastError(f"{root} has no bin/tritonserver; reinstall with `{INSTALL_HINT} --force-reinstall`")
    return root


def check_numpy() -> None:
    import numpy

    if int(numpy.__version__.split(".")[0]) >= 2:
        raise PrecastError(
            f"this environment has numpy {numpy.__version__}; Triton's python backend stub needs numpy<2 in the "
            "environment it imports the model from. Use a separate environment for Triton (docs/triton.md): "
            f"`pip install 'numpy<2' -e . && {INSTALL_HINT}`"
        )


def server_command(repo: Path, http_port: int, grpc_port: int, metrics_port: int, extra: list[str]) -> tuple[list[str], dict[str, str]]:
    if not repo.is_dir():
        raise PrecastError(f"model repository {repo} does not exist; write one with `precast triton-repo ENGINE --output {repo}`")
    check_numpy()
    root = triton_root()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise PrecastError(f"the nvidia-pytriton wheel has no python backend stub for Python {version}")
    # The python backend looks for its stub beside itself: assemble a backend directory with both.
    backends = Path(os.environ.get("PRECAST_TRITON_BACKENDS", Path.home() / ".cache" / "precast" / f"triton-backends-py{version}"))
    python_backend = backends / "python"
    if not (python_backend / "triton_python_backend_stub").is_file():
        python_backend.mkdir(parents=True, exist_ok=True)
        for f in (root / "backends" / "python").iterdir():
            if f.is_file():
                shutil.copy2(f, python_backend / f.name)
        shutil.copy2(stub, python_backend / "triton_python_backend_stub")
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    libs = [libdir, str(root.parent.parent / "nvidia_pytriton.libs"), env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = ":".join(p for p in libs if p)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    cmd = [
        str(root / "bin" / "tritonserver"),
        f"--model-repository={repo.resolve()}",
        f"--backend-directory={backends}",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        "--allow-cpu-metrics=false",
        *extra,
    ]
    return cmd, env


def run_tritonserver(
    repo: str | Path, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002, extra: list[str] | None = None
) -> None:
    cmd, env = server_command(Path(repo), http_port, grpc_port, metrics_port, extra or [])
    print("precast triton:", " ".join(cmd), flush=True)
    os.execve(cmd[0], cmd, env)  # become tritonserver: signals and exit status are its own
