"""Dispatch: Triton kernels on a CUDA GPU (or under TRITON_INTERPRET=1), torch reference
otherwise. This module imports no triton at import time, so `quantlab.kernels` loads on a
CPU-only machine without triton installed."""

from __future__ import annotations

import torch

from quantlab.kernels import reference
from quantlab.kernels.common import (  # noqa: F401  (also reached as ops.<name>)
    FLUSH_BYTES,
    Epilogue,
    PdlTrigger,
    autotune_bench,
    autotuner_ranking,
    bench_cold,
    capture_graph,
    cuda_capability,
    fastest,
    flush_l2,
    graph_replay,
    interleaved_rounds,
    interpret_mode,
    pdl_launch,
    pdl_on,
    pdl_requested,
    retime_top,
    sm_count,
    triton_installed,
    use_triton,
)
from quantlab.kernels.layout import PackedFP8, PackedW8A8, PackedWNA16


def _flat(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    lead = tuple(x.shape[:-1])
    x2 = x.reshape(-1, x.shape[-1])
    return (x2 if x2.stride(-1) == 1 else x2.contiguous()), lead


# The Triton launches as torch custom ops: torch.compile (the runner's decode="compile") then
# treats each GEMM as one opaque node instead of tracing into the autotuner's Python. Eager
# calls skip the op's dispatch: it cost 40–75 µs of host time per call on the H200 machine
# (W4A16 at M = 512: 137 µs through the op against 61 µs direct), and an eager 512-token
# prefill is host-bound (`_wna16_mm`, `_scaled_mm`).


@torch.library.custom_op("quantlab::wna16_mm", mutates_args=())
def _wna16_mm_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 perm: torch.Tensor | None, bits: int, group_size: int, in_features: int, out_features: int,
                 impl: str) -> torch.Tensor:
    return _wna16_direct(x, qweight, scales, zeros, perm, bits, group_size, in_features, out_features, impl)


@_wna16_mm_op.register_fake
def _(x, qweight, scales, zeros, perm, bits, group_size, in_features, out_features, impl):
    return x.new_empty(x.shape[0], out_features)


@torch.library.custom_op("quantlab::scaled_mm", mutates_args=())
def _scaled_mm_op(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                  zc: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    return _scaled_direct(xq, sx, w, scale, zc, out_dtype)


@_scaled_mm_op.register_fake
def _(xq, sx, w, scale, zc, out_dtype):
    return xq.new_empty(xq.shape[0], w.shape[0], dtype=out_dtype)


@torch.library.custom_op("quantlab::decode_attention", mutates_args=())
def _decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         pos: torch.Tensor, k_scale: torch.Tensor | None,
                         v_scale: torch.Tensor | None) -> torch.Tensor:
    return _decode_attention_direct(q, k, v, mask, pos, k_scale, v_scale)


@_decode_attention_op.register_fake
def _(q, k, v, mask, pos, k_scale, v_scale):
    return torch.empty_like(q)


def _decode_attention_direct(q, k, v, mask, pos, k_scale, v_scale):
    from quantlab.kernels.triton_attention import decode_attention as kernel

    return kernel(q, k, v, mask, pos, k_scale, v_scale)


@torch.library.custom_op("quantlab::attention_partials", mutates_args=())
def _partials_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                 start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _partials_direct(q, k, v, pos, start)


@_partials_op.register_fake
def _(q, k, v, pos, start):
    from quantlab.kernels.triton_attention import partials_shape

    shape = partials_shape(q, k)
    return (q.new_empty(shape[:3], dtype=torch.float32), q.new_empty(shape[:3], dtype=torch.float32),
            q.new_empty(shape, dtype=torch.float32))


def _partials_direct(q, k, v, pos, start):
    from quantlab.kernels.triton_attention import attention_partials

    return tuple(attention_partials(q, k, v, None, pos, start))


def decode_attention_ok(q: torch.Tensor) -> bool:
    """Whether the Triton decode-attention kernel takes `q [B, H, D]` here (D a power of two)."""
    d = q.shape[-1]
    return use_triton(q) and d >= 16 and d & (d - 1) == 0


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     pos: torch.Tensor, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query per row over the static KV cache (`triton_attention.decode_attention`); the
    caller checks `decode_attention_ok` and keeps its torch path otherwise."""
    fn = _decode_attention_op if torch.compiler.is_compiling() else _decode_attention_direct
    return fn(q, k, v, mask, pos, k_scale, v_scale)


def attention_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                       start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decode attention's first launch over a compute-dtype cache, keys from `start[b]`
    to the step's (`triton_attention.attention_partials`, no mask): `(m, l, acc)` for an
    o_proj GEMV that combines them (`wna16_gemv_epilogue(partials, ...)`)."""
    fn = _partials_op if torch.compiler.is_compiling() else _partials_direct
    return fn(q, k, v, pos, start)


def quantize_rows(x: torch.Tensor, kind: str, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit codes and scales of `x [M, K]` in one Triton launch (`triton_act.quantize_rows`):
    per row, or with the one static `absmax`. Under torch.compile the `triton_op`
    `quantlab::quantize_rows` (`register_compiled_ops`): Inductor launches this kernel from its
    own code (no custom-op dispatch, 40–75 µs of host time a call), so a compiled forward
    quantizes bit for bit as the eager one does — Inductor's fusion of the torch ops would
    divide with approximate division, which can move a code."""
    if torch.compiler.is_compiling():
        return torch.ops.quantlab.quantize_rows(x, kind, absmax)
    from quantlab.kernels.triton_act import quantize_rows as kernel

    return kernel(x, kind, absmax)


def register_compiled_ops() -> None:
    """Register the `triton_op`s torch.compile traces into (they live with their kernels and
    import triton, which this module does not) before a compiled function first runs."""
    if triton_installed():
        import quantlab.kernels.triton_act  # noqa: F401


def _wna16_direct(x, qweight, scales, zeros, perm, bits, group_size, in_features, out_features, impl):
    from quantlab.kernels.triton_wna16 import wna16_matmul

    p = PackedWNA16(qweight, scales, zeros, bits, group_size or None, in_features, out_features, perm)
    return wna16_matmul(x, p, impl=impl)


def _scaled_direct(xq, sx, w, scale, zc, out_dtype):
    from quantlab.kernels import triton_scaled

    if w.dtype == torch.int8:
        return triton_scaled.w8a8_matmul(xq, sx, PackedW8A8(w, scale, zc), out_dtype)
    return triton_scaled.fp8_matmul(xq, sx, PackedFP8(w, scale), out_dtype)


def _wna16_mm(*args) -> torch.Tensor:
    """The custom op while torch.compile traces, else its implementation called directly."""
    return (_wna16_mm_op if torch.compiler.is_compiling() else _wna16_direct)(*args)


def _scaled_mm(*args) -> torch.Tensor:
    """As `_wna16_mm`, for the scaled int8 / FP8 GEMM."""
    return (_scaled_mm_op if torch.compiler.is_compiling() else _scaled_direct)(*args)


def wna16_linear(x: torch.Tensor, p: PackedWNA16, bias: torch.Tensor | None = None,
                 impl: str = "auto") -> torch.Tensor:
    """`x [..., K]` (bf16/fp16) @ Wᵀ for packed W4A16 / W8A16 weights."""
    x2, lead = _flat(x)
    if p.kernel_ok and use_triton(x2):
        y = _wna16_mm(x2, p.qweight, p.scales, p.zeros, p.perm, p.bits, p.group_constexpr,
                      p.in_features, p.out_features, impl)
    else:
        y = reference.wna16_mm(x2, p)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, p.out_features)


# GEMV epilogues (`gemv_epilogue`): the batch-1 decode step's layer as four GEMVs and the
# attention. One custom op for the three kinds; what it writes besides its outputs (the KV
# cache) is declared mutated.


@torch.library.custom_op("quantlab::wna16_gemv_epilogue", mutates_args=("k_cache", "v_cache"))
def _epilogue_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bits: int, group_size: int, in_features: int, out_features: int, kind: int,
                 row: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor | None,
                 sin: torch.Tensor | None, pos: torch.Tensor | None, k_cache: torch.Tensor | None,
                 v_cache: torch.Tensor | None, nq: int, nkv: int, attn_m: torch.Tensor | None,
                 attn_l: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return _epilogue_direct(x, qweight, scales, zeros, bits, group_size, in_features, out_features, kind,
                            row, weight, eps, cos, sin, pos, k_cache, v_cache, nq, nkv, attn_m, attn_l)


def _epilogue_outputs(row: torch.Tensor, kind: int, out_features: int, weight: torch.Tensor | None,
                      nq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty outputs of an epilogue GEMV, always two (Inductor takes no list outputs from a
    mutating op): RESIDUAL `(y, y·w)` (the second empty without w), RMS_SWIGLU `(act, —)`
    (half the columns), RMS_ROPE_CACHE `(q, —)`."""
    if kind == Epilogue.RESIDUAL:
        return row.new_empty(1, out_features), row.new_empty(1, out_features if weight is not None else 0)
    return row.new_empty(1, out_features // 2 if kind == Epilogue.RMS_SWIGLU else nq), row.new_empty(0)


@_epilogue_op.register_fake
def _(x, qweight, scales, zeros, bits, group_size, in_features, out_features, kind, row, weight, eps, cos,
      sin, pos, k_cache, v_cache, nq, nkv, attn_m, attn_l):
    return _epilogue_outputs(row, kind, out_features, weight, nq)


def _epilogue_direct(x, qweight, scales, zeros, bits, group_size, in_features, out_features, kind, row,
                     weight, eps, cos, sin, pos, k_cache, v_cache, nq, nkv, attn_m, attn_l):
    from quantlab.kernels.triton_attention import Partials, prologue_args
    from quantlab.kernels.triton_wna16 import wna16_gemv_epilogue

    p = PackedWNA16(qweight, scales, zeros, bits, group_size or None, in_features, out_features)
    outs = _epilogue_outputs(row, kind, out_features, weight, nq)
    args: dict = dict(EPI=kind, e_row_ptr=row, e_w_ptr=weight, e_eps=eps)
    if attn_m is not None:  # x: the partials' values; the GEMV forms its own input row
        args.update(prologue_args(Partials(attn_m, attn_l, x), in_features // x.shape[-1]))
        x = row.new_empty(1, in_features)
    if kind == Epilogue.RESIDUAL:
        args["e_y2_ptr"] = outs[1] if weight is not None else None
    elif kind == Epilogue.RMS_ROPE_CACHE:
        args.update(HEAD_D=k_cache.shape[-1], e_cos_ptr=cos, e_sin_ptr=sin, e_pos_ptr=pos, e_kc_ptr=k_cache,
                    e_vc_ptr=v_cache, e_nq=nq, e_nkv=nkv, e_cache_s=k_cache.shape[-2])
    wna16_gemv_epilogue(x, p, outs[0], args)
    return outs


def wna16_gemv_epilogue(x: torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor], p: PackedWNA16,
                        kind: int, row: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 0.0,
                        rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                        cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                        nq: int = 0, nkv: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's GEMV with an epilogue (`gemv_epilogue`) on one token row `x [1, K]`, or
    on the attention output that the GEMV combines from `x = attention_partials(...)`: `row`
    is the residual (RESIDUAL) or the row whose 1/rms scales the product; `weight` the next
    norm's weight (RESIDUAL) or the bias (RMS_ROPE_CACHE); `rope` the cos/sin tables and the
    position, `cache` the KV caches of one row (`[KV heads, S, D]`). The caller checks that
    the Triton kernels run here (`use_triton`) and that the GEMV takes `p`."""
    cos, sin, pos = rope if rope is not None else (None, None, None)
    k_cache, v_cache = cache if cache is not None else (None, None)
    attn_m, attn_l, x = x if isinstance(x, tuple) else (None, None, x)
    fn = _epilogue_op if torch.compiler.is_compiling() else _epilogue_direct
    return fn(x, p.qweight, p.scales, p.zeros, p.bits, p.group_constexpr, p.in_features, p.out_features, kind,
              row, weight, eps, cos, sin, pos, k_cache, v_cache, nq, nkv, attn_m, attn_l)


def w8a8_mm(xq: torch.Tensor, sx: torch.Tensor, p: PackedW8A8,
            out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    if use_triton(xq, (9, 0)) and xq.shape[1] % 16 == 0:
        return _scaled_mm(xq, sx, p.w, p.scale, p.zc, out_dtype)
    return reference.w8a8_mm(xq, sx, p, out_dtype)


def fp8_mm(xq: torch.Tensor, sx: torch.Tensor, p: PackedFP8,
           out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    if use_triton(xq, (9, 0)) and xq.shape[1] % 16 == 0:
        from quantlab.kernels.triton_scaled import SMALL_M

        if xq.shape[0] > SMALL_M and out_dtype == torch.bfloat16 and not interpret_mode():
            return cublas_fp8_mm(xq, sx, p)
        return _scaled_mm(xq, sx, p.w, p.scale, None, out_dtype)
    return reference.fp8_mm(xq, sx, p, out_dtype)


def cublas_fp8_mm(xq: torch.Tensor, sx: torch.Tensor, p: PackedFP8) -> torch.Tensor:
    """FP8 × FP8 → bf16 above the small-M sizes: cuBLASLt's row-wise scaled GEMM
    (`torch._scaled_mm`, fp32 accumulation). On the H200 at M = 4096 its replayed time is
    within 7 % of the autotuned Triton / Gluon kernels' on Qwen2-7B's shapes (faster on two),
    its error against the reference 3× smaller, and eagerly it costs no dispatch: qwen_qkv
    82 µs eager against their 197, qwen_kv 19 against 154 (`benchmarks/results/gemm_nvidia_h200.md`)
    — an eager prefill waits on the host for most of its wall time (`benchmarks/decode.py
    --profile-prefill`). Small M keeps the split-K kernels, which read the weight at full
    bandwidth."""
    m, n = xq.shape[0], p.w.shape[0]
    scale_a = sx.float().reshape(-1, 1).expand(m, 1).contiguous()
    scale_b = p.scale.float().reshape(1, -1).expand(1, n).contiguous()
    return torch._scaled_mm(xq, p.w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)


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
