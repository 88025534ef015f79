"""Decode attention (one query token per row) over the static KV cache, flash-decoding style.

Why a kernel: the runner's torch decode path (`quantlab.runner.model.attend`) is two batched
matmuls and a softmax per layer, over the whole cache while a CUDA graph is captured, and with
an 8-bit (C8) cache it first dequantizes every cached position to the compute dtype, each step,
each layer. This kernel reads the cache once as stored — bf16 / fp16 / fp32, or int8 / FP8
codes times a per-KV-head scale — stops at the step's own position (read from a device tensor,
so a captured graph stays valid as the sequence grows) and splits the keys over programs, so a
batch-1 step still spreads over the GPU.

Two launches: per (row, KV head, split) the running max, the sum of exponentials and the
weighted values of the KV head's query heads (the GQA group, padded to 16 rows for the MMA);
then their combination, one program per query head (`gemv_epilogue.combine_head`, which the
batch-1 decode step instead runs in the o_proj GEMV's prologue: one launch and one drain of
the GPU fewer per layer). Scores stay float32 (the torch path rounds q·k to the compute dtype
first), so the two agree to that rounding, not bit for bit.

Which keys a row sees: a mask `[B, ≥ S]` (any padding pattern), or — the batch-1 step, where
building the mask took five small kernels per step — every key from the row's first
non-pad position `start[b]` up to the step's.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from quantlab.kernels.gemv_epilogue import combine_head
from quantlab.kernels.common import interpret_mode, pdl_launch, sm_count
from quantlab.kernels.triton_wna16 import _dot, pdl_start, pdl_wait

BLOCK_S = 32  # keys per inner iteration


@triton.jit
def _partial_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, mask_ptr, start_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr,
                    S, KVH, CHUNK, sm_scale, stride_qb, stride_qh, stride_kb, stride_kh, stride_ks,
                    stride_vb, stride_vh, stride_vs, stride_mb,
                    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                    BLOCK_S: tl.constexpr, CODES: tl.constexpr, UPCAST: tl.constexpr,
                    PDL: tl.constexpr = 0):
    """Keys [split·CHUNK, min((split + 1)·CHUNK, pos + 1)) of one (row, KV head), those the
    mask allows (without one: from `start[row]` on, and the step's own). PDL
    (`ops.PdlTrigger`): everything read here waits for the previous kernel."""
    pdl_start(PDL)  # everything read here is the previous kernels' output: nothing before the wait
    pdl_wait(PDL)
    bh = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    b = bh // KVH
    h = bh % KVH
    end = tl.minimum(tl.load(pos_ptr) + 1, S)  # the step's position is the last one it may see
    if mask_ptr is None:
        first = tl.load(start_ptr + b)
    start = split * CHUNK
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    g_mask = offs_g < GROUP
    q = tl.load(q_ptr + b * stride_qb + (h * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None], other=0.0)
    if CODES:
        k_scale = tl.load(ks_ptr + h)
        v_scale = tl.load(vs_ptr + h)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    k_row = k_ptr + b * stride_kb + h * stride_kh
    v_row = v_ptr + b * stride_vb + h * stride_vh
    for s0 in range(start, tl.minimum(start + CHUNK, end), BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        inside = offs_s < end
        k = tl.load(k_row + offs_s[:, None] * stride_ks + offs_d[None, :], mask=inside[:, None], other=0.0)
        v = tl.load(v_row + offs_s[:, None] * stride_vs + offs_d[None, :], mask=inside[:, None], other=0.0)
        if CODES:  # as `runner.codes.decode`: code · scale, rounded to the compute dtype
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        if mask_ptr is None:
            seen = ((offs_s >= first) & inside) | (offs_s == end - 1)
        else:
            seen = tl.load(mask_ptr + b * stride_mb + offs_s, mask=inside, other=0) != 0
        s = _dot(q, tl.trans(k), tl.zeros([BLOCK_G, BLOCK_S], tl.float32), UPCAST) * sm_scale
        s = tl.where(seen[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with no visible key
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], UPCAST)
        m_i = m_new
    row = bh * nsplit + split
    tl.store(m_ptr + row * BLOCK_G + offs_g, m_i)
    tl.store(l_ptr + row * BLOCK_G + offs_g, l_i)
    tl.store(acc_ptr + (row * BLOCK_G + offs_g)[:, None] * D + offs_d[None, :], acc)


@triton.jit
def _combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, NSPLIT, KVH, stride_ob, stride_oh,
                    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                    NSPLIT_P2: tl.constexpr, PDL: tl.constexpr = 0):
    """One query head per program. (A loop over the splits per KV head made this launch as
    long as the partials' on an H100: one dependent round trip to memory per split, on 4
    programs.)"""
    pdl_start(PDL)  # everything read here is the previous kernels' output: nothing before the wait
    pdl_wait(PDL)
    bh = tl.program_id(0)
    g = tl.program_id(1)
    b = bh // KVH
    h = bh % KVH
    combine_head(m_ptr, l_ptr, acc_ptr, out_ptr + b * stride_ob + (h * GROUP + g) * stride_oh,
                 bh, g, NSPLIT, BLOCK_G, D, NSPLIT_P2)


def _chunk(length: int, programs: int, device: torch.device) -> int:
    """Keys per split: about two programs per SM over the whole grid, whole inner blocks."""
    want = max(1, 2 * sm_count(device, 4) // max(programs, 1))
    return BLOCK_S * max(1, math.ceil(math.ceil(length / want) / BLOCK_S))


class Partials(NamedTuple):
    """The first launch's output, per (row, KV head, split, query head of the group padded to
    BLOCK_G): running max `m`, sum of exponentials `l` (`[B·KVH, NSPLIT, BLOCK_G]`) and the
    weighted values `acc` (`[B·KVH, NSPLIT, BLOCK_G, D]`), float32."""

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741 — the flash-attention name
    acc: torch.Tensor


def partials_shape(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int]:
    """`(B·KVH, NSPLIT, BLOCK_G, D)` of the partials of `q [B, H, D]` over the cache `k`."""
    return _split(q, k)[1]


def _split(q: torch.Tensor, k: torch.Tensor) -> tuple[int, tuple[int, int, int, int]]:
    """(Keys per split, the partials' shape)."""
    b, h, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    chunk = _chunk(s, b * kvh, q.device)
    return chunk, (b * kvh, triton.cdiv(s, chunk), max(16, triton.next_power_of_2(h // kvh)), d)


def attention_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       pos: torch.Tensor, start: torch.Tensor | None = None,
                       k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> Partials:
    """The first launch of `decode_attention`; without `mask`, each row sees the keys from
    `start[b]` (int64 `[B]` on the device: its leading pad positions) to the step's."""
    b, h, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and q.stride(-1) == 1 and d == triton.next_power_of_2(d)
    assert (mask is None) != (start is None), "a mask or the rows' first positions"
    chunk, (bkv, nsplit, block_g, _) = _split(q, k)
    m = torch.empty(bkv, nsplit, block_g, dtype=torch.float32, device=q.device)
    parts = Partials(m, torch.empty_like(m), torch.empty(*m.shape, d, dtype=torch.float32, device=q.device))
    codes = k_scale is not None
    scales = (k_scale, v_scale) if codes else (m, m)  # unread without codes
    mask8 = mask.view(torch.int8) if mask is not None and mask.dtype == torch.bool else mask
    _partial_kernel[(bkv, nsplit)](
        q, k, v, *scales, mask8, start, pos, *parts, s, kvh, chunk, 1.0 / math.sqrt(d),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        mask8.stride(0) if mask8 is not None else 0, GROUP=h // kvh, BLOCK_G=block_g, D=d, BLOCK_S=BLOCK_S,
        CODES=codes, UPCAST=interpret_mode() or q.dtype == torch.float32, **_launch_options(q))
    return parts


def _launch_options(q: torch.Tensor) -> dict:
    return dict(num_warps=1 if interpret_mode() else 4, **pdl_launch(q))


def combine(parts: Partials, q: torch.Tensor) -> torch.Tensor:
    """The second launch: the attention output `[B, H, D]` in q's dtype from the partials."""
    b, h, d = q.shape
    bkv, nsplit, block_g, _ = parts.acc.shape
    kvh = bkv // b
    out = torch.empty_like(q)
    _combine_kernel[(bkv, h // kvh)](*parts, out, nsplit, kvh, out.stride(0), out.stride(1),
                                     GROUP=h // kvh, BLOCK_G=block_g, D=d,
                                     NSPLIT_P2=triton.next_power_of_2(nsplit), **_launch_options(q))
    return out


def prologue_args(parts: Partials, heads: int) -> dict:
    """The o_proj GEMV's arguments for combining `parts` (one row, `heads` query heads) in its
    prologue (`gemv_epilogue.combine_heads`)."""
    kvh, nsplit, block_g, d = parts.acc.shape
    return dict(c_m_ptr=parts.m, c_l_ptr=parts.l, c_acc_ptr=parts.acc, c_nsplit=nsplit, c_group=heads // kvh,
                C_BLOCK_G=block_g, C_NSPLIT_P2=triton.next_power_of_2(nsplit), HEAD_D=d)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     pos: torch.Tensor, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of one query per row: `q [B, H, D]` over the cache `k, v [B, KVH, S, D]`
    (the compute dtype, or int8 / FP8 codes with `k_scale, v_scale [KVH]` float32), keys with
    `mask [B, ≥ S]` true and positions ≤ `pos[0]` (int64, on the device). → `[B, H, D]` in q's
    dtype (bf16 / fp16 on a GPU; float32 runs under the interpreter). D a power of two; query
    head i reads KV head i // (H / KVH)."""
    return combine(attention_partials(q, k, v, mask, pos, None, k_scale, v_scale), q)
