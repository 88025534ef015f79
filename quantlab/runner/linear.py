"""Linear backends, one per weight scheme, built from canonical `QuantizedWeight`s.

| weights (canonical)               | inputs            | backend                                  |
|-----------------------------------|-------------------|------------------------------------------|
| float                             | float             | `DenseLinear` (F.linear)                 |
| int 4/8-bit, any group, act-order | float             | `WNA16Linear` (quantlab.kernels W4A16/W8A16) |
| int 8-bit per channel             | int8              | `W8A8Linear` (int8 × int8 GEMM)          |
| FP8 e4m3                          | FP8               | `FP8Linear` (FP8 × FP8 GEMM)             |
| anything else (2/3-bit, W4A8, …)  | float or 8-bit    | dequantized `DenseLinear`, `QuantInput` in front |

On a CUDA GPU the packed forms go through the Triton kernels (bf16/fp16 activations); on CPU
(and in float32) the kernels' torch reference computes the same thing — for WNA16 the weight is
dequantized from the packed layout once and kept, which is what the reference does per call.
Linears that read the same input (q/k/v, gate/up) are fused into one GEMM when their backends
allow (`fuse`), as gpt-fast does: fewer, larger GEMMs per decode step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantlab.kernels import PackedFP8, PackedW8A8, PackedWNA16, pack_fp8, pack_w8a8, pack_wna16
from quantlab.kernels import ops, reference
from quantlab.kernels.layout import dequantize_wna16
from quantlab.quant.primitives import QuantizedWeight
from quantlab.runner.codes import InputQuant

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def _kernels_for(x: torch.Tensor, min_capability: tuple[int, int] = (8, 0)) -> bool:
    """The Triton kernels take bf16/fp16 activations on a capable GPU; else the torch reference."""
    return x.dtype in KERNEL_DTYPES and ops.use_triton(x, min_capability)


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


class DenseLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class WNA16Linear(nn.Module):
    """Weight-only int4 / int8 (any group size, GPTQ act-order) on float activations."""

    def __init__(self, packed: PackedWNA16, bias: torch.Tensor | None = None):
        super().__init__()
        self.packed = packed
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features = packed.out_features
        self._dense: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed.kernel_ok and _kernels_for(x):
            return ops.wna16_linear(x, self.packed, self.bias)
        if self._dense is None or self._dense.dtype != x.dtype:
            self._dense = dequantize_wna16(self.packed).to(device=x.device, dtype=x.dtype)
        return F.linear(x, self._dense, self.bias)


class _ScaledLinear(nn.Module):
    """8-bit weights × 8-bit inputs in one scaled GEMM; subclasses name the kernel pair."""

    kernel = staticmethod(ops.w8a8_mm)
    fallback = staticmethod(reference.w8a8_mm)

    def __init__(self, packed: PackedW8A8 | PackedFP8, act: InputQuant, bias: torch.Tensor | None = None):
        super().__init__()
        self.packed, self.act = packed, act
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features = packed.w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        xq, sx = self.act.quantize(x2)
        mm = self.kernel if _kernels_for(x, (9, 0)) else self.fallback
        y = mm(xq, sx, self.packed, x.dtype)
        return _add_bias(y, self.bias).reshape(*x.shape[:-1], self.out_features)


class W8A8Linear(_ScaledLinear):
    """int8 weights (per channel) × int8 inputs (per token or per tensor), one integer GEMM."""


class FP8Linear(_ScaledLinear):
    """FP8 e4m3 weights (per channel or tensor) × FP8 inputs (per token or per tensor)."""

    kernel = staticmethod(ops.fp8_mm)
    fallback = staticmethod(reference.fp8_mm)


class QuantInput(nn.Module):
    """Quantize-dequantize the input, then any weight backend: the combinations no fused kernel
    covers (W4A8, FP8 weights with int8 inputs, …) still compute what fake quant computes."""

    def __init__(self, inner: nn.Module, act: InputQuant):
        super().__init__()
        self.inner, self.act = inner, act
        self.out_features = inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.act.fake(x))


class Concat(nn.Module):
    """Linears on one input that could not be fused: run each, concatenate the outputs."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


# ---------------------------------------------------------------------------------------------
# Building


def build_linear(weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None, act: InputQuant | None,
                 dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The backend for one Linear: a float weight `[out, in]` or a canonical QuantizedWeight,
    with `act` when the canonical form quantizes its input."""
    bias = None if bias is None else bias.to(device=device, dtype=dtype)
    act = None if act is None else act.to(device)
    if not isinstance(weight, QuantizedWeight):
        return _with_input(DenseLinear(weight.to(device=device, dtype=dtype), bias), act)
    qw = QuantizedWeight(weight.codes.to(device), weight.scales.to(device), weight.zeros.to(device),
                         weight.g_idx.to(device), weight.scheme)
    scheme = qw.scheme
    if scheme.type == "float" and act is not None and act.kind == "fp8":
        return FP8Linear(pack_fp8(qw), act, bias)
    if scheme.type == "int" and scheme.bits == 8 and qw.scales.shape[1] == 1 and act is not None and act.kind == "int8":
        return W8A8Linear(pack_w8a8(qw), act, bias)
    return _with_input(_weight_only(qw, bias, dtype), act)


def _weight_only(qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Module:
    if qw.scheme.type == "int" and qw.scheme.bits in (4, 8):
        try:
            # float32 runners keep the canonical scales exactly; bf16/fp16 use the kernels' default
            scale_dtype = torch.float32 if dtype == torch.float32 else None
            return WNA16Linear(pack_wna16(qw, dtype if dtype in KERNEL_DTYPES else torch.bfloat16, scale_dtype), bias)
        except ValueError:  # a g_idx no column permutation explains: dequantize instead
            pass
    return DenseLinear(qw.dequantize().to(dtype), bias)


def _with_input(backend: nn.Module, act: InputQuant | None) -> nn.Module:
    return backend if act is None else QuantInput(backend, act)


def fuse(parts: list[nn.Module]) -> nn.Module:
    """One backend computing `cat([p(x) for p in parts], -1)` with a single GEMM when the parts
    have the same backend and settings; `Concat` otherwise."""
    kinds = {type(p) for p in parts}
    if len(parts) == 1:
        return parts[0]
    if len(kinds) == 1:
        fused = _FUSERS.get(kinds.pop(), lambda _: None)(parts)
        if fused is not None:
            return fused
    return Concat(parts)


def _cat_bias(parts: list[nn.Module]) -> torch.Tensor | None:
    if all(p.bias is None for p in parts):
        return None
    ref = next(p.bias for p in parts if p.bias is not None)
    return torch.cat([p.bias if p.bias is not None else ref.new_zeros(p.out_features) for p in parts])


def _fuse_dense(parts: list[DenseLinear]) -> nn.Module:
    return DenseLinear(torch.cat([p.weight for p in parts]), _cat_bias(parts))


def _fuse_wna16(parts: list[WNA16Linear]) -> nn.Module | None:
    ps = [p.packed for p in parts]
    first = ps[0]
    same = all((p.bits, p.group_size, p.in_features, p.scales.dtype) ==
               (first.bits, first.group_size, first.in_features, first.scales.dtype) and p.perm is None for p in ps)
    if not same:
        return None  # act-order columns are permuted per Linear: no shared input order
    packed = PackedWNA16(torch.cat([p.qweight for p in ps], 1), torch.cat([p.scales for p in ps], 1),
                         torch.cat([p.zeros for p in ps], 1), first.bits, first.group_size, first.in_features,
                         sum(p.out_features for p in ps))
    return WNA16Linear(packed, _cat_bias(parts))


def _fuse_w8a8(parts: list[W8A8Linear]) -> nn.Module | None:
    if not all(p.act.same_as(parts[0].act) for p in parts):
        return None
    ps = [p.packed for p in parts]
    zc = None
    if any(p.zc is not None for p in ps):
        zc = torch.cat([p.zc if p.zc is not None else torch.zeros_like(p.scale, dtype=torch.int32) for p in ps])
    packed = PackedW8A8(torch.cat([p.w for p in ps]), torch.cat([p.scale for p in ps]), zc)
    return W8A8Linear(packed, parts[0].act, _cat_bias(parts))


def _fuse_fp8(parts: list[FP8Linear]) -> nn.Module | None:
    if not all(p.act.same_as(parts[0].act) for p in parts):
        return None
    ps = [p.packed for p in parts]
    scale = torch.cat([p.scale.float().expand(p.w.shape[0]) for p in ps])  # per-tensor → per-row
    return FP8Linear(PackedFP8(torch.cat([p.w for p in ps]), scale.contiguous()), parts[0].act, _cat_bias(parts))


_FUSERS = {DenseLinear: _fuse_dense, WNA16Linear: _fuse_wna16, W8A8Linear: _fuse_w8a8, FP8Linear: _fuse_fp8}


def weight_bytes(module: nn.Module) -> int:
    """Bytes of weights a forward reads (packed codes, scales, zeros, floats): for bandwidth."""
    total = 0
    for m in module.modules():
        packed = getattr(m, "packed", None)
        if packed is not None:
            total += sum(t.numel() * t.element_size() for t in vars(packed).values() if isinstance(t, torch.Tensor))
        if isinstance(m, DenseLinear):
            total += m.weight.numel() * m.weight.element_size()
    return total
