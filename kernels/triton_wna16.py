"""Triton kernels for weight-only int4/int8 GEMM (W4A16, W8A16) on the slot layout
(kernels/layout.py). Imported lazily: this module needs triton.

Two kernels:

* `_wna16_fma_kernel` — the decode GEMV (M = 1, one program row per token): CUDA-core FMAs on a
  `[W, BLOCK_N]` tile, split-K over a grid axis. Per weight: one LOP3 (mask | 2^23 exponent),
  one FMA that turns the float bit pattern into the exact code (no int→float convert), one FMA
  with the activation. Scales and pre-multiplied zeros are applied once per group and column
  (`acc += part·s − Σx·zs`), not per weight.
* `_wna16_mma_kernel` — tensor cores, "swap-AB": computes `Yᵀ[N, M] = deq(W)[N, K] · Xᵀ[K, M]`
  so the dequantized weights are the register-resident A operand and M (the token count, 1..16
  at decode) becomes the MMA's narrow N side. With BLOCK_M = 16 and split-K it is the decode
  GEMM for M = 2..16; with BLOCK_M ≥ 32 and no split it is the tiled GEMM for large M.

Split-K reduces through an f32 workspace with atomics; the last program of a tile (a counter
per tile) reads the sum back at L2, writes the output, re-zeroes the workspace and resets the
counter, so no memset or second kernel runs per call.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from quantlab.kernels.layout import BLOCK_K, PackedWNA16


@triton.jit
def _codes_minus_zero(w, zero, magic, I: tl.constexpr, BITS: tl.constexpr):
    """Slot I of an int32 tile as exact float32 `q − z` (columns' zero points `zero [BN]`).

    `(w & mask) | 0x4B000000` read as float is `2^23 + q·2^sh`; one FMA with `2^−sh` and
    `−(2^(23−sh) + z)` gives `q − z` exactly, with no int→float conversion. Slots past the
    low half expect the caller to have shifted `w` right by 16. `magic` (0x4B000000) comes in as
    a run-time argument: as an immediate, ptxas splits the and/or into two LOP3s."""
    PER_HALF: tl.constexpr = 16 // BITS
    SH: tl.constexpr = (I % PER_HALF) * BITS
    MASK: tl.constexpr = ((1 << BITS) - 1) << SH
    v = ((w & MASK) | magic).to(tl.float32, bitcast=True)
    off = zero + 8388608.0 / (1 << SH)
    return v * (1.0 / (1 << SH)) - off[None, :]


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
def _wna16_fma_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, cnt_ptr,
                      N, K, KB, NG, stride_xm, stride_ym, magic,
                      BITS: tl.constexpr, GROUP: tl.constexpr, SUB: tl.constexpr,
                      EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """One token row per program row; BLOCK_N = 128·num_warps makes each thread own all R rows
    of its 4 columns, so the K reduction stays in registers (no shuffles)."""
    W: tl.constexpr = 4 * BITS
    R: tl.constexpr = 16
    SLOTS: tl.constexpr = 32 // BITS
    PER_HALF: tl.constexpr = 16 // BITS
    OUT: tl.constexpr = y_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_r = tl.arange(0, R)
    per = tl.cdiv(KB, SPLIT_K)
    kb0 = pid_k * per
    kb1 = tl.minimum(kb0 + per, KB)
    x_row = x_ptr + m * stride_xm
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if GROUP == 0:
        s = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    for kb in range(kb0, kb1):
        k0 = kb * 128
        for h in tl.static_range(W // R):
            w = tl.load(qw_ptr + (kb * W + h * R + offs_r)[:, None] * N + offs_n[None, :],
                        mask=n_mask[None, :], other=0)
            for i in tl.static_range(SLOTS):
                if i == PER_HALF:
                    w = (w.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)
                if GROUP > 0:
                    if i % SUB == 0:
                        g = tl.minimum((k0 + i * W) // GROUP, NG - 1)  # K-pad slots: finite s
                        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                        z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                kk = k0 + i * W + h * R + offs_r
                if EVEN_K:
                    xv = tl.load(x_row + kk).to(tl.float32)
                else:
                    xv = tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32)
                part = tl.sum(_codes_minus_zero(w, z, magic, i, BITS) * xv[:, None], axis=0)
                if GROUP > 0:
                    acc += part * s
                else:
                    acc += part
    if GROUP == 0:
        acc = acc * s
    _finish(acc, y_ptr + m * stride_ym + offs_n, ws_ptr + m * N + offs_n, n_mask, cnt_ptr,
            m * tl.num_programs(0) + pid_n, OUT, SPLIT_K)


@triton.jit
def _wna16_mma_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, cnt_ptr,
                      M, N, K, KB, NG, stride_xm, stride_ym, magic,
                      BITS: tl.constexpr, GROUP: tl.constexpr, SUB: tl.constexpr,
                      EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      SPLIT_K: tl.constexpr, SWAP: tl.constexpr, UPCAST: tl.constexpr):
    """Tensor-core WNA16. The MMA runs on `q − z` (exact in bf16/fp16); the scale is applied
    to the per-group partial accumulator, not per weight. SWAP computes Yᵀ = W·Xᵀ (weights
    as the A operand); otherwise Y = X·Wᵀ (with BLOCK_M < 64 Triton emits mma.sync)."""
    W: tl.constexpr = 4 * BITS
    R: tl.constexpr = 16
    SLOTS: tl.constexpr = 32 // BITS
    PER_HALF: tl.constexpr = 16 // BITS
    OUT: tl.constexpr = y_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rows = offs_m % M  # rows past M re-read row m % M; never stored
    offs_r = tl.arange(0, R)
    per = tl.cdiv(KB, SPLIT_K)
    kb0 = pid_k * per
    kb1 = tl.minimum(kb0 + per, KB)
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    part = tl.zeros_like(acc)
    if GROUP == 0:
        s = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    for kb in range(kb0, kb1):
        k0 = kb * 128
        for h in tl.static_range(W // R):
            w = tl.load(qw_ptr + (kb * W + h * R + offs_r)[:, None] * N + offs_n[None, :],
                        mask=n_mask[None, :], other=0)
            for i in tl.static_range(SLOTS):
                if i == PER_HALF:
                    w = (w.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)
                if GROUP > 0:
                    if i % SUB == 0:
                        g = tl.minimum((k0 + i * W) // GROUP, NG - 1)
                        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                        z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                kk = k0 + i * W + h * R + offs_r
                q = _codes_minus_zero(w, z, magic, i, BITS)  # [R, BLOCK_N], exact
                if SWAP:
                    xp = x_ptr + rows[None, :] * stride_xm + kk[:, None]
                    if EVEN_K:
                        xt = tl.load(xp)
                    else:
                        xt = tl.load(xp, mask=(kk < K)[:, None], other=0.0)
                    part = _dot(tl.trans(q.to(xt.dtype)), xt, part, UPCAST)
                else:
                    xp = x_ptr + rows[:, None] * stride_xm + kk[None, :]
                    if EVEN_K:
                        xm = tl.load(xp)
                    else:
                        xm = tl.load(xp, mask=(kk < K)[None, :], other=0.0)
                    part = _dot(xm, q.to(xm.dtype), part, UPCAST)
                if GROUP > 0:
                    if (i + 1) % SUB == 0:
                        if (W // R == 1) or (SUB < SLOTS):
                            if SWAP:
                                acc += part * s[:, None]
                            else:
                                acc += part * s[None, :]
                            part = tl.zeros_like(acc)
        if GROUP > 0:
            if (W // R > 1) and (SUB == SLOTS):  # 8-bit, group ≥ block: one scale per block
                if SWAP:
                    acc += part * s[:, None]
                else:
                    acc += part * s[None, :]
                part = tl.zeros_like(acc)
    if GROUP == 0:
        if SWAP:
            acc = part * s[:, None]
        else:
            acc = part * s[None, :]
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


FMA_CONFIGS = [_cfg(w, 1, BLOCK_N=bn, SPLIT_K=sk)
               for bn in (64, 128, 256) for sk in (1, 2, 4, 8, 16) for w in (4, 8)
               if not (bn == 64 and w == 8)]
GEMV_MMA_CONFIGS = [_cfg(4 if bn < 256 else 8, st, BLOCK_M=16, BLOCK_N=bn, SPLIT_K=sk)
                    for bn in (64, 128, 256) for sk in (1, 2, 4, 8) for st in (2, 3)]
MID_MMA_CONFIGS = [_cfg(4, st, BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=sk)
                   for bm in (32, 64) for bn in (64, 128) for sk in (1, 2, 4) for st in (2, 3)]
TILED_MMA_CONFIGS = [_cfg(w, st, BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=1)
                     for bm, bn, w in ((64, 128, 4), (128, 128, 4), (128, 128, 8), (256, 128, 8),
                                       (128, 256, 8), (64, 256, 8))
                     for st in (2, 3)]


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


def wna16_matmul(x: torch.Tensor, p: PackedWNA16, impl: str = "auto",
                 config: dict | None = None) -> torch.Tensor:
    """`x [M, K]` (bf16/fp16, contiguous rows) times the packed weight → `[M, N]` in x's dtype.

    impl: "auto" (M = 1 → fma, M ≤ 16 → gemv mma, M ≤ 64 → mid mma, else tiled), or one of
    "fma", "gemv", "mid", "tiled". `config` (meta-parameters plus num_warps/num_stages) skips
    autotuning — the tests use it to run one small config under the interpreter."""
    if not p.kernel_ok:
        raise ValueError(f"group size {p.group_size} unsupported by the Triton kernels")
    assert x.dim() == 2 and x.shape[1] == p.in_features and x.stride(1) == 1
    m, k = x.shape
    n = p.out_features
    if p.perm is not None:
        x = x.index_select(1, p.perm)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    kb = p.qweight.shape[0] // p.words_per_block
    ng = p.scales.shape[0]
    g = p.group_constexpr
    sub = 32 // p.bits if g == 0 or g >= BLOCK_K else g // p.words_per_block
    ws = workspace(x.device, m * n, torch.float32)
    cnt = workspace(x.device, triton.cdiv(m, 1) * triton.cdiv(n, 16) + 1, torch.int32)
    if impl == "auto":
        impl = "fma" if m == 1 else "gemv" if m <= 16 else "mid" if m <= 64 else "tiled"
    common = dict(BITS=p.bits, GROUP=g, SUB=sub, EVEN_K=k % BLOCK_K == 0)
    args = (x, p.qweight, p.scales, p.zeros, y, ws, cnt)
    if impl == "fma":
        kern = _wna16_fma_kernel if config else _FMA
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"], m)  # noqa: E731
        kern[grid](*args, n, k, kb, ng, x.stride(0), y.stride(0), MAGIC, **common, **(config or {}))
        return y
    tuned = {"gemv": _MMA_GEMV, "mid": _MMA_MID, "tiled": _MMA_TILED}[impl]
    kern = _wna16_mma_kernel if config else tuned
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]),  # noqa: E731
                         meta["SPLIT_K"])
    kern[grid](*args, m, n, k, kb, ng, x.stride(0), y.stride(0), MAGIC, **common, UPCAST=_interpret(),
               **(config or {}))
    return y
