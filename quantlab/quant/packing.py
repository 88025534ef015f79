"""Bit packing of unsigned codes into int32 words along the last dim.

`32 // bits` codes share a word, lowest bits first (the sequential GPTQ / compressed-tensors
order); 3-bit codes use 30 of 32 bits so no code straddles a word. Exporters that need
another order (AWQ's interleave, GGUF blocks) repack from the unpacked codes.
"""

from __future__ import annotations

import math

import torch


def codes_per_word(bits: int) -> int:
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"bits must be 2, 3, 4 or 8, got {bits}")
    return 32 // bits


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes `[..., n]` into int32 `[..., ceil(n / (32 // bits))]`."""
    per = codes_per_word(bits)
    n = codes.shape[-1]
    pad = math.ceil(n / per) * per - n
    c = codes.to(torch.int64)
    if pad:
        c = torch.nn.functional.pad(c, (0, pad))
    c = c.reshape(*codes.shape[:-1], -1, per)
    shifts = torch.arange(per, dtype=torch.int64, device=codes.device) * bits  # codes may be on GPU
    words = (c << shifts).sum(dim=-1)
    # Reinterpret the unsigned 32-bit value as int32 (two's complement).
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack`: int32 `[..., w]` back to uint8 codes `[..., n]`."""
    per = codes_per_word(bits)
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64, device=words.device) * bits
    c = (w.unsqueeze(-1) >> shifts) & (2**bits - 1)
    return c.reshape(*words.shape[:-1], -1)[..., :n].to(torch.uint8)
