"""Bit layouts of the export formats, as pure tensor functions with exact inverses.

Every format stores the same unsigned codes; only where the bits go differs:
  * dense little-endian packing into int32 along one dim: value j of a run starts at bit
    `j·b` of the run, so 3-bit values straddle words (GPTQ's 3-bit layout, compressed-tensors'
    `pack_to_int32`); for 2/4/8 bits this is the plain sequential order;
  * AutoAWQ's 4-bit interleave: word `c` holds columns `8c + [0,2,4,6,1,3,5,7]`;
  * two signed nibbles per byte (TensorRT-LLM int4): low nibble = even row.
"""

from __future__ import annotations

import sys

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Reinterpret unsigned 32-bit values held in int64 as int32 (two's complement)."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def packed_len(n: int, bits: int) -> int:
    return -(-n * bits // 32)


def pack_dense(values: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Pack unsigned `values` (< 2**bits) along `dim` into int32 words, `ceil(n·b/32)` of them."""
    v = values.movedim(dim, -1)
    if bits in (2, 4, 8) and sys.byteorder == "little":
        return _pack_bytes(v, bits).movedim(-1, dim).contiguous()
    v = v.to(torch.int64)
    n = v.shape[-1]
    pos = torch.arange(n, dtype=torch.int64) * bits  # first bit of each value
    word, shift = pos // 32, pos % 32
    n_words = packed_len(n, bits)
    out = torch.zeros(*v.shape[:-1], n_words + 1, dtype=torch.int64)  # +1 catches spills
    out.index_add_(-1, word, (v << shift) & 0xFFFFFFFF)
    spill = shift + bits > 32
    if spill.any():
        out.index_add_(-1, word[spill] + 1, v[..., spill] >> (32 - shift[spill]))
    return _to_int32(out[..., :n_words]).movedim(-1, dim).contiguous()


def unpack_dense(words: torch.Tensor, bits: int, n: int, dim: int = -1) -> torch.Tensor:
    """Inverse of `pack_dense`: `n` unsigned values (uint8 for bits <= 8) along `dim`."""
    w = words.movedim(dim, -1)
    if bits in (2, 4, 8) and sys.byteorder == "little":
        return _unpack_bytes(w, bits, n).movedim(-1, dim).contiguous()
    w = w.to(torch.int64) & 0xFFFFFFFF
    w = torch.cat([w, torch.zeros_like(w[..., :1])], dim=-1)
    pos = torch.arange(n, dtype=torch.int64) * bits
    word, shift = pos // 32, pos % 32
    lo = w[..., word] >> shift
    hi = w[..., word + 1] << (32 - shift)  # only matters where the value spills
    v = (lo | torch.where(shift + bits > 32, hi, torch.zeros_like(hi))) & (2**bits - 1)
    return v.to(torch.uint8 if bits <= 8 else torch.int32).movedim(-1, dim).contiguous()


def _pack_bytes(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Fast path for 2/4/8 bits: values never straddle a byte, and a little-endian int32 is its
    four bytes in order, so bit `j·b` of the run is bit `(j·b) % 8` of byte `j·b // 8`."""
    per_byte, per_word = 8 // bits, 32 // bits
    n = v.shape[-1]
    pad = -n % per_word
    u = v.to(torch.uint8)
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    u = u.reshape(*u.shape[:-1], -1, per_byte)
    byte = u[..., 0].clone()
    for j in range(1, per_byte):
        byte |= u[..., j] << (bits * j)
    return byte.contiguous().view(torch.int32)


def _unpack_bytes(w: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    per_byte = 8 // bits
    b = w.contiguous().view(torch.uint8)
    mask = 2**bits - 1
    parts = [(b >> (bits * j)) & mask for j in range(per_byte)]
    return torch.stack(parts, dim=-1).reshape(*b.shape[:-1], -1)[..., :n]


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """AutoAWQ GEMM: 4-bit values `[rows, n]` → int32 `[rows, n/8]`, interleaved order."""
    rows, n = values.shape
    if n % 8:
        raise ValueError(f"AWQ packs 8 columns per word; {n} is not a multiple of 8")
    order = torch.tensor(AWQ_ORDER)
    interleaved = values.reshape(rows, n // 8, 8)[..., order].reshape(rows, n)  # nibble k ← column ORDER[k]
    return pack_dense(interleaved, 4)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    rows, n_words = words.shape
    nibbles = unpack_dense(words, 4, n_words * 8).reshape(rows, n_words, 8)
    return nibbles[..., torch.argsort(torch.tensor(AWQ_ORDER))].reshape(rows, n_words * 8)


def pack_int4_pairs(signed: torch.Tensor) -> torch.Tensor:
    """Signed int4 `[rows, cols]` (−8..7) → int8 `[rows/2, cols]`, low nibble = even row."""
    if signed.shape[0] % 2:
        raise ValueError(f"int4 pairs need an even row count, got {signed.shape[0]}")
    nib = signed.to(torch.int16) & 0xF
    byte = nib[0::2] | (nib[1::2] << 4)
    return byte.to(torch.uint8).view(torch.int8)


def unpack_int4_pairs(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4_pairs`: int8 `[rows/2, cols]` → signed int8 `[rows, cols]`."""
    b = packed.view(torch.uint8).to(torch.int16)
    lo, hi = b & 0xF, b >> 4
    nib = torch.stack([lo, hi], dim=1).reshape(-1, packed.shape[1])
    return torch.where(nib >= 8, nib - 16, nib).to(torch.int8)
