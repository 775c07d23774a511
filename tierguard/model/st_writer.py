"""Write a safetensors file one tensor at a time.

Why not `safetensors.save_file`: it takes every tensor at once and serializes them into
one buffer, so a GGUF import would hold the whole dequantized model (and a copy) in
memory. The format is a little-endian u64 header length, a JSON header of
{name: {dtype, shape, data_offsets}}, then the data; the header only needs the shapes,
which the GGUF reader knows before anything is dequantized. Files written here are read
back with the `safetensors` library (tests check that).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

DTYPES = {"float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2)}


def to_dtype(array: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> the stored dtype, as raw little-endian values. bfloat16 rounds to
    nearest-even like torch's cast (numpy has no bfloat16), in slices, so the integer
    temporaries stay small next to a large embedding."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if dtype == "float32":
        return array
    if dtype == "float16":
        return array.astype(np.float16)
    flat = array.reshape(-1)
    out = np.empty(flat.shape, dtype=np.uint16)
    step = 1 << 20
    for s in range(0, flat.size, step):
        part = flat[s : s + step]
        bits = part.view(np.uint32)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        rounded[np.isnan(part)] = 0x7FC0
        out[s : s + step] = rounded
    return out.reshape(array.shape)


class StreamingSafetensors:
    """`add(name, array)` in the order given to the constructor, then `close()`."""

    def __init__(self, path: Path, shapes: list[tuple[str, tuple[int, ...]]], dtype: str) -> None:
        code, itemsize = DTYPES[dtype]
        self.dtype = dtype
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        self._expect: list[tuple[str, tuple[int, ...], int]] = []
        for name, shape in shapes:
            n = int(np.prod(shape, dtype=np.int64)) * itemsize
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._expect.append((name, shape, n))
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def add(self, name: str, array: np.ndarray) -> None:
        want, shape, n = self._expect[self._next]
        if name != want or tuple(array.shape) != tuple(shape):
            raise ValueError(f"expected {want} {shape}, got {name} {tuple(array.shape)}")
        data = to_dtype(array, self.dtype)
        if data.nbytes != n:
            raise ValueError(f"{name}: {data.nbytes} bytes, header says {n}")
        self._f.write(np.ascontiguousarray(data).data)  # no extra copy
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._expect):
            self._f.close()
            raise ValueError(f"{len(self._expect) - self._next} tensors were never written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def abort(self) -> None:
        self._f.close()
