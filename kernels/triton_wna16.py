"""Triton kernels for weight-only int4/int8 GEMM (W4A16, W8A16) on the packed layout of
kernels/layout.py. Imported lazily: needs triton.

**M ≤ 64 (decode, small batches): `_wna16_kernel`.** It computes Yᵀ = W·Xᵀ: the weights are
the MMA's A operand, taken from registers, and the token count is the MMA's narrow side (padded
to 16). Per block of 8 word rows (64 k for int4) and per K = 16 slice d:

* the `[BLOCK_N, 8]` word tile becomes the A fragment with one LOP3 (and a shift) per two
  codes: `(w >> d·bits) & 0x000F000F | magic` is the half-precision pair `128 + q` (bf16) or
  `1024 + q` (fp16), already in the register order of the fragment (layout.kernel_k_order),
  and one packed add of `−(magic + z)` makes it the exact `q − z` (FAST). Triton sees that
  the join/reshape into `[BLOCK_N, 16]` only renames registers, so the one layout conversion
  left moves the packed words (0.5 byte per weight), not the dequantized operand. Without
  FAST (the CPU interpreter, 8-bit codes under bf16, groups smaller than a block) each code
  goes through float32 instead (`_codes_f32`);
* the MMA reads the contiguous activations `x[16d : 16d + 16]`;
* the scale multiplies each group's partial product once per output (group ≥ block), or each
  weight before the MMA (smaller groups), or the result once (per-channel).

Split-K (SPLIT_K programs along K per output tile) writes float32 partials into a workspace;
a counter per tile elects the last program, which sums the partials in split order
(deterministic) and writes the output, then resets the counter — no memset per call and
CUDA-graph replays stay correct. One workspace per device: calls on different streams must
not overlap.

**M > 64 (prefill): `_dequant_kernel` + cuBLAS.** Once the MMA work per weight is large,
dequantizing the whole weight to the activation dtype (one pass, the same `_operand` code)
and running a bf16/fp16 GEMM beats re-dequantizing every weight in every M tile (vLLM does
the same for AWQ at ≥ 256 tokens).

Measured on an H200 (benchmarks/results/gemm_nvidia_h200.md, CUDA graphs, L2 flushed): on the
Qwen2-7B MLP shapes W4A16 runs at 1.6–1.8× bf16 cuBLAS at M = 1 (level with torch's
tinygemm) and 1.5–1.6× at M = 16 (tinygemm: 0.5–0.6×), and at 0.73–0.97× of bf16 at
M = 64; prefill sizes are within 5–15% of bf16. The decode kernel reaches only ~30% of the
copy bandwidth: per program it is latency-bound (Nsight Compute: ~10 cycles between issues
per warp, mostly waiting on global loads; occupancy 25% from ~100–120 registers), and the
issue cost is ~3 instructions per weight, of which the dequantization is ~1.4.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from quantlab.kernels.layout import BLOCK_K, PackedWNA16

MAGIC32 = 0x4B000000  # float32 bits of 2^23


@triton.jit
def _dequant_pairs(p, nz, BITS: tl.constexpr, FP16: tl.constexpr):
    """Packed pairs of shifted codes (`p`: int16 `[BN, 16]`, two per register) → the exact
    half-precision `q − z`: one LOP3 (`& mask | magic` gives the pair `magic + q`, magic 128
    for bf16, 1024 for fp16) and one packed add of `nz = −(magic + z)`. Inline PTX because
    Triton would unpack the pair; ptxas keeps the constants in registers."""
    if FP16:
        if BITS == 4:
            out = tl.inline_asm_elementwise(
                "{.reg .b32 m, o, t; mov.b32 m, 0x64006400; mov.b32 o, 0x3C003C00; "
                "lop3.b32 t, $1, 0x000F000F, m, 0xEA; fma.rn.f16x2 $0, t, o, $2;}",
                "=r,r,r", [p, nz], dtype=tl.float16, is_pure=True, pack=2)
        else:
            out = tl.inline_asm_elementwise(
                "{.reg .b32 m, o, t; mov.b32 m, 0x64006400; mov.b32 o, 0x3C003C00; "
                "lop3.b32 t, $1, 0x00FF00FF, m, 0xEA; fma.rn.f16x2 $0, t, o, $2;}",
                "=r,r,r", [p, nz], dtype=tl.float16, is_pure=True, pack=2)
    else:
        out = tl.inline_asm_elementwise(
            "{.reg .b32 m, o, t; mov.b32 m, 0x43004300; mov.b32 o, 0x3F803F80; "
            "lop3.b32 t, $1, 0x000F000F, m, 0xEA; fma.rn.bf16x2 $0, t, o, $2;}",
            "=r,r,r", [p, nz], dtype=tl.bfloat16, is_pure=True, pack=2)
    return out


@triton.jit
def _zero_operand(z, DT: tl.constexpr, FAST: tl.constexpr):
    """Per-column zero point as the dequantization wants it: `−(magic + z)` in DT (exact) for
    FAST, float32 z otherwise. (A run-time magic would stop Triton from moving the layout
    conversion onto the words: it only rematerializes chains of constants and loads.)"""
    if FAST:
        if DT == tl.float16:
            out = (-(z + 1024.0)).to(DT)
        else:
            out = (-(z + 128.0)).to(DT)
    else:
        out = z
    return out


@triton.jit
def _codes_f32(w, z, magic32, SH: tl.constexpr, BITS: tl.constexpr):
    """Code at bits [SH, SH + BITS) of every word as the exact float32 `q − z`:
    `q | 0x4B000000` read as float32 is `2^23 + q`."""
    v = (((w >> SH) & ((1 << BITS) - 1)) | magic32).to(tl.float32, bitcast=True)
    return v - (z + 8388608.0)


@triton.jit
def _operand(w, d: tl.constexpr, zo, s, magic32,
             BITS: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr, SCALE_IN: tl.constexpr):
    """K = 16 slice d of the word tile `w [BN, 8]` as the MMA operand `[BN, 16]` (k = 2j + h).

    Joining the two 16-bit halves of `w >> d·bits` and reshaping only renames registers, and
    every other op between the word load and the MMA is elementwise with constant or
    per-column operands, so Triton leaves one layout conversion, on the packed words.
    `zo`: `_zero_operand`."""
    SH: tl.constexpr = d * BITS
    if FAST:
        t = w >> SH
        pairs = tl.reshape(tl.join(t.to(tl.int16), (t >> 16).to(tl.int16)),
                           (w.shape[0], 2 * w.shape[1]))
        out = _dequant_pairs(pairs, zo, BITS, DT == tl.float16)
    else:
        lo = _codes_f32(w, zo, magic32, SH, BITS)
        hi = _codes_f32(w, zo, magic32, SH + 16, BITS)
        if SCALE_IN:
            lo = lo * s
            hi = hi * s
        out = tl.reshape(tl.join(lo.to(DT), hi.to(DT)), (w.shape[0], 2 * w.shape[1]))
    return out


@triton.jit
def _finish(acc, y_ptrs, ws_ptrs, MN, mask, cnt_ptr, tile, pid_k, split_k, OUT: tl.constexpr):
    """Store a tile, or its split-K partial; the last split to arrive sums them in order."""
    if split_k == 1:
        tl.store(y_ptrs, acc.to(OUT), mask=mask)
    else:
        tl.store(ws_ptrs + pid_k * MN, acc, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == split_k - 1:
            total = tl.zeros_like(acc)
            for i in range(split_k):
                total += tl.load(ws_ptrs + i * MN, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(OUT), mask=mask)
            tl.store(cnt_ptr + tile, 0)


@triton.jit
def _small_group_params(s_ptr, z_ptr, k0, offs_j, offs_n, n_mask, N, NG, GROUP: tl.constexpr):
    """Scale and zero per word of one K = 16 slice (groups smaller than a block; the two
    codes of a pair, k = 2j and 2j + 1, share a group because groups are even)."""
    g = tl.minimum((k0 + 2 * offs_j) // GROUP, NG - 1)
    off = g[None, :] * N + offs_n[:, None]
    s = tl.load(s_ptr + off, mask=n_mask[:, None], other=0.0).to(tl.float32)
    z = tl.load(z_ptr + off, mask=n_mask[:, None], other=0.0).to(tl.float32)
    return s, z


@triton.jit
def _col_params(p_ptr, g, offs_n, n_mask, N):
    """One group's scales or zeros for the tile's columns, float32 `[BN, 1]`."""
    return tl.load(p_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """tl.dot; UPCAST computes in f32 (the Triton 3.9 interpreter's bf16 dot is wrong)."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _slice_operand(w, d: tl.constexpr, zo, s, s_ptr, z_ptr, k0, offs_j, offs_n, n_mask, N, NG,
                   magic32, BITS: tl.constexpr, GROUP: tl.constexpr, GMODE: tl.constexpr,
                   DT: tl.constexpr, FAST: tl.constexpr):
    """Slice d of the block at k0 as `[BN, 16]` in DT: exact `q − z`, or `(q − z)·s` for
    groups smaller than a block (GMODE 2, whose scales and zeros are loaded per slice)."""
    if GMODE == 2:
        sd, zd = _small_group_params(s_ptr, z_ptr, k0 + 16 * d, offs_j, offs_n, n_mask, N, NG,
                                     GROUP)
        a = _operand(w, d, zd, sd, magic32, BITS, DT, False, True)
    else:
        a = _operand(w, d, zo, s, magic32, BITS, DT, FAST, False)
    return a


@triton.jit
def _wna16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, cnt_ptr,
                  M, N, K, NBLK, NG, stride_xm, stride_ym, magic32, MB, SPLIT_K,
                  BITS: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
                  FAST: tl.constexpr, UPCAST: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, U: tl.constexpr,
                  PF: tl.constexpr = True):
    """See the module docstring. NBLK: blocks of 8 word rows (BK = 8·32/bits k each); U blocks
    per loop iteration (fewer when a group is smaller than U blocks). With groups of whole
    blocks (GMODE 1) an iteration lies in one group: its partial product is scaled once, and
    with PF the next group's scales and zeros are loaded an iteration ahead. MB (the M
    bucket) is only the autotuning key."""
    BK: tl.constexpr = 256 // BITS  # 64 k per block for int4, 32 for int8
    D: tl.constexpr = 16 // BITS  # K = 16 slices per block
    GMODE: tl.constexpr = 0 if GROUP == 0 else (1 if GROUP % BK == 0 else 2)
    UU: tl.constexpr = U if GMODE != 1 or GROUP % (U * BK) == 0 else 1
    DT: tl.constexpr = x_ptr.dtype.element_ty
    OUT: tl.constexpr = y_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = offs_m % M  # rows past M re-read row m % M; never stored
    offs_j = tl.arange(0, 8)
    offs_16 = tl.arange(0, 16)
    iters = NBLK // UU
    per = tl.cdiv(iters, SPLIT_K)
    i0 = pid_k * per
    i1 = tl.minimum(i0 + per, iters)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    g_next = tl.minimum(i0 * UU * BK // (GROUP if GROUP > 0 else 1), NG - 1)
    s_next = _col_params(s_ptr, g_next, offs_n, n_mask, N)
    z_next = _col_params(z_ptr, g_next, offs_n, n_mask, N)
    s = s_next
    zo = _zero_operand(z_next, DT, FAST)
    w_base = qw_ptr + offs_j[None, :] * N + offs_n[:, None]
    x_base = x_ptr + rows[None, :] * stride_xm + offs_16[:, None]
    for it in range(i0, i1):
        k_it = it * UU * BK
        if GMODE == 1:
            # PF: this iteration's group was loaded one iteration ahead (the 1-element-per-
            # thread loads are too narrow for Triton's cp.async pipelining). K-pad blocks:
            # any finite scale (x is 0 there).
            if PF:
                s = s_next
                zo = _zero_operand(z_next, DT, FAST)
                g_next = tl.minimum((k_it + UU * BK) // GROUP, NG - 1)
                s_next = _col_params(s_ptr, g_next, offs_n, n_mask, N)
                z_next = _col_params(z_ptr, g_next, offs_n, n_mask, N)
            else:
                g = tl.minimum(k_it // GROUP, NG - 1)
                s = _col_params(s_ptr, g, offs_n, n_mask, N)
                zo = _zero_operand(_col_params(z_ptr, g, offs_n, n_mask, N), DT, FAST)
            part = tl.zeros_like(acc)
        else:
            part = acc
        for u in tl.static_range(UU):
            k0 = k_it + u * BK
            w = tl.load(w_base + (k0 // BK) * 8 * N, mask=n_mask[:, None], other=0)  # [BN, 8]
            for d in tl.static_range(D):
                a = _slice_operand(w, d, zo, s, s_ptr, z_ptr, k0, offs_j, offs_n, n_mask, N,
                                   NG, magic32, BITS, GROUP, GMODE, DT, FAST)
                kk = k0 + 16 * d
                if EVEN_K:
                    xt = tl.load(x_base + kk)
                else:
                    xt = tl.load(x_base + kk, mask=(kk + offs_16 < K)[:, None], other=0.0)
                part = _dot(a, xt, part, UPCAST)
        if GMODE == 1:
            acc += part * s
        else:
            acc = part
    if GMODE == 0:
        acc = acc * s
    mask = n_mask[:, None] & (offs_m < M)[None, :]
    _finish(acc, y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None],
            ws_ptr + offs_m[None, :] * N + offs_n[:, None], M * N, mask, cnt_ptr,
            pid_m * tl.num_programs(0) + pid_n, pid_k, SPLIT_K, OUT)


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, K, NG, magic32,
                    BITS: tl.constexpr, GROUP: tl.constexpr, FAST: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """`w [N, K]` (DT) = the dequantized weight of one block of 8 word rows per program."""
    BK: tl.constexpr = 256 // BITS
    D: tl.constexpr = 16 // BITS
    GMODE: tl.constexpr = 0 if GROUP == 0 else (1 if GROUP % BK == 0 else 2)
    DT: tl.constexpr = w_ptr.dtype.element_ty
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k0 = tl.program_id(1) * BK
    offs_j = tl.arange(0, 8)
    offs_16 = tl.arange(0, 16)
    g = tl.minimum(k0 // (GROUP if GROUP > 0 else 1), NG - 1)
    s = _col_params(s_ptr, g, offs_n, n_mask, N)
    zo = _zero_operand(_col_params(z_ptr, g, offs_n, n_mask, N), DT, FAST)
    w = tl.load(qw_ptr + (k0 // BK * 8 + offs_j)[None, :] * N + offs_n[:, None],
                mask=n_mask[:, None], other=0)
    for d in tl.static_range(D):
        a = _slice_operand(w, d, zo, s, s_ptr, z_ptr, k0, offs_j, offs_n, n_mask, N, NG,
                           magic32, BITS, GROUP, GMODE, DT, FAST)
        if GMODE != 2:
            a = (a.to(tl.float32) * s).to(DT)
        kk = k0 + 16 * d + offs_16
        tl.store(w_ptr + offs_n[:, None] * K + kk[None, :], a,
                 mask=n_mask[:, None] & (kk < K)[None, :])


# ---------------------------------------------------------------------------------------------
# Configs and launch

def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def _bucket(m: int) -> int:
    return min(triton.next_power_of_2(m), 64)


def _cfg(bm: int, bn: int, sk: int, warps: int, stages: int, u: int = 2, pf: bool = True,
         maxnreg: int | None = None) -> triton.Config:
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=sk, U=u, PF=pf), num_warps=warps,
                         num_stages=stages, maxnreg=maxnreg)


# Per M bucket, from benchmarks/wna16_sweep.py on an H200: decode (BLOCK_M = 16, split-K so
# that about one wave of programs fills the GPU) and small batches. Split-K is a run-time
# argument, so it costs no compiles.
CONFIGS = {
    16: [_cfg(16, 128, sk, 4, 2, pf=pf, maxnreg=r) for sk in (1, 2, 4, 8, 16)
         for pf in (True, False) for r in (None, 96)]
    + [_cfg(16, bn, sk, 4, 2, pf=pf) for bn, pf in ((256, False), (64, True))
       for sk in (2, 4, 8, 16)]
    + [_cfg(16, 64, sk, 4, 2, 1) for sk in (16, 32)],  # small N: one block per program
    64: [_cfg(64, 128, sk, 8, 2, pf=pf) for sk in (1, 2, 4, 8) for pf in (True, False)]
    + [_cfg(64, 64, sk, 4, 3, pf=False) for sk in (1, 2, 4, 8)]
    + [_cfg(64, 256, sk, 8, 2, pf=False) for sk in (1, 2, 4)],
}
DECODE_MAX_M = 64  # above: dequantize + cuBLAS
DEQUANT_BLOCK_N = 128


def _prune(configs, named_args, **_):
    """Keep configs whose grid gives 1–16 programs per SM and ≥ 1 iteration per split."""
    n, nblk, m = named_args["N"], named_args["NBLK"], named_args["M"]
    sms = _num_sms(named_args["y_ptr"].device)
    scored = []
    for c in configs:
        kw = c.kwargs
        if kw["SPLIT_K"] > 1 and nblk // kw["U"] < kw["SPLIT_K"]:
            continue
        progs = triton.cdiv(n, kw["BLOCK_N"]) * triton.cdiv(m, kw["BLOCK_M"]) * kw["SPLIT_K"]
        scored.append((progs, c))
    keep = [c for p, c in scored if sms <= p <= 16 * sms]
    if keep:
        return keep
    if not scored:
        return [min(configs, key=lambda c: c.kwargs["SPLIT_K"])]
    best = max(p for p, _ in scored) if all(p < sms for p, _ in scored) else \
        min(p for p, _ in scored)
    return [c for p, c in scored if p == best]


def _bench(fn, quantiles):
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


TUNERS = {b: triton.autotune(configs=c, key=["MB", "N", "K", "BITS", "GROUP"],
                             prune_configs_by={"early_config_prune": _prune}, do_bench=_bench,
                             cache_results=True)(_wna16_kernel)
          for b, c in CONFIGS.items()}

_WORKSPACE: dict[tuple, torch.Tensor] = {}


def workspace(device: torch.device, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A buffer per device and dtype, grown on demand (the counters are zero between calls)."""
    key = (str(device), dtype)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.zeros(max(numel, 1 << 16), dtype=dtype, device=device)
        _WORKSPACE[key] = buf
    return buf


# One small config per M bucket for the CPU interpreter (autotuning there would run every config).
INTERPRET_CONFIGS = {
    16: dict(BLOCK_M=16, BLOCK_N=32, SPLIT_K=2, U=1),
    64: dict(BLOCK_M=32, BLOCK_N=32, SPLIT_K=2, U=2),
}


def _fast(p: PackedWNA16, dtype: torch.dtype) -> bool:
    """The packed half-precision dequantization (inline PTX): int4, or int8 under fp16."""
    return not _interpret() and (p.bits == 4 or dtype == torch.float16)


def dequantize(p: PackedWNA16, dtype: torch.dtype) -> torch.Tensor:
    """The weight `[N, K]` in `dtype` (the stored column order), one Triton pass."""
    n, k = p.out_features, p.in_features
    w = torch.empty(n, k, dtype=dtype, device=p.qweight.device)
    grid = (triton.cdiv(n, DEQUANT_BLOCK_N), triton.cdiv(k, 256 // p.bits))
    _dequant_kernel[grid](p.qweight, p.scales, p.zeros, w, n, k, p.scales.shape[0], MAGIC32,
                          BITS=p.bits, GROUP=p.group_constexpr, FAST=_fast(p, dtype),
                          BLOCK_N=DEQUANT_BLOCK_N, num_warps=4)
    return w


def wna16_matmul(x: torch.Tensor, p: PackedWNA16, impl: str = "auto",
                 config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, K]` (bf16/fp16, unit column stride) times the packed weight → `[M, N]` in x's dtype.

    impl: "auto" (M ≤ 64: the fused kernel, else dequantize + cuBLAS), "fused" or
    "dequant"; the older kernels' names ("fma", "gemv", "mid", "tiled") mean "fused".
    `config` (meta-parameters, optionally num_warps/num_stages/maxnreg) skips autotuning the
    fused kernel; under TRITON_INTERPRET=1 a fixed small config is used. `out` (contiguous
    `[M, N]`) is written in place."""
    if not p.kernel_ok:
        raise ValueError(f"group size {p.group_size} unsupported by the Triton kernels")
    assert x.dim() == 2 and x.shape[1] == p.in_features and x.stride(1) == 1
    assert x.dtype in (torch.bfloat16, torch.float16), f"bf16/fp16 activations, got {x.dtype}"
    m, k = x.shape
    n = p.out_features
    if p.perm is not None:
        x = x.index_select(1, p.perm)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.is_contiguous() and out.dtype == x.dtype
    if m == 0:
        return out
    if impl == "dequant" or (impl == "auto" and m > DECODE_MAX_M and config is None):
        return torch.matmul(x, dequantize(p, x.dtype).t(), out=out)
    bucket = 16 if m <= 16 else 64
    if config is None and _interpret():
        config = INTERPRET_CONFIGS[bucket]
    nblk = p.qweight.shape[0] // 8
    if config is None:  # the largest split-K the autotuner may pick for this shape
        kept = _prune(CONFIGS[bucket], dict(N=n, NBLK=nblk, M=m, y_ptr=out))
        max_split = max(c.kwargs["SPLIT_K"] for c in kept)
    else:
        max_split = config["SPLIT_K"]
    ws = workspace(x.device, max_split * m * n if max_split > 1 else 1, torch.float32)
    cnt = workspace(x.device, triton.cdiv(m, 16) * triton.cdiv(n, 16) + 1, torch.int32)
    args = (x, p.qweight, p.scales, p.zeros, out, ws, cnt, m, n, k, nblk, p.scales.shape[0],
            x.stride(0), out.stride(0), MAGIC32, _bucket(m))
    common = dict(BITS=p.bits, GROUP=p.group_constexpr, EVEN_K=k % BLOCK_K == 0,
                  FAST=_fast(p, x.dtype), UPCAST=_interpret())
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]),  # noqa: E731
                         meta["SPLIT_K"])
    if config is not None:
        _wna16_kernel[grid](*args, **common, **config)
    else:
        TUNERS[bucket][grid](*args, **common)
    return out
