"""Activation, KV-cache and FP8 quantization primitives (fake-quant: quantize then dequantize).

Integer activations are symmetric int8 on [−127, 127] with `s = absmax / 127` (the
convention of SmoothQuant, TensorRT-LLM and PaddleNLP scale tables); FP8 is e4m3 with
`s = absmax / 448`. Per-token scales are computed on the fly (dynamic); per-tensor scales
come from calibration (static) or on the fly.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
# Codes saturate on the full int8 range: the scale maps absmax to 127, but a value beyond the
# calibrated range clips to −128 on the negative side, as a saturating int8 cast does in the
# engines (compressed-tensors' and TensorRT-LLM's input quantizers, CUDA cvt.sat.s8).
INT8_MIN = -128.0
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


def qmax_of(kind: str) -> float:
    return INT8_MAX if kind == "int8" else FP8_MAX


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What tensors of `dtype` are quantized, dequantized and softmaxed in: float32, or float64
    for float64 (a float64 comparison of two implementations must not round through float32
    anywhere)."""
    return torch.promote_types(dtype, torch.float32)


def scale_from_absmax(absmax: torch.Tensor, kind: str) -> torch.Tensor:
    return (absmax.to(compute_dtype(absmax.dtype)) / qmax_of(kind)).clamp(min=1e-10)


def fake_quant(x: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """Quantize-dequantize `x` with a broadcastable `scale` to int8 or fp8 e4m3."""
    ct = compute_dtype(x.dtype)
    y = x.to(ct) / scale
    if kind == "int8":
        q = torch.clamp(torch.round(y), INT8_MIN, INT8_MAX)
    else:
        q = torch.clamp(y, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(ct)
    return (q * scale).to(x.dtype)


def per_token_absmax(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax(dim=-1, keepdim=True)


def fake_quant_dynamic_per_token(x: torch.Tensor, kind: str) -> torch.Tensor:
    return fake_quant(x, scale_from_absmax(per_token_absmax(x), kind), kind)


def fake_quant_per_tensor(x: torch.Tensor, absmax: torch.Tensor | float | None, kind: str) -> torch.Tensor:
    """Static when `absmax` comes from calibration; dynamic when it is None."""
    amax = x.abs().amax() if absmax is None else torch.as_tensor(absmax, dtype=torch.float32, device=x.device)
    return fake_quant(x, scale_from_absmax(amax, kind), kind)


def quantize_fp8_weight(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 codes and scales (`[out, 1]` per channel or `[1]` per tensor)."""
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    scale = scale_from_absmax(amax, "fp8")
    codes = torch.clamp(w.float() / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def quantize_int8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel symmetric int8 on [−127, 127] (the A8W8 weight convention)."""
    scale = scale_from_absmax(w.abs().amax(dim=1, keepdim=True), "int8")
    return torch.clamp(torch.round(w.float() / scale), -INT8_MAX, INT8_MAX).to(torch.int8), scale


def fake_quant_activation(x: torch.Tensor, scheme, absmax: torch.Tensor | float | None = None) -> torch.Tensor:
    """Quantize-dequantize a Linear input as `scheme` (an `ActivationScheme`) deploys it:
    per-token dynamic, per-tensor dynamic, or per-tensor static with the calibrated `absmax`."""
    if scheme.granularity == "token":
        return fake_quant_dynamic_per_token(x, scheme.kind)
    if not scheme.dynamic and absmax is None:
        raise ValueError("static activation quantization needs a calibrated absmax")
    return fake_quant_per_tensor(x, None if scheme.dynamic else absmax, scheme.kind)
