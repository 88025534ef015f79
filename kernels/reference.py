"""Torch reference paths for every kernel: the test oracle, and the fallback where Triton or a
suitable GPU is missing. They compute from the packed form in float32 (float64 for float64
inputs; int8 products are summed in float64 on the CPU, exactly), so they check the kernels,
not the quantization (that is quantlab.quant's job)."""

from __future__ import annotations

import torch

from quantlab.kernels.layout import PackedFP8, PackedW8A8, PackedWNA16, dequantize_wna16
from quantlab.quant.activations import compute_dtype

INT8_MAX = 127.0
FP8_MAX = 448.0


def quantize_act_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token symmetric int8: codes `[M, K]` int8 and scales `[M]` f32 (f64 for f64 x)."""
    xc = x.to(compute_dtype(x.dtype))
    s = (xc.abs().amax(dim=-1) / INT8_MAX).clamp(min=1e-10)
    q = torch.clamp(torch.round(xc / s[..., None]), -INT8_MAX, INT8_MAX).to(torch.int8)
    return q, s


def quantize_act_fp8(x: torch.Tensor, per_row: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 e4m3 with `s = absmax / 448` per token (`[M]`) or per tensor (`[1]`)."""
    xc = x.to(compute_dtype(x.dtype))
    amax = xc.abs().amax(dim=-1) if per_row else xc.abs().amax().reshape(1)
    s = (amax / FP8_MAX).clamp(min=1e-10)
    sb = s[..., None] if per_row else s
    q = torch.clamp(xc / sb, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s


def wna16_mm(x: torch.Tensor, p: PackedWNA16) -> torch.Tensor:
    """`x [..., K] @ W.T` with W dequantized from the packed layout; output in x's dtype."""
    w = dequantize_wna16(p).to(x.device)
    return (x.float() @ w.t()).to(x.dtype)


def w8a8_mm(xq: torch.Tensor, sx: torch.Tensor, p: PackedW8A8,
            out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """int8 `xq [M, K]` (per-token scale `sx [M]`) × int8 W: exact integer sum, then scales."""
    dt = torch.float64 if xq.device.type == "cpu" else torch.float32
    acc = xq.to(dt) @ p.w.to(dt).t()
    if p.zc is not None:
        acc = acc - xq.to(dt).sum(-1, keepdim=True) * p.zc.to(dt)
    return (acc * sx.to(dt).reshape(-1, 1) * p.scale.to(dt)).to(out_dtype)


def fp8_mm(xq: torch.Tensor, sx: torch.Tensor, p: PackedFP8,
           out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8 `xq [M, K]` (scale `[M]` or `[1]`) × FP8 W (scale `[N]` or `[1]`), accumulated in
    float32 as the fake-quant model's float32 matmul is (float64 for a float64 output)."""
    dt = compute_dtype(out_dtype)
    acc = xq.to(dt) @ p.w.to(dt).t()
    sa = sx.to(dt).reshape(-1, 1) if sx.numel() > 1 or xq.shape[0] == 1 else sx.to(dt)
    return (acc * sa * p.scale.to(dt)).to(out_dtype)
