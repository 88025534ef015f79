"""The static KV cache: one preallocated `[batch, kv_heads, max_seq_len, head_dim]` buffer
per layer for K (after RoPE) and V, written at the step's positions (gpt-fast style), so a
decode step has fixed shapes and can be captured in a CUDA graph.

Storage is the compute dtype, or 8-bit codes (C8) with the static absmax scales from the
canonical form's `scales.safetensors` — per KV head or their max, as fake-quant evaluation
uses them (`quantlab.quant.kv_cache.kv_fake_quant_hook`) — dequantized on read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantlab.quant.activations import scale_from_absmax
from quantlab.runner.codes import STORAGE, decode, encode


@dataclass(frozen=True)
class KVQuant:
    """C8 settings of one attention module: the code kind and `[1, kv_heads, 1, 1]` scales."""

    kind: str  # "int8" | "fp8"
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    @classmethod
    def from_absmax(cls, kind: str, k_absmax: torch.Tensor, v_absmax: torch.Tensor, per_head: bool) -> "KVQuant":
        def scale(absmax: torch.Tensor) -> torch.Tensor:
            amax = absmax.float() if per_head else absmax.float().max().expand_as(absmax)
            return scale_from_absmax(amax, kind).view(1, -1, 1, 1)

        return cls(kind, scale(k_absmax), scale(v_absmax))


class KVCache(nn.Module):
    def __init__(self, batch: int, kv_heads: int, max_seq_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, quant: KVQuant | None = None):
        super().__init__()
        self.dtype = dtype
        self.kind = quant.kind if quant is not None else None
        storage = STORAGE[quant.kind] if quant is not None else dtype
        shape = (batch, kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=storage, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=storage, device=device), persistent=False)
        if quant is not None:
            self.register_buffer("k_scale", quant.k_scale.to(device), persistent=False)
            self.register_buffer("v_scale", quant.v_scale.to(device), persistent=False)

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[2]

    def write(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store `k, v [B, kv_heads, L, D]` at `input_pos [L]` (as codes under C8)."""
        if self.kind is None:
            self.k.index_copy_(2, input_pos, k.to(self.dtype))
            self.v.index_copy_(2, input_pos, v.to(self.dtype))
        else:
            # as bytes: index_copy_ has no float8 kernels
            self.k.view(torch.uint8).index_copy_(2, input_pos, encode(k, self.k_scale, self.kind).view(torch.uint8))
            self.v.view(torch.uint8).index_copy_(2, input_pos, encode(v, self.v_scale, self.kind).view(torch.uint8))

    def head_scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The C8 scales as `[kv_heads]` float32 views (what the decode-attention kernel takes;
        per-tensor scales are stored expanded per head), or Nones."""
        if self.kind is None:
            return None, None
        return self.k_scale.reshape(-1), self.v_scale.reshape(-1)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attend_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `k, v [B, kv_heads, L, D]` at `input_pos [L]`; return the first `attend_len`
        positions (all when None) in the compute dtype."""
        self.write(input_pos, k, v)
        k_all, v_all = (self.k, self.v) if attend_len is None else (self.k[:, :, :attend_len], self.v[:, :, :attend_len])
        if self.kind is None:
            return k_all, v_all
        return decode(k_all, self.k_scale, self.dtype), decode(v_all, self.v_scale, self.dtype)
