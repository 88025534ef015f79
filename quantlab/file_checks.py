"""Bounded header checks of the binary files quantlab reads (safetensors, GGUF), done before
a library parses them.

The readers trust the sizes a header declares: a safetensors header length of 2⁶², offsets
past the end of the file, a GGUF declaring 2⁶¹ array elements or 2⁶⁰-byte strings make them
allocate without limit, hang or fail with a traceback. Here every declared length and count is
checked against the bytes that remain in the file (an element takes at least one byte) before
anything is allocated, so a truncated, damaged or crafted file ends in one line naming it
(`UserError`) in at most a pass over its header.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, BinaryIO

from quantlab.errors import UserError

SAFETENSORS_MAX_HEADER = 100 * 2**20  # the safetensors library's own limit
GGUF_MAX_DIMS = 4
MAX_ARRAY_NESTING = 8  # llama.cpp writes flat arrays; nesting is only ever a crafted header
# GGUF metadata value types → fixed byte size (8: string and 9: array are variable)
GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def check_safetensors(path: Path) -> None:
    """The header length, JSON and every tensor's offsets fit the file."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            _bad(path, "shorter than a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(SAFETENSORS_MAX_HEADER, size - 8):
            _bad(path, f"declares a {length}-byte header in a {size}-byte file")
        try:
            header = json.loads(handle.read(length))
        except (ValueError, UnicodeDecodeError):
            _bad(path, "has a header that is not JSON")
    if not isinstance(header, dict):
        _bad(path, "has a header that is not a JSON object")
    data = size - 8 - length
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data):
            _bad(path, f"declares tensor {str(name)[:80]!r} outside its {data} data bytes")


def check_gguf(path: Path) -> None:
    """Magic, version, and every metadata string, array and tensor record within the file."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        reader = _Bounded(handle, size, path)
        if reader.take(4) != b"GGUF":
            _bad(path, "is not a GGUF file (no GGUF magic)")
        version = reader.uint(4)
        if version not in (2, 3):
            _bad(path, f"has GGUF version {version}; versions 2 and 3 are read")
        tensors, kvs = reader.count(), reader.count()
        for _ in range(kvs):
            reader.string()
            reader.value(reader.uint(4))
        for _ in range(tensors):
            reader.string()
            dims = reader.uint(4)
            if not 1 <= dims <= GGUF_MAX_DIMS:
                _bad(path, f"declares a tensor with {dims} dimensions")
            elements = 1
            for _ in range(dims):
                elements *= max(reader.uint(8), 1)
            reader.uint(4)  # type
            if reader.uint(8) > size or elements > 8 * size:  # offset; ≥ 1 bit per element
                _bad(path, f"declares a tensor of {elements} elements past its {size} bytes")


class _Bounded:
    """Reads GGUF header fields, refusing any declared length the rest of the file cannot hold."""

    def __init__(self, handle: BinaryIO, size: int, path: Path):
        self.handle, self.size, self.path = handle, size, path

    def take(self, n: int) -> bytes:
        data = self.handle.read(n)
        if len(data) < n:
            _bad(self.path, "is truncated (its header ends early)")
        return data

    def uint(self, n: int) -> int:
        return int.from_bytes(self.take(n), "little")

    def count(self) -> int:
        """A declared count of items of at least one byte each."""
        n = self.uint(8)
        if n > self.size - self.handle.tell():
            _bad(self.path, f"declares {n} items in a {self.size}-byte file")
        return n

    def string(self) -> None:
        self.handle.seek(self.count(), 1)

    def value(self, kind: int, depth: int = 0) -> None:
        if kind == 8:
            self.string()
        elif kind == 9:
            if depth >= MAX_ARRAY_NESTING:
                _bad(self.path, f"nests arrays more than {MAX_ARRAY_NESTING} deep")
            inner, n = self.uint(4), self.count()
            if inner in GGUF_SCALARS:
                if n * GGUF_SCALARS[inner] > self.size - self.handle.tell():
                    _bad(self.path, f"declares an array of {n} values past its end")
                self.handle.seek(n * GGUF_SCALARS[inner], 1)
            else:
                for _ in range(n):
                    self.value(inner, depth + 1)
        elif kind in GGUF_SCALARS:
            self.take(GGUF_SCALARS[kind])
        else:
            _bad(self.path, f"has a metadata value of unknown type {kind}")


def _bad(path: Path, why: str) -> None:
    raise UserError(f"{path}: {why}; the file is damaged or not what its name says")


def read_json_object(path: Path, limit: int = 256 * 2**20) -> dict[str, Any]:
    """The JSON object in `path` (a config, quant_config, index or sidecar): one line naming the
    file when it is missing, too large, not UTF-8 JSON, or JSON but not an object, instead of
    the reader's traceback or a message that does not say which file."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    if size > limit:
        _bad(path, f"is {size} bytes, more than the {limit}-byte limit of a JSON file quantlab reads")
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        _bad(path, f"is not valid JSON ({str(exc)[:80]})")
    if not isinstance(value, dict):
        _bad(path, f"holds a JSON {type(value).__name__}, not an object")
    return value
