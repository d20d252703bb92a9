"""The engine directory, format v1 (docs/engine-format.md): writing it atomically, loading it with checks.

    ENGINE/
      config.json          format, version, model (ModelSpec), dtype, quant, limits, targets,
                           tokenizer, generation defaults, provenance
      weights.safetensors  canonical tensor names (engine/tensors.py)
      tokenizer.json ...   the tokenizer files, when the checkpoint had a tokenizer

An engine is written into a temporary sibling directory and renamed into place only when
complete, so a failed or interrupted build never leaves a half-written engine behind.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from precast.engine.limits import BuildLimits
from precast.engine.quant import QuantSection
from precast.engine.safetensors_file import DTYPES, SafetensorsFile
from precast.engine.spec import ModelSpec
from precast.engine.tensors import TensorLayout, engine_tensor_shapes
from precast.errors import PrecastError

ENGINE_FORMAT = "precast-engine"
ENGINE_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "weights.safetensors"
TARGETS = ("cpu", "tensorrt")

# Engine dtypes: the --dtype name, its numpy type and its safetensors name.
ENGINE_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def numpy_dtype(name: str) -> np.dtype:
    return DTYPES[ENGINE_DTYPES[name]]


@dataclass(frozen=True)
class EngineConfig:
    model: ModelSpec
    dtype: str  # storage dtype of the matrices; 1-D tensors (norms, biases) are always float32
    limits: BuildLimits
    targets: dict[str, dict[str, Any]]
    tokenizer: dict[str, Any] | None  # ids and file names; None: token ids in, token ids out
    provenance: dict[str, Any]
    generation: dict[str, Any] = field(default_factory=dict)  # sampling defaults from generation_config.json
    quant: QuantSection = field(default_factory=QuantSection)

    @property
    def embedding_scale(self) -> float:
        """What the input embeddings are multiplied by (Gemma's sqrt(hidden), in this engine's dtype; else 1)."""
        return self.model.embedding_scale(numpy_dtype(self.dtype))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": ENGINE_FORMAT,
            "version": ENGINE_VERSION,
            "model": self.model.to_dict(),
            "dtype": self.dtype,
            "quant": self.quant.to_dict(),
            "limits": self.limits.to_dict(),
            "targets": self.targets,
            "tokenizer": self.tokenizer,
            "generation": self.generation,
            "provenance": self.provenance,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> EngineConfig:
        if data.get("format") != ENGINE_FORMAT:
            raise PrecastError(f"{where} is not a precast engine config (format {data.get('format')!r})")
        version = data.get("version")
        if not isinstance(version, int) or version > ENGINE_VERSION:
            raise PrecastError(
                f"{where} is engine format version {version}, newer than this precast reads (version {ENGINE_VERSION}); "
                "upgrade precast, or rebuild the engine with this version's `precast build`"
            )
        if version < ENGINE_VERSION:
            raise PrecastError(f"{where} is engine format version {version}, no longer supported; rebuild it with `precast build`")
        try:
            model = ModelSpec.from_dict(data["model"])
            limits = BuildLimits(**data["limits"])
            quant = QuantSection.from_dict(data["quant"], model, limits.kv_cache_dtype, where)
            config = cls(
                model=model,
                dtype=data["dtype"],
                quant=quant,
                limits=limits,
                targets=data["targets"],
                tokenizer=data["tokenizer"],
                generation=data.get("generation", {}),
                provenance=data["provenance"],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PrecastError(f"{where} is damaged or incomplete ({type(e).__name__}: {e}); rebuild the engine") from e
        if config.dtype not in ENGINE_DTYPES:
            raise PrecastError(f"{where}: unknown engine dtype {config.dtype!r}")
        return config

    def expected_tensors(self) -> TensorLayout:
        """Canonical name -> (shape, safetensors dtype) that weights.safetensors must hold."""
        matrix = ENGINE_DTYPES[self.dtype]
        layers = self.quant.layers
        expected: TensorLayout = {}
        for name, shape in engine_tensor_shapes(self.model).items():
            layer = name.removesuffix(".weight")
            if layer in layers:  # the quantized weight, then its scales: the file keeps build order
                expected.update(layers[layer].tensors(layer, shape[0], shape[1]))
            else:
                expected[name] = (shape, "F32" if len(shape) == 1 else matrix)
        return expected


@dataclass
class Engine:
    """A loaded and checked engine directory. Weights stay on disk until read."""

    path: Path
    config: EngineConfig
    weights: SafetensorsFile

    @property
    def tokenizer_path(self) -> Path | None:
        return self.path / "tokenizer.json" if self.config.tokenizer else None


def load_engine(path: str | os.PathLike) -> Engine:
    """Open an engine directory and check format, version and that weights match the config."""
    p = Path(path)
    if not p.is_dir():
        raise PrecastError(f"engine directory {p} does not exist; build one with `precast build --checkpoint ... --output {p}`")
    config_path = p / CONFIG_FILE
    if not config_path.is_file():
        raise PrecastError(f"{p} has no {CONFIG_FILE}: not a precast engine directory")
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PrecastError(f"{config_path} is not valid JSON ({e}); rebuild the engine") from e
    config = EngineConfig.from_dict(data, str(config_path))
    if not (p / WEIGHTS_FILE).is_file():
        raise PrecastError(f"{p} has no {WEIGHTS_FILE}; the engine is incomplete, rebuild it")
    try:
        weights = SafetensorsFile(p / WEIGHTS_FILE)
    except PrecastError as e:
        raise PrecastError(
            f"{e}; the engine is damaged (a truncated copy?): rebuild it with `precast build ... --output {p} --force`"
        ) from e
    expected = config.expected_tensors()
    problems = [f"missing {n}" for n in expected if n not in weights.tensors]
    problems += [f"unexpected {n}" for n in weights.tensors if n not in expected]
    for name, (shape, dtype) in expected.items():
        info = weights.tensors.get(name)
        if info is not None and (info.shape != shape or info.dtype != dtype):
            problems.append(f"{name} is {info.dtype}{list(info.shape)}, config says {dtype}{list(shape)}")
    if config.tokenizer:
        problems += [f"missing tokenizer file {f}" for f in config.tokenizer.get("files", []) if not (p / f).is_file()]
    if problems:
        raise PrecastError(f"engine {p} is inconsistent with its config: " + "; ".join(problems[:10]) + "; rebuild it")
    return Engine(p, config, weights)


# Every temporary directory a build makes beside its output is named `.NAME.KIND-*` and holds this
# marker ("host pid"), so the next build of the same output can tell a killed build's leftovers
# (a dead pid on this host) from another build in progress, and from anything precast did not make.
SCRATCH_MARKER = ".precast-scratch"
SCRATCH_KINDS = ("building", "full", "old")


def make_scratch(output: Path, kind: str) -> Path:
    scratch = Path(tempfile.mkdtemp(prefix=f".{output.name}.{kind}-", dir=output.parent))
    (scratch / SCRATCH_MARKER).write_text(f"{socket.gethostname()} {os.getpid()}\n", encoding="utf-8")
    return scratch


@contextmanager
def scratch_directory(output: Path, kind: str) -> Iterator[Path]:
    """A marked temporary directory beside `output`, removed when the block ends."""
    output.parent.mkdir(parents=True, exist_ok=True)
    scratch = make_scratch(output, kind)
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def remove_stale_scratch(output: Path) -> list[str]:
    """Remove what killed builds of `output` left beside it; returns what was done, one line each.

    Only directories named `.NAME.KIND-*` whose marker names a process on this host that no longer
    runs. An old engine moved aside by a `--force` build that died before its replacement landed
    is put back at `output` first."""
    done: list[str] = []
    if not output.parent.is_dir():
        return done
    for kind in SCRATCH_KINDS:
        for scratch in sorted(output.parent.glob(f".{output.name}.{kind}-*")):
            if not scratch.is_dir() or not _owner_is_gone(scratch / SCRATCH_MARKER):
                continue
            if kind == "old" and (scratch / "engine").is_dir() and not output.exists():
                os.rename(scratch / "engine", output)
                done.append(f"restored {output} from {scratch.name} (a killed --force build had moved it aside)")
            shutil.rmtree(scratch, ignore_errors=True)
            done.append(f"removed {scratch} (left by a killed build)")
    return done


def _owner_is_gone(marker: Path) -> bool:
    try:
        host, pid = marker.read_text(encoding="utf-8").split()
        pid_number = int(pid)
    except (OSError, ValueError):
        return False  # no readable marker: not ours to remove
    if host != socket.gethostname():
        return False  # another machine's build (a shared filesystem): cannot tell
    try:
        os.kill(pid_number, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False  # alive: a build still running


@contextmanager
def atomic_directory(output: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary directory beside `output`; on success it replaces `output`, on failure it is removed.

    With force, an existing `output` is moved aside first and deleted only after the new
    directory is in place, so at every moment one complete engine (old or new) exists. Both
    temporary directories carry SCRATCH_MARKER while they are temporary (remove_stale_scratch).
    """
    if output.exists() and not force:
        raise PrecastError(f"{output} already exists; choose another --output or pass --force to replace it")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_scratch(output, "building")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; an engine is an ordinary directory
    try:
        yield tmp
        old = None
        if output.exists():
            old = make_scratch(output, "old")
            os.rename(output, old / "engine")
        os.rename(tmp, output)
        (output / SCRATCH_MARKER).unlink()  # harmless if a kill leaves it: only `.NAME.KIND-*` are scanned
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def fsync_tree(path: Path) -> None:
    """Flush every file so the rename publishes data that is really on disk."""
    for file in path.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())
