"""Triton kernels for weight-only int4/int8 GEMM (W4A16, W8A16) on the packed layout of
kernels/layout.py (GPTQ-order words `[K·bits/32, N]`). Imported lazily: needs triton.

Dequantization never converts int→float: `(w & mask) | 0x4B000000` read as float32 is
`2^23 + q·2^sh`, and one FMA with the zero point folded into its constant gives `q − z`
exactly (see `_codes_minus_zero`). Per weight that is one LOP3 and one FMA.

* `_wna16_fma_kernel` — decode GEMV (M = 1; one grid row per token): CUDA-core FMAs. Each thread
  owns R word rows × 4 columns (BLOCK_N = 128·num_warps), so the K reduction stays in registers;
  the next tile is prefetched into registers (Triton pipelines only loads feeding dots); the scale
  is applied once per column and tile. Split-K over a grid axis.
* `_wna16_mma_kernel` — tensor cores for M ≥ 2, over 16-word tiles. SWAP computes Yᵀ = W·Xᵀ
  (weights as the wgmma register operand, tokens on the MMA's narrow side); FOLD runs the MMA
  on exact `q − z` and scales the tile's partial product once per output; JOIN builds the whole
  `[BN, 128]` operand (one K=128 dot per tile) by joining codes along a new register axis,
  otherwise one K=16 dot per code position. Autotuning picks among them per shape: small
  BLOCK_M with split-K is the decode path (M ≤ 16), BLOCK_M ≥ 64 without split the tiled path.

Split-K reduces through an f32 workspace with atomics; the last program of a tile (a counter
per tile) reads the sum back at L2, writes the output, re-zeroes the workspace and resets the
counter, so no memset or second kernel runs per call (and CUDA-graph replays stay correct).
One workspace per device: calls on different streams must not overlap.

Measured on an H200 (benchmarks/results/gemm_nvidia_h200.md): M = 1 runs at ~1.8–2.0× bf16
cuBLAS, level with torch's tinygemm; the kernel is latency-bound (≈40% of DRAM bandwidth,
occupancy limited by registers). The MMA paths lose to bf16 at M = 16–64: the dequantized
operand's register→shared-memory relayout dominates (ncu: shared-memory pipe ~80% busy).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from quantlab.kernels.layout import BLOCK_K, PackedWNA16


@triton.jit
def _codes_minus_zero(w, zero, magic, I: tl.constexpr, BITS: tl.constexpr):
    """Code I (bits [BITS·I, BITS·(I+1))) of every int32 word as exact float32 `q − z`.

    `(w & mask) | 0x4B000000` read as float is `2^23 + q·2^sh`; one FMA with `2^−sh` and
    `−(2^(23−sh) + z)` gives `q − z` exactly, with no int→float conversion. Codes past bit 16
    expect the caller to pass `w >> 16`. `magic` (0x4B000000) comes in as a run-time
    argument: as an immediate, ptxas splits the and/or into two LOP3s. `zero` broadcasts."""
    PER_HALF: tl.constexpr = 16 // BITS
    SH: tl.constexpr = (I % PER_HALF) * BITS
    MASK: tl.constexpr = ((1 << BITS) - 1) << SH
    v = ((w & MASK) | magic).to(tl.float32, bitcast=True)
    return v * (1.0 / (1 << SH)) - (zero + 8388608.0 / (1 << SH))


@triton.jit
def _high(w):
    return (w.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)


@triton.jit
def _unpack_rows(w, zero, magic, BITS: tl.constexpr, DT: tl.constexpr):
    """Word tile `[BN, R]` → `(q − z)` as DT `[BN, R·32/BITS]`, in K order (code i of word j is
    k = j·32/BITS + i): the codes are joined along a new last axis, so the reshape only
    renames registers."""
    wh = _high(w)
    if BITS == 4:
        q0 = _codes_minus_zero(w, zero, magic, 0, 4).to(DT)
        q1 = _codes_minus_zero(w, zero, magic, 1, 4).to(DT)
        q2 = _codes_minus_zero(w, zero, magic, 2, 4).to(DT)
        q3 = _codes_minus_zero(w, zero, magic, 3, 4).to(DT)
        q4 = _codes_minus_zero(wh, zero, magic, 4, 4).to(DT)
        q5 = _codes_minus_zero(wh, zero, magic, 5, 4).to(DT)
        q6 = _codes_minus_zero(wh, zero, magic, 6, 4).to(DT)
        q7 = _codes_minus_zero(wh, zero, magic, 7, 4).to(DT)
        even = tl.join(tl.join(q0, q4), tl.join(q2, q6))
        odd = tl.join(tl.join(q1, q5), tl.join(q3, q7))
        t = tl.join(even, odd)  # [BN, R, b2, b1, b0] = code 4·b2 + 2·b1 + b0
        out = tl.reshape(t, (w.shape[0], w.shape[1] * 8))
    else:
        q0 = _codes_minus_zero(w, zero, magic, 0, 8).to(DT)
        q1 = _codes_minus_zero(w, zero, magic, 1, 8).to(DT)
        q2 = _codes_minus_zero(wh, zero, magic, 2, 8).to(DT)
        q3 = _codes_minus_zero(wh, zero, magic, 3, 8).to(DT)
        t = tl.join(tl.join(q0, q2), tl.join(q1, q3))  # [BN, R, b1, b0] = code 2·b1 + b0
        out = tl.reshape(t, (w.shape[0], w.shape[1] * 4))
    return out


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """tl.dot; UPCAST computes in f32 (the Triton 3.9 interpreter's bf16 dot is wrong)."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _finish(acc, y_ptrs, ws_ptrs, mask, cnt_ptr, tile, OUT: tl.constexpr, SPLIT_K: tl.constexpr):
    """Store a tile, or add it into the split-K workspace; the last arriving split stores."""
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(OUT), mask=mask)
    else:
        tl.atomic_add(ws_ptrs, acc, mask=mask, sem="release")
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            # Read the sum at L2 (an atomic add of 0), then re-zero: every split has arrived.
            total = tl.atomic_add(ws_ptrs, tl.zeros_like(acc), mask=mask, sem="acquire")
            tl.store(y_ptrs, total.to(OUT), mask=mask)
            tl.store(ws_ptrs, tl.zeros_like(acc), mask=mask)
            tl.store(cnt_ptr + tile, 0)


@triton.jit
def _group_params(s_ptr, z_ptr, k0, offs_n, n_mask, offs_r, N, NG,
                  GMODE: tl.constexpr, GROUP: tl.constexpr, PACK: tl.constexpr):
    """Scales and zeros for the tile at k0: `[BN]` (GMODE 1, one group per tile) or `[BN, R]`
    (GMODE 2, groups smaller than a tile: one group per word row)."""
    if GMODE == 1:
        g = tl.minimum(k0 // GROUP, NG - 1)  # K-pad tiles: any finite scale (x is 0 there)
        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    else:
        g = tl.minimum((k0 + offs_r * PACK) // GROUP, NG - 1)
        off = g[None, :] * N + offs_n[:, None]
        s = tl.load(s_ptr + off, mask=n_mask[:, None], other=0.0).to(tl.float32)
        z = tl.load(z_ptr + off, mask=n_mask[:, None], other=0.0).to(tl.float32)
    return s, z


@triton.jit
def _fma_code(acc, w, z, s, xs, magic, I: tl.constexpr, BITS: tl.constexpr, ROW_SCALE: tl.constexpr):
    q = _codes_minus_zero(w, z, magic, I, BITS)  # [BN, R]
    if ROW_SCALE:
        q = q * s
    return acc + tl.sum(q * xs[None, :], axis=1)


@triton.jit
def _fma_codes(w, z, s, xv, magic, BITS: tl.constexpr, R: tl.constexpr, ROW_SCALE: tl.constexpr):
    """Σ_k (q − z)·x over one word tile `w [BN, R]`, code by code: `xv [R·P]` (k = j·P + i) is
    split into the P per-code vectors with register-only reshapes/splits."""
    wh = _high(w)
    acc = tl.zeros([w.shape[0]], dtype=tl.float32)
    if BITS == 4:
        even, odd = tl.split(tl.reshape(xv, (R, 2, 2, 2)))  # [R, b2, b1, b0] → b0
        e0, e1 = tl.split(even)
        o0, o1 = tl.split(odd)
        x0, x4 = tl.split(e0)
        x2, x6 = tl.split(e1)
        x1, x5 = tl.split(o0)
        x3, x7 = tl.split(o1)
        acc = _fma_code(acc, w, z, s, x0, magic, 0, 4, ROW_SCALE)
        acc = _fma_code(acc, w, z, s, x1, magic, 1, 4, ROW_SCALE)
        acc = _fma_code(acc, w, z, s, x2, magic, 2, 4, ROW_SCALE)
        acc = _fma_code(acc, w, z, s, x3, magic, 3, 4, ROW_SCALE)
        acc = _fma_code(acc, wh, z, s, x4, magic, 4, 4, ROW_SCALE)
        acc = _fma_code(acc, wh, z, s, x5, magic, 5, 4, ROW_SCALE)
        acc = _fma_code(acc, wh, z, s, x6, magic, 6, 4, ROW_SCALE)
        acc = _fma_code(acc, wh, z, s, x7, magic, 7, 4, ROW_SCALE)
    else:
        even, odd = tl.split(tl.reshape(xv, (R, 2, 2)))  # [R, b1, b0] → b0
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        acc = _fma_code(acc, w, z, s, x0, magic, 0, 8, ROW_SCALE)
        acc = _fma_code(acc, w, z, s, x1, magic, 1, 8, ROW_SCALE)
        acc = _fma_code(acc, wh, z, s, x2, magic, 2, 8, ROW_SCALE)
        acc = _fma_code(acc, wh, z, s, x3, magic, 3, 8, ROW_SCALE)
    return acc


@triton.jit
def _wna16_fma_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, cnt_ptr,
                      N, K, KB, NG, stride_xm, stride_ym, magic,
                      BITS: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
                      BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, R: tl.constexpr):
    """Decode GEMV on CUDA cores, one token row per grid row. A `[BLOCK_N, R]` word tile with
    BLOCK_N = 128·num_warps gives each thread all R words of its 4 columns, so the K reduction
    stays in registers. The next tile is loaded before the current one is used (Triton
    software-pipelines only loads that feed dots)."""
    PACK: tl.constexpr = 32 // BITS
    KT: tl.constexpr = R * PACK  # K per tile
    GMODE: tl.constexpr = (GROUP > 0) * (1 + (GROUP % KT != 0))
    OUT: tl.constexpr = y_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_r = tl.arange(0, R)
    offs_kt = tl.arange(0, KT)
    tiles = KB * (128 // KT)
    per = tl.cdiv(tiles, SPLIT_K)
    t0 = pid_k * per
    t1 = tl.minimum(t0 + per, tiles)
    x_row = x_ptr + m * stride_xm
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if GMODE == 0:
        s = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        z = tl.load(z_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    w_ptrs = qw_ptr + (t0 * R + offs_r)[None, :] * N + offs_n[:, None]
    # Masks use a column limit of 0 for "no next tile" (scalar & tensor masks upset the interpreter).
    w_next = tl.load(w_ptrs, mask=(offs_n < tl.where(t0 < t1, N, 0))[:, None], other=0)
    for t in range(t0, t1):
        w = w_next
        w_ptrs += R * N
        w_next = tl.load(w_ptrs, mask=(offs_n < tl.where(t + 1 < t1, N, 0))[:, None], other=0)
        k0 = t * KT
        if GMODE > 0:
            s, z = _group_params(s_ptr, z_ptr, k0, offs_n, n_mask, offs_r, N, NG, GMODE, GROUP, PACK)
        kk = k0 + offs_kt
        if EVEN_K:
            xv = tl.load(x_row + kk).to(tl.float32)
        else:
            xv = tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32)
        part = _fma_codes(w, z, s, xv, magic, BITS, R, GMODE == 2)
        if GMODE == 1:
            acc += part * tl.reshape(s, (BLOCK_N,))
        else:
            acc += part
    if GMODE == 0:
        acc = acc * tl.reshape(s, (BLOCK_N,))
    _finish(acc, y_ptr + m * stride_ym + offs_n, ws_ptr + m * N + offs_n, n_mask, cnt_ptr,
            m * tl.num_programs(0) + pid_n, OUT, SPLIT_K)


@triton.jit
def _x_tile(x_ptr, rows, stride_xm, kk, K, EVEN_K: tl.constexpr, SWAP: tl.constexpr):
    """Activations for K offsets `kk`: `[len(kk), BM]` (SWAP) or `[BM, len(kk)]`."""
    if SWAP:
        xp = x_ptr + rows[None, :] * stride_xm + kk[:, None]
        if EVEN_K:
            xt = tl.load(xp)
        else:
            xt = tl.load(xp, mask=(kk < K)[:, None], other=0.0)
    else:
        xp = x_ptr + rows[:, None] * stride_xm + kk[None, :]
        if EVEN_K:
            xt = tl.load(xp)
        else:
            xt = tl.load(xp, mask=(kk < K)[None, :], other=0.0)
    return xt


@triton.jit
def _mma(acc, a, xt, SWAP: tl.constexpr, UPCAST: tl.constexpr):
    """acc += a·xt (SWAP: a [BN, k], xt [k, BM]) or xt·aᵀ (xt [BM, k]); acc None = fresh."""
    if SWAP:
        out = _dot(a, xt, acc, UPCAST)
    else:
        out = _dot(xt, tl.trans(a), acc, UPCAST)
    return out


@triton.jit
def _scale_out(part, s, SWAP: tl.constexpr):
    if SWAP:
        out = part * s
    else:
        out = part * tl.trans(s)
    return out


@triton.jit
def _mma_join_tile(acc, w, s, z, x_ptr, rows, stride_xm, k0, offs_kt, K, magic,
                   BITS: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr,
                   FOLD: tl.constexpr, GMODE: tl.constexpr, UPCAST: tl.constexpr):
    DT: tl.constexpr = x_ptr.dtype.element_ty
    PACK: tl.constexpr = 32 // BITS
    if FOLD and GMODE < 2:
        a = _unpack_rows(w, z, magic, BITS, DT)  # exact q − z
    else:
        qf = _unpack_rows(w, z, magic, BITS, tl.float32)
        if GMODE == 2:
            qf = (tl.reshape(qf, (w.shape[0], w.shape[1], PACK)) * s[:, :, None]).reshape(
                w.shape[0], w.shape[1] * PACK)
        else:
            qf = qf * s
        a = qf.to(DT)
    xt = _x_tile(x_ptr, rows, stride_xm, k0 + offs_kt, K, EVEN_K, SWAP)
    if FOLD and GMODE == 1:
        acc += _scale_out(_mma(None, a, xt, SWAP, UPCAST), s, SWAP)
    else:
        acc = _mma(acc, a, xt, SWAP, UPCAST)
    return acc


@triton.jit
def _mma_code(acc, w, s, z, x_ptr, rows, stride_xm, kk, K, magic, I: tl.constexpr,
              BITS: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr, SCALE: tl.constexpr,
              UPCAST: tl.constexpr):
    DT: tl.constexpr = x_ptr.dtype.element_ty
    q = _codes_minus_zero(w, z, magic, I, BITS)
    if SCALE:
        q = q * s
    xt = _x_tile(x_ptr, rows, stride_xm, kk, K, EVEN_K, SWAP)
    return _mma(acc, q.to(DT), xt, SWAP, UPCAST)


@triton.jit
def _mma_code_tile(acc, w, s, z, x_ptr, rows, stride_xm, k0, offs_r, K, magic,
                   BITS: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr,
                   FOLD: tl.constexpr, GMODE: tl.constexpr, UPCAST: tl.constexpr):
    """One K=16 dot per code position i (k = k0 + 16·j·… : word row j, code i)."""
    PACK: tl.constexpr = 32 // BITS
    SCALE: tl.constexpr = not (FOLD and GMODE < 2)
    wh = _high(w)
    kj = k0 + offs_r * PACK
    if SCALE:
        part = acc
    else:
        part = tl.zeros_like(acc)
    for i in tl.static_range(PACK):
        if i < PACK // 2:
            part = _mma_code(part, w, s, z, x_ptr, rows, stride_xm, kj + i, K, magic, i, BITS,
                             EVEN_K, SWAP, SCALE, UPCAST)
        else:
            part = _mma_code(part, wh, s, z, x_ptr, rows, stride_xm, kj + i, K, magic, i, BITS,
                             EVEN_K, SWAP, SCALE, UPCAST)
    if SCALE:
        out = part
    elif GMODE == 1:
        out = acc + _scale_out(part, s, SWAP)
    else:
        out = acc + part
    return out


@triton.jit
def _wna16_mma_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, cnt_ptr,
                      M, N, K, KB, NG, stride_xm, stride_ym, magic,
                      BITS: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                      SWAP: tl.constexpr, FOLD: tl.constexpr, JOIN: tl.constexpr,
                      UPCAST: tl.constexpr):
    """Tensor-core WNA16 over 16-word tiles (K = 128 for int4, 64 for int8 per dot).

    SWAP computes Yᵀ = W·Xᵀ: the dequantized weights are the register A operand of wgmma and
    the token count is the MMA's narrow N side (decode, M ≤ 64); otherwise Y = X·Wᵀ. FOLD runs
    the MMA on `q − z` (exact in bf16/fp16) and scales the tile's partial product once per
    output (needs one group per tile and a second accumulator); otherwise `(q − z)·s` per
    weight, which any group size and large tiles use. JOIN builds the whole `[BN, 16·P]` tile
    operand in K order (one dot per tile, but a shared-memory relayout of the joined codes);
    otherwise one K=16 dot per code position with a strided slice of the activations."""
    R: tl.constexpr = 16
    PACK: tl.constexpr = 32 // BITS
    KT: tl.constexpr = R * PACK
    GMODE: tl.constexpr = (GROUP > 0) * (1 + (GROUP % KT != 0))
    SCALE_TILE: tl.constexpr = FOLD and GMODE == 1
    OUT: tl.constexpr = y_ptr.dtype.element_ty
    DT: tl.constexpr = x_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rows = offs_m % M  # rows past M re-read row m % M; never stored
    offs_r = tl.arange(0, R)
    offs_kt = tl.arange(0, KT)
    tiles = KB * (128 // KT)
    per = tl.cdiv(tiles, SPLIT_K)
    t0 = pid_k * per
    t1 = tl.minimum(t0 + per, tiles)
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GMODE == 0:
        s = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        z = tl.load(z_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    for t in range(t0, t1):
        k0 = t * KT
        w = tl.load(qw_ptr + (t * R + offs_r)[None, :] * N + offs_n[:, None], mask=n_mask[:, None],
                    other=0)  # [BN, R]
        if GMODE > 0:
            s, z = _group_params(s_ptr, z_ptr, k0, offs_n, n_mask, offs_r, N, NG, GMODE, GROUP, PACK)
        if JOIN:
            acc = _mma_join_tile(acc, w, s, z, x_ptr, rows, stride_xm, k0, offs_kt, K, magic,
                                 BITS, EVEN_K, SWAP, FOLD, GMODE, UPCAST)
        else:
            acc = _mma_code_tile(acc, w, s, z, x_ptr, rows, stride_xm, k0, offs_r, K, magic,
                                 BITS, EVEN_K, SWAP, FOLD, GMODE, UPCAST)
    if FOLD and GMODE == 0:
        if SWAP:
            acc = acc * s
        else:
            acc = acc * tl.trans(s)
    if SWAP:
        mask = n_mask[:, None] & m_mask[None, :]
        y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
        ws_ptrs = ws_ptr + offs_m[None, :] * N + offs_n[:, None]
    else:
        mask = m_mask[:, None] & n_mask[None, :]
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        ws_ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
    _finish(acc, y_ptrs, ws_ptrs, mask, cnt_ptr, pid_m * tl.num_programs(0) + pid_n, OUT, SPLIT_K)


# ---------------------------------------------------------------------------------------------
# Configs and launch

def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def _cfg(num_warps: int = 4, num_stages: int = 2, **kw) -> triton.Config:
    return triton.Config(kw, num_warps=num_warps, num_stages=num_stages)


FMA_CONFIGS = [triton.Config(dict(BLOCK_N=bn, SPLIT_K=sk, R=r), num_warps=bn // 128, num_stages=1,
                             maxnreg=mr)
               for bn in (128, 256) for sk in (4, 8, 16, 32) for r in (4, 8) for mr in (None, 128)]
GEMV_MMA_CONFIGS = [_cfg(4, st, BLOCK_M=16, BLOCK_N=bn, SPLIT_K=sk, SWAP=sw, FOLD=True, JOIN=j)
                    for bn in (64, 128) for sk in (2, 4, 8) for st in (3, 4) for sw in (True, False)
                    for j in (True, False)]
MID_MMA_CONFIGS = [_cfg(4, 3, BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=sk, SWAP=sw, FOLD=True, JOIN=j)
                   for bm in (32, 64) for bn in (64, 128) for sk in (1, 2, 4) for sw in (True, False)
                   for j in (True, False)]
TILED_MMA_CONFIGS = [_cfg(w, st, BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=1, SWAP=sw, FOLD=fold, JOIN=True)
                     for bm, bn, w, fold in ((64, 128, 4, True), (128, 128, 8, True),
                                             (128, 128, 8, False), (256, 128, 8, False),
                                             (128, 256, 8, False))
                     for sw in (False, True) for st in (3, 4)]


def _prune(configs, named_args, **_):
    """Keep configs whose grid fills the GPU without tiny split-K ranges (2–32 programs/SM)."""
    n, kb, m = named_args["N"], named_args["KB"], named_args.get("M", 1)
    sms = _num_sms(named_args["y_ptr"].device)
    scored = []
    for c in configs:
        bm = c.kwargs.get("BLOCK_M", 1)
        sk = c.kwargs["SPLIT_K"]
        progs = triton.cdiv(n, c.kwargs["BLOCK_N"]) * triton.cdiv(m, bm) * sk
        if sk > 1 and kb / sk < 2:
            continue
        scored.append((progs, c))
    keep = [c for p, c in scored if 2 * sms <= p <= 32 * sms]
    if keep:
        return keep
    if not scored:
        return [min(configs, key=lambda c: c.kwargs["SPLIT_K"])]
    best = max(p for p, _ in scored) if all(p < 2 * sms for p, _ in scored) else \
        min(p for p, _ in scored)
    return [c for p, c in scored if p == best]


def _bench(fn, quantiles):
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def _autotuned(kernel, configs, keys):
    return triton.autotune(configs=configs, key=keys, prune_configs_by={"early_config_prune": _prune},
                           do_bench=_bench, cache_results=True)(kernel)


_FMA = _autotuned(_wna16_fma_kernel, FMA_CONFIGS, ["N", "K", "BITS", "GROUP"])
_MMA_GEMV = _autotuned(_wna16_mma_kernel, GEMV_MMA_CONFIGS, ["M", "N", "K", "BITS", "GROUP"])
_MMA_MID = _autotuned(_wna16_mma_kernel, MID_MMA_CONFIGS, ["M", "N", "K", "BITS", "GROUP"])
_MMA_TILED = _autotuned(_wna16_mma_kernel, TILED_MMA_CONFIGS, ["M", "N", "K", "BITS", "GROUP"])

_WORKSPACE: dict[tuple, torch.Tensor] = {}
MAGIC = 0x4B000000  # float32 bits of 2^23


def workspace(device: torch.device, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed buffer the split-K kernels leave zeroed again (one per device and dtype)."""
    key = (str(device), dtype)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.zeros(max(numel, 1 << 16), dtype=dtype, device=device)
        _WORKSPACE[key] = buf
    return buf


# One small config per path for the CPU interpreter (autotuning there would run every config).
INTERPRET_CONFIGS = {
    "fma": dict(BLOCK_N=64, SPLIT_K=2, R=8),
    "gemv": dict(BLOCK_M=16, BLOCK_N=32, SPLIT_K=2, SWAP=True, FOLD=True, JOIN=False),
    "mid": dict(BLOCK_M=32, BLOCK_N=32, SPLIT_K=1, SWAP=False, FOLD=True, JOIN=True),
    "tiled": dict(BLOCK_M=32, BLOCK_N=32, SPLIT_K=1, SWAP=False, FOLD=False, JOIN=True),
}


def wna16_matmul(x: torch.Tensor, p: PackedWNA16, impl: str = "auto",
                 config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, K]` (bf16/fp16, unit column stride) times the packed weight → `[M, N]` in x's dtype.

    impl: "auto" (M = 1 → fma, M ≤ 16 → gemv, M ≤ 64 → mid, else tiled), or one of those names.
    `config` (meta-parameters, optionally num_warps/num_stages) skips autotuning; under
    TRITON_INTERPRET=1 a fixed small config is used. `out` (contiguous `[M, N]`) is written in
    place."""
    if not p.kernel_ok:
        raise ValueError(f"group size {p.group_size} unsupported by the Triton kernels")
    assert x.dim() == 2 and x.shape[1] == p.in_features and x.stride(1) == 1
    m, k = x.shape
    n = p.out_features
    if p.perm is not None:
        x = x.index_select(1, p.perm)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.is_contiguous() and out.dtype == x.dtype
    if m == 0:
        return out
    kb = p.qweight.shape[0] // p.words_per_block
    ng = p.scales.shape[0]
    g = p.group_constexpr
    ws = workspace(x.device, m * n, torch.float32)
    cnt = workspace(x.device, m * triton.cdiv(n, 16) + 1, torch.int32)
    if impl == "auto":
        impl = "fma" if m == 1 else "gemv" if m <= 16 else "mid" if m <= 64 else "tiled"
    if config is None and _interpret():
        config = INTERPRET_CONFIGS[impl]
    common = dict(BITS=p.bits, GROUP=g, EVEN_K=k % BLOCK_K == 0)
    args = (x, p.qweight, p.scales, p.zeros, out, ws, cnt)
    if impl == "fma":
        kern = _wna16_fma_kernel if config else _FMA
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"], m)  # noqa: E731
        kern[grid](*args, n, k, kb, ng, x.stride(0), out.stride(0), MAGIC, **common,
                   **(config or {}))
        return out
    tuned = {"gemv": _MMA_GEMV, "mid": _MMA_MID, "tiled": _MMA_TILED}[impl]
    kern = _wna16_mma_kernel if config else tuned
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]),  # noqa: E731
                         meta["SPLIT_K"])
    kern[grid](*args, m, n, k, kb, ng, x.stride(0), out.stride(0), MAGIC, **common,
               UPCAST=_interpret(), **(config or {}))
    return out
