"""A GGUF file's metadata and tensor table, read in well under a second.

The `gguf` package's GGUFReader builds a numpy view for every element of every metadata array: a 151k-token
vocabulary (Qwen2.5) took 20 s to open, once per build. This reader walks the same layout (the GGUF v2/v3 header,
key/value pairs, tensor infos, aligned data section) with `struct` over a memory map and returns plain Python values.
The `gguf` package still supplies the quantization types, their block sizes and the dequantization kernels.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from precast.errors import PrecastError

# GGUF value type id -> (struct format, numpy dtype) for the fixed-size scalars.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "u1"),
    1: ("<b", "i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "?"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # as GGUF lists it: fastest-varying dimension first
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # raw bytes, uint8 [rows, bytes per row] (rows = product of shape[1:]), a view of the map


@dataclass(frozen=True)
class GGUFLayout:
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        s = self.buf[self.pos : self.pos + n].decode("utf-8")
        self.pos += n
        return s

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind][0])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            elem, n = self.scalar("<I"), self.scalar("<Q")
            if elem in _SCALARS:  # one numpy read for the whole array
                dtype = np.dtype(_SCALARS[elem][1])
                if self.pos + n * dtype.itemsize > len(self.buf):
                    raise ValueError(f"an array of {n} values runs past the end of the file")
                values = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).tolist()
                self.pos += n * dtype.itemsize
                return values
            return [self.value(elem) for _ in range(n)]
        raise ValueError(f"unknown metadata value type {kind}")


def read_gguf_layout(path: Path) -> GGUFLayout:
    """Parse the header, metadata and tensor table; tensor data stay in the (read-only) memory map."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # ValueError when the file is empty
        cur = _Cursor(buf)
        if buf[:4] != b"GGUF":
            raise ValueError(f"it does not start with the GGUF magic (found {bytes(buf[:4])!r})")
        version = cur.scalar("<4xI")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (precast reads versions 2 and 3)")
        num_tensors, num_kv = cur.scalar("<Q"), cur.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(num_tensors):
            name = cur.string()
            shape = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
            infos.append((name, shape, GGMLQuantizationType(cur.scalar("<I")), cur.scalar("<Q")))
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-cur.pos // alignment) * alignment
        tensors = []
        for name, shape, qtype, offset in infos:
            block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
            rows = int(np.prod(shape[1:], dtype=np.int64))
            if shape[0] % block_elems:
                raise ValueError(f"tensor {name}: {shape[0]} values per row is not a whole number of {qtype.name} blocks")
            row_bytes = shape[0] // block_elems * block_bytes
            start = data_start + offset
            if start + rows * row_bytes > len(buf):
                raise ValueError(f"tensor {name} runs past the end of the file")
            data = np.frombuffer(buf, dtype=np.uint8, count=rows * row_bytes, offset=start).reshape(rows, row_bytes)
            tensors.append(GGUFTensor(name, shape, qtype, data))
    except (ValueError, struct.error, UnicodeDecodeError) as e:
        raise PrecastError(f"{path} is not a readable GGUF file ({e}); is it truncated or corrupt?") from e
    return GGUFLayout(version, metadata, tensors)
