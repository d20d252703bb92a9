"""Reading and writing safetensors files one tensor at a time.

The `safetensors` package loads a whole file into memory to write it, and its numpy
reader cannot return bfloat16. precast needs both streaming (bounded build memory) and
bfloat16/float8, so this file implements the (simple, documented) format directly:

    [8 bytes: little-endian u64 header length N][N bytes: JSON header][tensor bytes]

The header maps each name to {"dtype", "shape", "data_offsets": [begin, end]}, offsets
relative to the start of the tensor bytes, which must be covered without holes. Files
written here are read back by the `safetensors` package in the tests.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import ml_dtypes
import numpy as np

from precast.errors import PrecastError

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES: dict[np.dtype, str] = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """One .safetensors file opened lazily: the header is parsed, tensors are read on request."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            file_size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                raw_len = f.read(8)
                if len(raw_len) < 8:
                    raise PrecastError(self._corrupt("file is shorter than the 8-byte header length"))
                (header_len,) = struct.unpack("<Q", raw_len)
                if header_len > min(_MAX_HEADER, file_size - 8):
                    raise PrecastError(self._corrupt(f"header length {header_len} does not fit in the file"))
                header_bytes = f.read(header_len)
        except OSError as e:
            raise PrecastError(f"cannot read {self.path}: {e.strerror}") from e
        try:
            header = json.loads(header_bytes)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PrecastError(self._corrupt(f"header is not valid JSON ({e})")) from e
        if not isinstance(header, dict):
            raise PrecastError(self._corrupt("header is not a JSON object"))
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        data_start = 8 + header_len
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            try:
                dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            except (KeyError, TypeError, ValueError) as e:
                raise PrecastError(self._corrupt(f"entry for {name!r} is malformed")) from e
            if dtype not in DTYPES:
                raise PrecastError(
                    f"{self.path}: tensor {name!r} has dtype {dtype}, which precast cannot read (supported: {', '.join(DTYPES)})"
                )
            expected = math.prod(shape) * DTYPES[dtype].itemsize
            if end - begin != expected or begin < 0:
                raise PrecastError(self._corrupt(f"tensor {name!r} spans {end - begin} bytes, its shape needs {expected}"))
            if data_start + end > file_size:
                raise PrecastError(
                    self._corrupt(f"tensor {name!r} ends at byte {data_start + end} but the file has {file_size} bytes")
                    + " (truncated download or copy?)"
                )
            self.tensors[name] = TensorInfo(dtype, shape, data_start + begin, data_start + end)

    def _corrupt(self, why: str) -> str:
        return f"{self.path} is not a valid safetensors file: {why}"

    def read(self, name: str) -> np.ndarray:
        """The tensor as a fresh numpy array (bfloat16/float8 as ml_dtypes types)."""
        info = self.tensors[name]
        count = math.prod(info.shape)
        with open(self.path, "rb") as f:
            f.seek(info.begin)
            array = np.fromfile(f, dtype=DTYPES[info.dtype], count=count)
        if array.size != count:
            raise PrecastError(self._corrupt(f"tensor {name!r} could not be read in full"))
        return array.reshape(info.shape)


class SafetensorsWriter:
    """Writes a safetensors file whose layout is fixed up front, tensor by tensor.

    The header needs every tensor's name, dtype and shape; those are known before any
    weight is converted, so the header is written first and each tensor is streamed to
    its place as it is produced. Peak memory is one tensor, whatever the file's size.
    """

    def __init__(self, f: BinaryIO, layout: list[tuple[str, np.dtype, tuple[int, ...]]], metadata: dict[str, str]):
        self._f = f
        self._expected: dict[str, tuple[np.dtype, tuple[int, ...], int]] = {}
        header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        # Widest dtypes first keeps every tensor aligned to its own element size.
        for name, dtype, shape in sorted(layout, key=lambda t: -np.dtype(t[1]).itemsize):
            dtype = np.dtype(dtype)
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._expected[name] = (dtype, tuple(shape), offset)
            offset += nbytes
        header_bytes = json.dumps(header, separators=(",", ":")).encode()
        header_bytes += b" " * (-len(header_bytes) % 8)  # the format pads the header to 8 bytes
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        self._data_start = 8 + len(header_bytes)
        self._total = offset
        self._written: set[str] = set()

    def write(self, name: str, array: np.ndarray) -> None:
        dtype, shape, offset = self._expected[name]
        if array.dtype != dtype or tuple(array.shape) != shape:
            raise ValueError(f"{name}: planned {dtype}{list(shape)}, got {array.dtype}{list(array.shape)}")
        self._f.seek(self._data_start + offset)
        self._f.write(np.ascontiguousarray(array).tobytes())
        self._written.add(name)

    def finish(self) -> None:
        missing = set(self._expected) - self._written
        if missing:
            raise ValueError(f"tensors planned but never written: {sorted(missing)}")
        self._f.seek(0, os.SEEK_END)
        assert self._f.tell() == self._data_start + self._total
