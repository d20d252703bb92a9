"""Hugging Face checkpoint directories: config.json + safetensors (single or sharded) + tokenizer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from precast.builder.checkpoint.base import Checkpoint, TokenizerFiles
from precast.engine.safetensors_file import SafetensorsFile, TensorInfo
from precast.errors import PrecastError

# Files an HF directory may carry that describe the tokenizer; copied into the engine as they are.
TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise PrecastError(f"{path} is not valid JSON ({e}); the checkpoint may be corrupt") from e
    except UnicodeDecodeError as e:
        raise PrecastError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason}); the checkpoint may be corrupt") from e


def _prequantized(path: Path, quant: Any) -> dict[str, Any]:
    """Accept modelopt's FP8 export (weights and activations, per tensor); refuse the rest clearly."""
    method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
    algo = quant.get("quant_algo") if isinstance(quant, dict) else None
    if method != "modelopt" or algo != "FP8":
        raise PrecastError(
            f"{path} is a pre-quantized checkpoint (quantization_config.quant_method={method!r}, quant_algo={algo!r}); "
            "precast builds full-precision checkpoints (quantize them with `precast build --quant ...`) and modelopt "
            "FP8 exports. Use the original full-precision checkpoint."
        )
    hf_quant = path / "hf_quant_config.json"
    kv_algo = (_read_json(hf_quant).get("quantization", {}) if hf_quant.is_file() else {}).get("kv_cache_quant_algo")
    if kv_algo or quant.get("kv_cache_scheme"):
        raise PrecastError(
            f"{path} has a quantized KV cache ({kv_algo or quant.get('kv_cache_scheme')}), whose scales precast does not "
            "import yet; re-export it without KV cache quantization (for an fp8 KV cache, build the full-precision "
            "checkpoint with --quant fp8 --kv-cache-dtype fp8)"
        )
    return {"method": method, "algo": algo}


class HFCheckpoint(Checkpoint):
    format = "hf"

    def __init__(self, path: Path) -> None:
        self.path = path
        config_path = path / "config.json"
        if not config_path.is_file():
            raise PrecastError(f"{path} has no config.json: a Hugging Face checkpoint directory needs one")
        self.config = _read_json(config_path)
        if not isinstance(self.config, dict):
            raise PrecastError(f"{config_path} is not a JSON object")
        quant = self.config.get("quantization_config")
        if quant:
            self.prequantized = _prequantized(path, quant)
        self._files = self._weight_files()
        self._where: dict[str, tuple[SafetensorsFile, TensorInfo]] = {}
        for st in (SafetensorsFile(p) for p in self._files):
            for name, info in st.tensors.items():
                if name in self._where:
                    raise PrecastError(f"tensor {name!r} appears in both {self._where[name][0].path.name} and {st.path.name}")
                self._where[name] = (st, info)

    def _weight_files(self) -> list[Path]:
        index_path = self.path / "model.safetensors.index.json"
        if index_path.is_file():
            weight_map = _read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise PrecastError(f"{index_path} has no weight_map")
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (self.path / n).is_file()]
            if missing:
                raise PrecastError(f"{index_path} lists shards that are missing: {', '.join(missing)}")
            return [self.path / n for n in names]
        files = sorted(self.path.glob("*.safetensors"))
        if files:
            return files
        if list(self.path.glob("*.bin")) or list(self.path.glob("*.pt")):
            raise PrecastError(
                f"{self.path} holds PyTorch pickle weights (*.bin/*.pt) only; precast reads safetensors. "
                "Re-save the model with `save_pretrained(..., safe_serialization=True)`."
            )
        raise PrecastError(f"{self.path} has no weights: expected model.safetensors or sharded *.safetensors with an index")

    def tensor_names(self) -> list[str]:
        return list(self._where)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._where[name][1].shape

    def tensor_dtype(self, name: str) -> str:
        return self._where[name][1].dtype

    def read(self, name: str) -> np.ndarray:
        st, _ = self._where[name]
        return st.read(name)

    def generation_config(self) -> dict[str, Any]:
        path = self.path / "generation_config.json"
        return _read_json(path) if path.is_file() else {}

    def tokenizer(self) -> TokenizerFiles | None:
        if not (self.path / "tokenizer.json").is_file():
            return None
        files = {n: (self.path / n).read_bytes() for n in TOKENIZER_FILE_NAMES if (self.path / n).is_file()}
        tok_config = _read_json(self.path / "tokenizer_config.json") if "tokenizer_config.json" in files else {}
        chat_template = tok_config.get("chat_template")
        if "chat_template.jinja" in files:
            chat_template = files["chat_template.jinja"].decode("utf-8")
        eos = self.generation_config().get("eos_token_id", self.config.get("eos_token_id"))
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return TokenizerFiles(
            files=files,
            bos_token_id=self.config.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=self.config.get("pad_token_id"),
            chat_template=chat_template if isinstance(chat_template, str) else None,
        )

    def digest(self) -> str:
        h = hashlib.sha256()
        for p in [self.path / "config.json", *self._files]:
            h.update(p.name.encode())
            with open(p, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
        return h.hexdigest()
