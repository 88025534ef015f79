"""Dispatch: Triton kernels on a CUDA GPU (or under TRITON_INTERPRET=1), torch reference
otherwise. This module imports no triton at import time, so `quantlab.kernels` loads on a
CPU-only machine without triton installed."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from quantlab.kernels import reference
from quantlab.kernels.layout import PackedFP8, PackedW8A8, PackedWNA16


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor, min_capability: tuple[int, int] = (8, 0)) -> bool:
    """Whether a tensor on this device should go through the Triton kernels."""
    if not triton_installed():
        return False
    if t.device.type == "cuda":
        return torch.cuda.get_device_capability(t.device) >= min_capability
    return t.device.type == "cpu" and interpret_mode()


def _flat(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    lead = tuple(x.shape[:-1])
    x2 = x.reshape(-1, x.shape[-1])
    return (x2 if x2.stride(-1) == 1 else x2.contiguous()), lead


def wna16_linear(x: torch.Tensor, p: PackedWNA16, bias: torch.Tensor | None = None,
                 impl: str = "auto") -> torch.Tensor:
    """`x [..., K]` (bf16/fp16) @ Wᵀ for packed W4A16 / W8A16 weights."""
    x2, lead = _flat(x)
    if p.kernel_ok and use_triton(x2):
        from quantlab.kernels.triton_wna16 import wna16_matmul

        y = wna16_matmul(x2, p, impl=impl)
    else:
        y = reference.wna16_mm(x2, p)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, p.out_features)


def w8a8_mm(xq: torch.Tensor, sx: torch.Tensor, p: PackedW8A8,
            out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    if use_triton(xq, (9, 0)) and xq.shape[1] % 16 == 0:
        from quantlab.kernels.triton_scaled import w8a8_matmul

        return w8a8_matmul(xq, sx, p, out_dtype)
    return reference.w8a8_mm(xq, sx, p, out_dtype)


def fp8_mm(xq: torch.Tensor, sx: torch.Tensor, p: PackedFP8,
           out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    if use_triton(xq, (9, 0)) and xq.shape[1] % 16 == 0:
        from quantlab.kernels.triton_scaled import fp8_matmul

        return fp8_matmul(xq, sx, p, out_dtype)
    return reference.fp8_mm(xq, sx, p, out_dtype)


def w8a8_linear(x: torch.Tensor, p: PackedW8A8, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dynamic per-token int8 activations × int8 weights (SmoothQuant-style A8W8)."""
    x2, lead = _flat(x)
    xq, sx = reference.quantize_act_int8(x2)
    y = w8a8_mm(xq, sx, p, x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, p.w.shape[0])


def fp8_linear(x: torch.Tensor, p: PackedFP8, bias: torch.Tensor | None = None,
               per_token: bool = True) -> torch.Tensor:
    """Dynamic FP8 activations (per token or per tensor) × FP8 weights."""
    x2, lead = _flat(x)
    xq, sx = reference.quantize_act_fp8(x2, per_row=per_token)
    y = fp8_mm(xq, sx, p, x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, p.w.shape[0])
