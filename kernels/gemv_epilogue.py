"""What the decode-step GEMV does with its finished output tile (`triton_wna16._gemv_kernel`,
EPI ≠ 0), so that a batch-1 decoder layer is four GEMVs and the attention's partials, nothing
between.

Without them a W4A16 layer on an H200 ran about 13 kernels, and the nine that are not GEMVs
(the residual adds with the RMSNorms, RoPE, the two cache writes, SiLU·up, …) each cost a
launch and a drain of the GPU, about 20 µs per layer against 50 µs of GEMVs
(`benchmarks/decode.py --profile`). Each of these runs in the program
that completes a column tile (the last split to arrive), on data already in registers:

* RESIDUAL — `y = acc + residual`; with a norm weight also `y·w`, the next RMSNorm's input
  before its 1/rms factor (o_proj, down_proj).
* RMS_SWIGLU — `acc · 1/rms(row)` (the RMSNorm's factor: `Σ (x·w)_k W_kn` scaled once; each
  split sums the squares of its slice of the row, `slice_sumsq`), then `silu(gate)·up` of the
  column pairs (gate_up with interleaved columns).
* RMS_ROPE_CACHE — the same factor, the bias, RoPE on q and k at the step's position (read
  from the device, so a captured graph stays valid), q to the output, k and v into the
  static cache (qkv).

The rounding differs from the unfused ops (one float32 pass instead of a bf16 result per op).

And one prologue, for o_proj: its input is the attention output, which `combine_head` forms
from the flash-decoding partials (`triton_attention.Partials`) for the heads of the program's
own K range — the attention's second launch folded into the GEMV. Every column tile's program
combines the same heads and writes the same bits into the input row before reading it back.
"""

from __future__ import annotations

import triton
import triton.language as tl

from quantlab.kernels.common import Epilogue

PLAIN, RESIDUAL, RMS_SWIGLU, RMS_ROPE_CACHE = (tl.constexpr(int(k)) for k in Epilogue)
RMS_CHUNK = tl.constexpr(256)


@triton.jit
def combine_head(m_ptr, l_ptr, acc_ptr, out_ptr, bh, g, nsplit, BLOCK_G: tl.constexpr,
                 D: tl.constexpr, NSPLIT_P2: tl.constexpr):
    """Query head g of row·KV head `bh` from every split's max, sum and values (one load each),
    to `out_ptr[0:D]`."""
    splits = tl.arange(0, NSPLIT_P2)
    offs_d = tl.arange(0, D)
    valid = splits < nsplit
    rows = (bh * nsplit + splits) * BLOCK_G + g
    m = tl.load(m_ptr + rows, mask=valid, other=float("-inf"))
    l_ = tl.load(l_ptr + rows, mask=valid, other=0.0)
    acc = tl.load(acc_ptr + rows[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.exp(m - tl.where(m_all == float("-inf"), 0.0, m_all))
    w = tl.where(valid, w, 0.0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l_, axis=0)
    tl.store(out_ptr + offs_d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def combine_heads(m_ptr, l_ptr, acc_ptr, x_row, k0, k1, nsplit, group,
                  BLOCK_G: tl.constexpr, D: tl.constexpr, NSPLIT_P2: tl.constexpr):
    """o_proj's prologue: the attention output of every head overlapping `[k0, k1)` of the
    (batch-1) input row `x_row`, then a barrier so the program's threads read it back."""
    for hq in range(k0 // D, tl.cdiv(k1, D)):
        combine_head(m_ptr, l_ptr, acc_ptr, x_row + hq * D, hq // group, hq % group, nsplit,
                     BLOCK_G, D, NSPLIT_P2)
    tl.debug_barrier()


@triton.jit
def slice_sumsq(row_ptr, k0, k1):
    """`Σ row[k]²` over `[k0, k1)` in float32: each split of an RMS epilogue GEMV sums the
    slice of the normed row that matches its own K range, and the last one adds the splits'
    sums (`inv_rms`) — one small load per program instead of a pass over the whole row at the
    end, where it lengthened every GEMV's tail."""
    offs = tl.arange(0, RMS_CHUNK)
    sq = tl.zeros([RMS_CHUNK], dtype=tl.float32)
    for c in range(k0, k1, RMS_CHUNK):
        v = tl.load(row_ptr + c + offs, mask=c + offs < k1, other=0.0).to(tl.float32)
        sq += v * v
    return tl.sum(sq, axis=0)


@triton.jit
def inv_rms(parts_ptr, sumsq, pid_k, split_k, K, eps, SPLIT_P2: tl.constexpr):
    """`1 / sqrt(mean(row²) + eps)` (RMSNorm's factor) from the splits' `slice_sumsq`, which
    each stored at `parts_ptr + pid_k` before arriving; split_k = 1: its own sum."""
    if split_k > 1:
        splits = tl.arange(0, SPLIT_P2)
        sumsq = tl.sum(tl.load(parts_ptr + splits, mask=splits < split_k, other=0.0,
                               cache_modifier=".cg"), axis=0)
    return 1.0 / tl.sqrt(sumsq / K + eps)


@triton.jit
def residual(total, offs_n, n_mask, y_ptr, res_ptr, w_ptr, y2_ptr, OUT: tl.constexpr):
    """`y = total + residual`, and `y2 = y·w` when a norm weight is given."""
    h = (total + tl.load(res_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)).to(OUT)
    tl.store(y_ptr + offs_n, h, mask=n_mask)
    if w_ptr is not None:
        w = tl.load(w_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y2_ptr + offs_n, (h.to(tl.float32) * w).to(OUT), mask=n_mask)


@triton.jit
def swiglu(v, pid_n, N, y_ptr, BLOCK_N: tl.constexpr, OUT: tl.constexpr):
    """Columns 2j, 2j + 1 are gate_j, up_j (already scaled by 1/rms): store `silu(gate)·up`
    (N / 2 wide)."""
    gate, up = tl.split(tl.reshape(v, (BLOCK_N // 2, 2)))
    act = gate / (1.0 + tl.exp(-gate)) * up
    offs = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(y_ptr + offs, act.to(OUT), mask=offs < N // 2)


@triton.jit
def rope_cache(v, pid_n, y_ptr, bias_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, NQ, NKV,
               CACHE_S, BLOCK_N: tl.constexpr, D: tl.constexpr, OUT: tl.constexpr):
    """Columns `[q (NQ) | k (NKV) | v (NKV)]` of one token (already scaled by 1/rms), heads of
    D: add the bias, rotate q and k (rotate-half RoPE, tables `[S, D]` float32 at the step's
    position), store q at `y`, k and v at that position of the caches `[KV heads, CACHE_S, D]`."""
    NH: tl.constexpr = BLOCK_N // D
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if bias_ptr is not None:
        v += tl.load(bias_ptr + offs_n, mask=offs_n < NQ + 2 * NKV, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr)
    half = tl.arange(0, D // 2)
    cos = tl.load(cos_ptr + pos * D + half)[None, :]
    sin = tl.load(sin_ptr + pos * D + half)[None, :]
    x1, x2 = tl.split(tl.permute(tl.reshape(v, (NH, 2, D // 2)), (0, 2, 1)))  # [NH, D/2] each
    head0 = pid_n * BLOCK_N + tl.arange(0, NH) * D  # first column of each head
    rot = (head0 < NQ + NKV)[:, None]
    o1 = tl.where(rot, x1 * cos - x2 * sin, x1)
    o2 = tl.where(rot, x2 * cos + x1 * sin, x2)
    out = tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), (BLOCK_N,)).to(OUT)
    kv_col = offs_n - NQ - tl.where(offs_n >= NQ + NKV, NKV, 0)  # column within k or v
    at = (kv_col // D) * CACHE_S * D + pos * D + kv_col % D
    tl.store(y_ptr + offs_n, out, mask=offs_n < NQ)
    tl.store(kc_ptr + at, out, mask=(offs_n >= NQ) & (offs_n < NQ + NKV))
    tl.store(vc_ptr + at, out, mask=(offs_n >= NQ + NKV) & (offs_n < NQ + 2 * NKV))
