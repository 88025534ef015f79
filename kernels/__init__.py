"""GEMM and decode-attention kernels for the runner (installed as `quantlab.kernels`).

Packed layouts and repacking from quantlab's canonical form (`layout`), torch reference
paths (`reference`; the runner's own torch attention for `triton_attention`), Triton kernels
(`triton_wna16`, `triton_scaled`, `triton_act`, `triton_attention`, with the split-K reduction
the GEMMs share in `split_k`; `gluon_wna16`, W4A16 at small M on Hopper in Triton's Gluon;
imported lazily: this package imports without triton or a GPU)
and the dispatching entry points (`ops`), with what the kernels share with it in `common`.
"""

from quantlab.kernels.layout import (
    BLOCK_K,
    PackedFP8,
    PackedW8A8,
    PackedWNA16,
    dequantize_wna16,
    pack_fp8,
    pack_w8a8,
    pack_wna16,
    quantize_fp8_weight,
    quantize_int8_weight,
)
from quantlab.kernels.ops import (
    fp8_linear,
    fp8_mm,
    triton_installed,
    use_triton,
    w8a8_linear,
    w8a8_mm,
    wna16_linear,
)
from quantlab.kernels.reference import quantize_act_fp8, quantize_act_int8

__all__ = [
    "BLOCK_K", "PackedFP8", "PackedW8A8", "PackedWNA16", "dequantize_wna16", "pack_fp8",
    "pack_w8a8", "pack_wna16", "quantize_fp8_weight", "quantize_int8_weight", "fp8_linear",
    "fp8_mm", "triton_installed", "use_triton", "w8a8_linear", "w8a8_mm", "wna16_linear",
    "quantize_act_fp8", "quantize_act_int8",
]
