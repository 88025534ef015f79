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
GGUF_ALIGNMENT = 32  # the spec's default for the tensor data's start and every tensor's offset
# safetensors dtypes → bits per element (the safetensors library refuses any other name)
SAFETENSORS_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
                    "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
                    "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def check_safetensors(path: Path) -> None:
    """The header length, JSON and every tensor's offsets fit the file; every tensor's dtype is
    one safetensors knows and its byte range holds exactly its shape's elements."""
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
        dtype, shape = info.get("dtype"), info.get("shape")
        if dtype not in SAFETENSORS_BITS:
            _bad(path, f"declares tensor {str(name)[:80]!r} of unknown dtype {str(dtype)[:20]!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            _bad(path, f"declares tensor {str(name)[:80]!r} with a shape that is not a list of sizes")
        elements = 1
        for d in shape:
            elements *= d
        if elements * SAFETENSORS_BITS[dtype] != (offsets[1] - offsets[0]) * 8:
            _bad(path, f"declares tensor {str(name)[:80]!r} of shape {str(shape)[:40]} in "
                       f"{offsets[1] - offsets[0]} bytes, which do not hold it")


def check_gguf(path: Path) -> None:
    """Magic, version, and every metadata string, array and tensor record within the file; the
    required `general.architecture`; every tensor of a known type with its data inside the file."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        reader = _Bounded(handle, size, path)
        if reader.take(4) != b"GGUF":
            _bad(path, "is not a GGUF file (no GGUF magic)")
        version = reader.uint(4)
        if version not in (2, 3):
            _bad(path, f"has GGUF version {version}; versions 2 and 3 are read")
        tensors, kvs = reader.count(), reader.count()
        alignment, architecture = GGUF_ALIGNMENT, False
        for _ in range(kvs):
            key = reader.string(keep=64)
            kind = reader.uint(4)
            if key == b"general.alignment" and kind == 4:  # uint32
                alignment = reader.uint(4)
                if alignment == 0 or alignment & (alignment - 1):
                    _bad(path, f"declares general.alignment {alignment}, not a power of two")
            else:
                architecture |= key == b"general.architecture" and kind == 8
                reader.value(kind)
        if not architecture:
            _bad(path, "has no general.architecture string (every GGUF model declares one)")
        records = []
        for _ in range(tensors):
            reader.string()
            dims = reader.uint(4)
            if not 1 <= dims <= GGUF_MAX_DIMS:
                _bad(path, f"declares a tensor with {dims} dimensions")
            elements = 1
            for _ in range(dims):
                elements *= max(reader.uint(8), 1)
            kind = reader.uint(4)
            offset = reader.uint(8)
            if offset > size or elements > 8 * size:  # ≥ 1 bit per element
                _bad(path, f"declares a tensor of {elements} elements past its {size} bytes")
            records.append((elements, kind, offset))
        start = -(-handle.tell() // alignment) * alignment
    _tensor_data(path, size, start, records)


def _tensor_data(path: Path, size: int, start: int, records: list[tuple[int, int, int]]) -> None:
    """Every tensor's type is a GGML type and its bytes (from the type's block size) lie in the
    file: a truncated file or an unknown type ends here, not in the reader's reshape or enum."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    sizes = {int(t): v for t, v in GGML_QUANT_SIZES.items()}
    for elements, kind, offset in records:
        if kind not in sizes:
            known = ", ".join(t.name for t in GGMLQuantizationType if int(t) in sizes)
            _bad(path, f"declares a tensor of unknown type {kind} (types: {known[:120]}, ...)")
        block, nbytes = sizes[kind]
        if elements % block:
            _bad(path, f"declares a tensor of {elements} elements, not a whole number of {block}-element blocks")
        end = start + offset + elements // block * nbytes
        if end > size:
            _bad(path, f"is truncated: a tensor's data ends at byte {end} of a {size}-byte file")


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

    def string(self, keep: int = 0) -> bytes:
        """Skips a string, or returns it when it is at most `keep` bytes long."""
        n = self.count()
        if n <= keep:
            return self.take(n)
        self.handle.seek(n, 1)
        return b""

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
    except RecursionError:  # json's C scanner recurses per nesting level: `[[[...` 100k deep
        _bad(path, "is JSON nested too deeply to read")
    if not isinstance(value, dict):
        _bad(path, f"holds a JSON {type(value).__name__}, not an object")
    return value
