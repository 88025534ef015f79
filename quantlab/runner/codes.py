"""8-bit codes exactly as fake-quant evaluation computes them, split into encode and decode.

`quantlab.quant.activations.fake_quant` rounds `x / s` to int8 (or casts it to FP8 e4m3) and
multiplies back. The runner stores those codes (K/V cache) or feeds them to the GEMM kernels
(Linear inputs), so it encodes with the same scale rule (`scale_from_absmax`) and the same
rounding: what the runner computes is what perplexity under fake quantization measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantlab.kernels import ops
from quantlab.quant.activations import FP8_MAX, INT8_MAX, INT8_MIN, compute_dtype, scale_from_absmax

STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def encode(x: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """`x / scale` as int8 codes on [−128, 127] or FP8 e4m3 codes (saturating)."""
    y = x.to(compute_dtype(x.dtype)) / scale
    if kind == "int8":
        return torch.clamp(torch.round(y), INT8_MIN, INT8_MAX).to(torch.int8)
    return torch.clamp(y, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def decode(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.to(compute_dtype(dtype)) * scale).to(dtype)


@dataclass(frozen=True)
class InputQuant:
    """How one Linear's input is quantized (an `ActivationScheme` bound to its calibrated range).

    `per_token`: one scale per row, computed on the fly; else one per tensor, from `absmax`
    (static) or from the tensor itself (dynamic)."""

    kind: str  # "int8" | "fp8"
    per_token: bool
    absmax: torch.Tensor | None = None

    def to(self, device: torch.device) -> "InputQuant":
        """The same scheme with its static range on `device` (no copies inside a CUDA graph)."""
        absmax = None if self.absmax is None else self.absmax.to(device=device, dtype=torch.float32)
        return InputQuant(self.kind, self.per_token, absmax)

    def quantize(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x2 [M, K]` → codes `[M, K]` and scales `[M]` (per token) or `[1]`. On a GPU one
        Triton launch (`ops.quantize_rows`, bit-identical), compiled or not: Inductor's fusion
        of the torch ops divides with approximate division, which can move a code. Not under
        the CPU interpreter: one program per row is far too slow there, and its e4m3 cast is
        wrong (tests call the int8 kernel directly)."""
        if (self.per_token or self.absmax is not None) and x2.shape[0] and x2.is_cuda \
                and x2.stride(-1) == 1 and ops.use_triton(x2):
            return ops.quantize_rows(x2, self.kind, None if self.per_token else self.absmax)
        return self.quantize_torch(x2)

    def quantize_torch(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`quantize` in torch ops: the CPU path and the kernel's reference."""
        if self.per_token:
            amax = x2.to(compute_dtype(x2.dtype)).abs().amax(dim=-1)
        elif self.absmax is None:
            amax = x2.to(compute_dtype(x2.dtype)).abs().amax().reshape(1)
        else:
            amax = self.absmax.reshape(1)
        scale = scale_from_absmax(amax, self.kind)
        return encode(x2, scale.reshape(-1, 1) if self.per_token else scale, self.kind), scale

    def fake(self, x: torch.Tensor) -> torch.Tensor:
        """Quantize-dequantize `x [..., K]` (for weight backends without an 8-bit-input kernel)."""
        x2 = x.reshape(-1, x.shape[-1])
        codes, scale = self.quantize(x2)
        return decode(codes, scale.reshape(-1, 1) if self.per_token else scale, x.dtype).reshape(x.shape)

    def same_as(self, other: "InputQuant | None") -> bool:
        """Whether two Linears quantize a shared input identically (so they can be fused)."""
        if other is None or (self.kind, self.per_token) != (other.kind, other.per_token):
            return False
        if self.absmax is None or other.absmax is None:
            return self.absmax is None and other.absmax is None
        return bool(torch.equal(self.absmax.float().cpu(), other.absmax.float().cpu()))
