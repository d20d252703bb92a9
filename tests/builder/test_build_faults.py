"""Operational faults of `precast build` and engine loading: killed builds, full disks, damaged files.

Each is one clear message (exit 2 from the command line), and nothing is lost or left behind.
"""

from __future__ import annotations

import errno
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from precast.builder.build import BuildOptions, build_engine
from precast.cli import main
from precast.engine.directory import SCRATCH_MARKER, load_engine, remove_stale_scratch
from precast.engine.safetensors_file import SafetensorsFile
from precast.errors import PrecastError


@pytest.fixture
def ckpt(tiny_checkpoints, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_checkpoints["llama"], tmp_path / "ckpt"))


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def leftover(parent: Path, name: str, pid: int | None, host: str | None = None) -> Path:
    import socket

    d = parent / name
    d.mkdir()
    (d / "weights.safetensors").write_bytes(b"x" * 100)
    if pid is not None:
        (d / SCRATCH_MARKER).write_text(f"{host or socket.gethostname()} {pid}\n")
    return d


def test_the_next_build_removes_only_a_killed_builds_leftovers(ckpt, tmp_path):
    pid = dead_pid()
    stale = [leftover(tmp_path, ".engine.building-a1", pid), leftover(tmp_path, ".engine.full-b2", pid)]
    kept = [
        leftover(tmp_path, ".engine.building-live", _alive_pid()),  # a build still running
        leftover(tmp_path, ".engine.building-unmarked", None),  # not recognisably precast's
        leftover(tmp_path, ".engine.full-elsewhere", pid, host="another-host"),  # cannot tell
        leftover(tmp_path, ".other.building-c3", pid),  # another output's
    ]
    build_engine(BuildOptions(ckpt, tmp_path / "engine", progress=False))
    assert not any(d.exists() for d in stale)
    assert all(d.exists() for d in kept)
    assert not (tmp_path / "engine" / SCRATCH_MARKER).exists()
    load_engine(tmp_path / "engine")


def _alive_pid() -> int:
    import os

    return os.getpid()


def test_an_engine_moved_aside_by_a_killed_force_build_is_put_back(ckpt, tmp_path):
    out = tmp_path / "engine"
    build_engine(BuildOptions(ckpt, out, progress=False))
    aside = leftover(tmp_path, ".engine.old-d4", dead_pid())
    (aside / "weights.safetensors").unlink()
    out.rename(aside / "engine")  # killed between moving the old engine aside and landing the new one
    done = remove_stale_scratch(out)
    assert any("restored" in line for line in done) and not aside.exists()
    load_engine(out)


def test_kill_9_of_a_quantized_build_is_cleaned_up_by_the_next(smollm2_gguf, tmp_path):
    out = tmp_path / "engine"
    cmd = [sys.executable, "-m", "precast", "build", "--checkpoint", str(smollm2_gguf), "--output", str(out), "--quiet"]
    cmd += ["--quant", "fp8", "--calib-samples", "2", "--calib-seq-len", "64", "--max-seq-len", "256"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(tmp_path.glob(".engine.full-*/engine/weights.safetensors")) and time.time() < deadline:
        assert proc.poll() is None, "the build ended before it could be killed"
        time.sleep(0.05)
    time.sleep(0.3)  # mid-way through the float engine
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".engine.")]
    assert left, "a SIGKILL leaves the temporary directories behind"
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "left by a killed build" in run.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".engine.")] == []
    assert load_engine(out).config.quant.recipe == "fp8"


def test_full_disk_is_one_line_and_keeps_the_old_engine(ckpt, tmp_path, monkeypatch, capsys):
    from precast.engine import safetensors_file

    out = tmp_path / "engine"
    assert main(["build", "--checkpoint", str(ckpt), "--output", str(out), "--quiet"]) == 0
    before = (out / "weights.safetensors").read_bytes()

    def full(self, name, array):
        raise OSError(errno.ENOSPC, "No space left on device", str(out.parent))

    monkeypatch.setattr(safetensors_file.SafetensorsWriter, "write", full)
    capsys.readouterr()
    assert main(["build", "--checkpoint", str(ckpt), "--output", str(out), "--force", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "No space left on device" in err and "ENOSPC" in err and "--output" in err
    assert "Traceback" not in err
    assert (out / "weights.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".engine.")] == []


def test_read_only_output_is_one_line(ckpt, tmp_path, monkeypatch, capsys):
    import tempfile

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "engine"))

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    assert main(["build", "--checkpoint", str(ckpt), "--output", str(tmp_path / "engine"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "EROFS" in err and "writable" in err


def test_config_json_that_is_not_utf8(ckpt, tmp_path, capsys):
    (ckpt / "config.json").write_bytes((ckpt / "config.json").read_bytes().replace(b'"llama"', b'"ll\xffama"'))
    assert main(["build", "--checkpoint", str(ckpt), "--output", str(tmp_path / "engine"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not UTF-8" in err and "config.json" in err


def test_a_checkpoint_without_a_tokenizer_is_said_at_build_time(ckpt, tmp_path, capsys):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (ckpt / name).unlink(missing_ok=True)
    assert main(["build", "--checkpoint", str(ckpt), "--output", str(tmp_path / "engine"), "--quiet"]) == 0
    assert "no tokenizer" in capsys.readouterr().err


def test_a_config_that_disagrees_with_every_tensor_is_a_short_message(ckpt, tmp_path):
    config = json.loads((ckpt / "config.json").read_text())
    config["hidden_size"] *= 2
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(PrecastError) as e:
        build_engine(BuildOptions(ckpt, tmp_path / "engine", progress=False))
    lines = str(e.value).splitlines()
    assert len(lines) <= 9 and "more" in str(e.value) and "hidden_size" in lines[-1], str(e.value)


@pytest.mark.parametrize("size", [0, 5, 1000])
def test_truncated_engine_weights_say_rebuild(ckpt, tmp_path, size):
    out = tmp_path / "engine"
    build_engine(BuildOptions(ckpt, out, progress=False))
    with open(out / "weights.safetensors", "r+b") as f:
        f.truncate(size)
    with pytest.raises(PrecastError, match="rebuild it with `precast build"):
        load_engine(out)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_engine_weights_holding_nan_or_inf_are_refused_at_load(ckpt, tmp_path, value):
    from precast.runtime import LLM

    out = tmp_path / "engine"
    build_engine(BuildOptions(ckpt, out, progress=False))
    info = SafetensorsFile(out / "weights.safetensors").tensors["layers.0.mlp.down.weight"]
    with open(out / "weights.safetensors", "r+b") as f:
        f.seek(info.begin + 4 * 10)
        f.write(np.float32(value).tobytes())
    with pytest.raises(PrecastError, match="layers.0.mlp.down.weight holds NaN or Inf; the engine is damaged, rebuild it"):
        LLM(out)
