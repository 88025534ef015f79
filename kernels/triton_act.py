"""Triton kernel for 8-bit activation quantization, row by row (per-token dynamic scales, or one
static scale): the W8A8 and FP8 Linears' input in one launch instead of the seven to nine torch
ops of `quantlab.runner.codes` (abs, amax, divide, clamp, round or cast: 116 µs of host time
per Linear at M = 512 on the H200 machine, where an eager prefill is host-bound; for FP8 the
torch ops were 39 % of a 512-token prefill's kernel time, `benchmarks/decode.py
--profile-prefill`). Imported lazily: needs triton.

The codes and scales are bit-identical to the torch path on the same device — what fake
quantization measured there: `s = max(absmax / 127, 1e-10)`, which torch computes as an IEEE
division on the CPU but as a multiply by the float32 reciprocal on CUDA (a tensor divided by a
Python scalar; 4.5% of random absmax values get another last bit), then `x / s` in IEEE float32
(`div_rn`; Triton's `/` is the approximate `div.full.f32`), rounded half to even (adding and
subtracting 1.5·2²³, exact for |y| < 2²²) and clamped to [−128, 127]. FP8 codes are `x / s`
clamped to ±448 and cast to e4m3 with round-to-nearest-even, as torch's CUDA cast does; the
Triton interpreter's float32 → e4m3 cast is wrong (−128 came out as −64), so the FP8 kernel is
used, and checked bit-identical, on GPUs only (tests/test_kernels.py).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5·2^23: y + M − M rounds y to an integer, half to even
INV_127 = tl.constexpr(float(np.float32(1.0) / np.float32(127.0)))  # torch CUDA's `t / 127.0`
INV_448 = tl.constexpr(float(np.float32(1.0) / np.float32(448.0)))  # and `t / 448.0`
BLOCK = 1024


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, absmax_ptr, K, stride_x, stride_q,
                          STATIC: tl.constexpr, RECIP: tl.constexpr, FP8: tl.constexpr, BLOCK: tl.constexpr):
    """One row per program: its absmax (or the static one), the scale, then the codes."""
    row = tl.program_id(0).to(tl.int64)  # rows × K passes 2³¹ at prefill sizes (131072 × 18944)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    if STATIC:
        amax = tl.load(absmax_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            v = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        amax = tl.max(amax, axis=0)
    if FP8:
        if RECIP:
            scale = tl.maximum(amax * INV_448, 1e-10)
        else:
            scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1e-10)
    elif RECIP:
        scale = tl.maximum(amax * INV_127, 1e-10)
    else:
        scale = tl.maximum(tl.math.div_rn(amax, 127.0), 1e-10)
    if STATIC:
        if row == 0:
            tl.store(s_ptr, scale)
    else:
        tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        v = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        if FP8:
            y = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0)
            code = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        else:
            r = (tl.math.div_rn(v, scale) + RNE_MAGIC) - RNE_MAGIC
            code = tl.minimum(tl.maximum(r, -128.0), 127.0).to(tl.int8)
        tl.store(q_ptr + row * stride_q + k0 + offs, code, mask=mask)


CODES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def quantize_rows(x: torch.Tensor, kind: str = "int8", absmax: torch.Tensor | None = None,
                  launch=lambda kernel: kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [M, K]` (M > 0) → int8 or FP8 e4m3 codes `[M, K]` and float32 scales: `[M]` from
    each row's absmax, or `[1]` from the static `absmax`. `launch` wraps the kernel
    (`torch.library.wrap_triton` inside a `triton_op`, so Inductor launches it itself)."""
    assert x.dim() == 2 and x.stride(1) == 1
    m, k = x.shape
    static = absmax is not None
    q = torch.empty(m, k, dtype=CODES[kind], device=x.device)
    s = torch.empty(1 if static else m, dtype=torch.float32, device=x.device)
    launch(_quantize_rows_kernel)[(m,)](x, q, s, absmax if static else s, k, x.stride(0), q.stride(0),
                                        STATIC=static, RECIP=x.is_cuda, FP8=kind == "fp8",
                                        BLOCK=min(BLOCK, triton.next_power_of_2(k)), num_warps=4)
    return q, s


@torch.library.triton_op("quantlab::quantize_rows", mutates_args=())
def quantize_rows_op(x: torch.Tensor, kind: str, absmax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` as an op torch.compile traces into: Inductor launches the kernel itself."""
    return quantize_rows(x, kind, absmax, launch=torch.library.wrap_triton)
