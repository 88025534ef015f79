"""Triton kernels for weight-only int4/int8 GEMM (W4A16, W8A16) on the packed layout of
kernels/layout.py (one format per bit width: K permuted within blocks of 8 words,
`layout.kernel_k_order`). Imported lazily: needs triton.

`wna16_matmul` picks one of three paths by the token count M:

**M = 1: `_gemv_kernel`, CUDA-core FMAs** (per-channel scales or groups of whole blocks).
Each thread owns 4 columns × the 8 words of a block, so the K reduction stays in registers.
The next block's words, activations, scales and zeros are loaded before the current block is
used (Triton software-pipelines only loads that feed dots; without this prefetch each block
waits on its activation and scale loads: +10–20% time at int4 g128 on an H200). With STAGES
the words instead go through `tl.range`'s software pipeline (cp.async into shared memory,
STAGES − 1 blocks ahead; the other loads keep the register prefetch): the autotuner picks 3
stages on every shape on an H100 and an H200 (qwen_up H200 17.1 → 15.8 µs). Codes are
taken in *stored* order, and the activations are gathered in that same order (`_stored_k`, a
few index operations once per program) — a GEMV needs no particular K order. Two ways to turn
a code into a float (the autotuner picks; on an H200 it picks the first on every MLP shape):

* DENORM: the masked bits *are* the float — a denormal `q·2^(sh − 149)` — and each block's
  activations are scaled by `2^(64 − sh)` once, so the product is `q·x·2^−85`, a normal float
  as exact as `q·x`: one LOP3 and one FMA per code, and the zero point leaves the inner loop
  (`Σ (q − z)·x = Σ q·x − z·Σ x`). 941 SASS instructions per loop iteration against 1219
  (747 with the products accumulated into a `[BN, 8]` tile by FMA: the same time on an H200);
  qwen_down at M = 1 22.2 → 20.5 µs, llama_up 20.4 → 18.6 µs.
* `_codes_minus_zero`: `(w & mask) | 2^23` as float, one FMA gives the exact float32 `q − z`,
  then the product: two float ops per code.

**2 ≤ M ≤ 64 (and M = 1 with smaller groups): `_wna16_kernel`, tensor cores.** It computes
Yᵀ = W·Xᵀ: the weights are the MMA's A operand, taken from registers, and the token count is
the MMA's narrow side (padded to 16). Two ways to build the operand:

* FAST (int4, or int8 under fp16), per block of 8 words and K = 16 slice d: the `[BLOCK_N, 8]`
  word tile becomes the A fragment with one LOP3 (and a shift) per two codes:
  `(w >> d·bits) & 0x000F000F | magic` is the half-precision pair `128 + q` (bf16) or
  `1024 + q` (fp16), already in the register order of the fragment (layout.kernel_k_order),
  and one packed add of `−(magic + z)` makes it the exact `q − z`. Triton sees that the
  join/reshape into `[BLOCK_N, 16]` only renames registers, so the one layout conversion left
  moves the packed words (0.5 byte per weight), not the dequantized operand. The MMA reads the
  contiguous activations `x[16d : 16d + 16]`.
* JOIN (int8 under bf16 — 128 + q does not fit bf16's 8 bits — and the CPU interpreter): the
  iteration's `[BLOCK_N, 8·U]` words become the whole `[BLOCK_N, U·BK]` operand at once
  (float32 `q − z` per code, one LOP3 and one FMA, joined along new register axes and
  permuted into k order, `_block_operand`), and one dot takes the contiguous activations.
* Groups smaller than a block scale each weight before the MMA (per K = 16 slice).

TMA (a config key, Hopper): the words come in as bulk tensor copies through a descriptor
(`_word_desc`; one instruction per block of 8 word rows, the column tail zero-filled) instead
of per-thread cp.async. On an H100 the autotuner picks it on every MLP and q shape at M = 16
and 64 (qwen_up M = 16 27.6 → 24.2 µs, qwen_down 28.0 → 24.6 µs) and keeps per-thread copies on
the K/V shapes. (For the M = 1 GEMV the same copies were never picked and were dropped.)

The scale multiplies each group's partial product once per output (groups of whole
iterations), or the result once (per-channel).

**M > 64 (prefill): `_dequant_kernel` + cuBLAS.** Once the MMA work per weight is large,
dequantizing the whole weight to the activation dtype (one pass, the same operand code) and
running a bf16/fp16 GEMM beats re-dequantizing every weight in every M tile (vLLM does the
same for AWQ at ≥ 256 tokens).

Split-K (SPLIT_K programs along K per output tile) sums its partials deterministically
(`split_k.py`), except in the plain GEMV, which adds them atomically (`ATOMIC`) unless torch
is in deterministic mode. The autotuner gets, per shape, the splits that fill whole waves of
programs (`split_k.WAVES`; not only powers of 2), timed as CUDA-graph replays
(`ops.autotune_bench`).

Speed: `benchmarks/gemm.py` (CUDA graphs, L2 flushed clean before each run) against bf16 cuBLAS,
torch's tinygemm and the read floor (a kernel that only reads the weight's bytes). W4A16 g128 at
M = 1 on the Qwen2-7B / Llama-3-8B MLP shapes, H200: 2.25–2.56× bf16 and faster than tinygemm,
against 2.77–3.09× for the read floor (benchmarks/results/gemm_nvidia_h200.md); H100, Qwen2-7B:
2.81–3.03× (gemm_nvidia_h100_80gb_hbm3.md). The H200's faster memory makes the fixed cost of a
single call a larger share. W8A16 at M = 1: 1.6–1.7× bf16 on an H200. On Hopper, int4 in groups
of 128 at 2 ≤ M ≤ 64 on large weights goes to the Gluon version of the tensor-core kernel
(`gluon_wna16`).
What bounds them (Nsight Compute, before DENORM): the GEMV was issue-bound — 4.1 instructions per weight (LOP3, the float32 `q − z`,
the FMA, and the activations' trip through shared memory), 255 registers, 8 warps per SM, one
issued every 1.7 cycles; the tensor-core kernel at M = 16 waits on global loads (occupancy
25%) and at M = 64 on shared memory (the MIO queue, 52% of stalls).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from quantlab.kernels import gemv_epilogue as epi
from quantlab.kernels.common import autotune_bench, interpret_mode, pdl_launch, sm_count, use_triton
from quantlab.kernels.layout import BLOCK_K, PackedWNA16
from quantlab.kernels.split_k import (atomic_sums, largest_split, split_buffers, split_total,
                                      split_workspaces, wave_splits)

MAGIC32 = 0x4B000000  # float32 bits of 2^23


# ---------------------------------------------------------------------------------------------
# Dequantization


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
def _high(w):
    """The upper 16 bits of every word (logical shift)."""
    return (w.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)


@triton.jit
def _codes_minus_zero(w, zero, magic, I: tl.constexpr, BITS: tl.constexpr):
    """Code in slot I (bits [BITS·I, BITS·(I+1))) of every word as exact float32 `q − z`.

    `(w & mask) | 0x4B000000` read as float is `2^23 + q·2^sh`; one FMA with `2^−sh` and
    `−(2^(23−sh) + z)` gives `q − z` exactly, with no int→float conversion. Slots past bit 16
    expect the caller to pass `_high(w)`. `magic` (0x4B000000) comes in as a run-time
    argument: as an immediate, ptxas splits the and/or into two LOP3s. `zero` broadcasts."""
    PER_HALF: tl.constexpr = 16 // BITS
    SH: tl.constexpr = (I % PER_HALF) * BITS
    MASK: tl.constexpr = ((1 << BITS) - 1) << SH
    v = ((w & MASK) | magic).to(tl.float32, bitcast=True)
    return v * (1.0 / (1 << SH)) - (zero + 8388608.0 / (1 << SH))


@triton.jit
def _stored_k(pos, BITS: tl.constexpr):
    """Source k of stored code positions `pos` (layout.kernel_k_order): position
    `BK·b + P·j + (P/2)·h + d` holds k = `BK·b + 16·d + 2·j + h`."""
    P: tl.constexpr = 32 // BITS
    BK: tl.constexpr = 8 * P
    within = pos % BK
    s = within % P
    return pos - within + 16 * (s % (P // 2)) + 2 * (within // P) + s // (P // 2)


@triton.jit
def _block_operand(w, zero, magic, BITS: tl.constexpr, DT: tl.constexpr):
    """Word tile `[BN, 8·UB]` (UB whole blocks) → exact `q − z` in DT `[BN, UB·BK]`, in
    natural k order: float32 codes per slot, joined along new register axes into
    `[BN, b, j, h, d]` and permuted to `[BN, b, d, j, h]` (k = BK·b + 16·d + 2·j + h). Triton
    folds the permute into the operand's one trip through shared memory, and the activations
    load contiguously."""
    BN: tl.constexpr = w.shape[0]
    UB: tl.constexpr = w.shape[1] // 8
    wh = _high(w)
    if BITS == 4:  # slot s = 4·h + d
        s0 = tl.join(_codes_minus_zero(w, zero, magic, 0, 4).to(DT),
                     _codes_minus_zero(wh, zero, magic, 4, 4).to(DT))
        s1 = tl.join(_codes_minus_zero(w, zero, magic, 1, 4).to(DT),
                     _codes_minus_zero(wh, zero, magic, 5, 4).to(DT))
        s2 = tl.join(_codes_minus_zero(w, zero, magic, 2, 4).to(DT),
                     _codes_minus_zero(wh, zero, magic, 6, 4).to(DT))
        s3 = tl.join(_codes_minus_zero(w, zero, magic, 3, 4).to(DT),
                     _codes_minus_zero(wh, zero, magic, 7, 4).to(DT))
        t = tl.join(tl.join(s0, s2), tl.join(s1, s3))  # [BN, word, h, d1, d0], d = 2·d1 + d0
        t = tl.permute(tl.reshape(t, (BN, UB, 8, 2, 2, 2)), (0, 1, 4, 5, 2, 3))
    else:  # slot s = 2·h + d
        s0 = tl.join(_codes_minus_zero(w, zero, magic, 0, 8).to(DT),
                     _codes_minus_zero(wh, zero, magic, 2, 8).to(DT))
        s1 = tl.join(_codes_minus_zero(w, zero, magic, 1, 8).to(DT),
                     _codes_minus_zero(wh, zero, magic, 3, 8).to(DT))
        t = tl.join(s0, s1)  # [BN, word, h, d]
        t = tl.permute(tl.reshape(t, (BN, UB, 8, 2, 2)), (0, 1, 4, 2, 3))
    return tl.reshape(t, (BN, UB * (256 // BITS)))


@triton.jit
def _operand(w, d: tl.constexpr, zo, s, magic32,
             BITS: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr, SCALE_IN: tl.constexpr):
    """K = 16 slice d of the word tile `w [BN, 8]` as the MMA operand `[BN, 16]` (k = 2j + h).

    Joining the two 16-bit halves of `w >> d·bits` and reshaping only renames registers, and
    every other op between the word load and the MMA is elementwise with constant or
    per-column operands, so Triton leaves one layout conversion, on the packed words.
    `zo`: `_zero_operand`."""
    if FAST:
        t = w >> (d * BITS)
        pairs = tl.reshape(tl.join(t.to(tl.int16), (t >> 16).to(tl.int16)),
                           (w.shape[0], 2 * w.shape[1]))
        out = _dequant_pairs(pairs, zo, BITS, DT == tl.float16)
    else:
        lo = _codes_minus_zero(w, zo, magic32, d, BITS)
        hi = _codes_minus_zero(_high(w), zo, magic32, d, BITS)
        if SCALE_IN:
            lo = lo * s
            hi = hi * s
        out = tl.reshape(tl.join(lo.to(DT), hi.to(DT)), (w.shape[0], 2 * w.shape[1]))
    return out


# ---------------------------------------------------------------------------------------------
# Shared pieces of the kernels


@triton.jit
def _finish(acc, y_ptrs, ws_ptrs, MN, mask, cnt_ptr, tile, pid_k, split_k, OUT: tl.constexpr,
            ONE_LOAD: tl.constexpr = False, SPLIT_P2: tl.constexpr = 1,
            ATOMIC: tl.constexpr = False):
    """Store a tile, or its split-K partial; the last split to arrive stores the sum
    (`split_k.split_total`)."""
    last, total = split_total(acc, ws_ptrs, MN, mask, cnt_ptr, tile, pid_k, split_k, ONE_LOAD,
                              SPLIT_P2, ATOMIC)
    if last:
        tl.store(y_ptrs, total.to(OUT), mask=mask)


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
    """tl.dot; UPCAST computes in exact f32, not tf32: the Triton 3.9 interpreter's bf16 dot is
    wrong, and a float32 kernel on a GPU must match torch's float32 math."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
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


# ---------------------------------------------------------------------------------------------
# M = 1: CUDA-core GEMV


@triton.jit
def _fma_code(acc, w, z, xs, magic, I: tl.constexpr, BITS: tl.constexpr, DENORM: tl.constexpr):
    """`acc [BN, 8] += codes · x` of slot I: one FMA per code. (A per-slot `tl.sum` over the
    8 words compiles to a tree of 4 FMUL + 4 FFMA + 4 FADD per 8 codes instead of 8 FFMA.)"""
    if DENORM:
        codes = _denormal_code(w, I, BITS)
    else:
        codes = _codes_minus_zero(w, z, magic, I, BITS)
    return tl.fma(codes, xs[None, :], acc)


@triton.jit
def _fma_codes(w, z, xv, magic, BITS: tl.constexpr, DENORM: tl.constexpr):
    """Σ (q − z)·x over one block `w [BN, 8]`, slot by slot: `xv [8·P]` (stored order, slot s
    of word j at P·j + s) is split into the P per-slot vectors by register-only reshapes.
    DENORM: Σ q·x from denormal codes (`_denormal_code`) and activations scaled by
    `_denormal_scale`, minus z·Σ x once per block."""
    if DENORM:
        xsum = tl.sum(xv, axis=0)
        xv = xv * _denormal_scale(tl.arange(0, xv.shape[0]), BITS)
    if DENORM and BITS == 4:
        wh = (w.to(tl.uint32, bitcast=True) >> 12).to(tl.int32, bitcast=True)
    else:
        wh = _high(w)
    acc = tl.zeros(w.shape, dtype=tl.float32)
    if BITS == 4:
        even, odd = tl.split(tl.reshape(xv, (8, 2, 2, 2)))  # [j, b2, b1, b0] → b0
        e0, e1 = tl.split(even)
        o0, o1 = tl.split(odd)
        x0, x4 = tl.split(e0)
        x2, x6 = tl.split(e1)
        x1, x5 = tl.split(o0)
        x3, x7 = tl.split(o1)
        acc = _fma_code(acc, w, z, x0, magic, 0, 4, DENORM)
        acc = _fma_code(acc, w, z, x1, magic, 1, 4, DENORM)
        acc = _fma_code(acc, w, z, x2, magic, 2, 4, DENORM)
        acc = _fma_code(acc, w, z, x3, magic, 3, 4, DENORM)
        acc = _fma_code(acc, w if DENORM else wh, z, x4, magic, 4, 4, DENORM)
        acc = _fma_code(acc, wh, z, x5, magic, 5, 4, DENORM)
        acc = _fma_code(acc, wh, z, x6, magic, 6, 4, DENORM)
        acc = _fma_code(acc, wh, z, x7, magic, 7, 4, DENORM)
    else:
        even, odd = tl.split(tl.reshape(xv, (8, 2, 2)))  # [j, b1, b0] → b0
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        acc = _fma_code(acc, w, z, x0, magic, 0, 8, DENORM)
        acc = _fma_code(acc, w, z, x1, magic, 1, 8, DENORM)
        acc = _fma_code(acc, wh, z, x2, magic, 2, 8, DENORM)
        acc = _fma_code(acc, wh, z, x3, magic, 3, 8, DENORM)
    acc = tl.sum(acc, axis=1)
    if DENORM:  # Σ (q − z)·x = Σ q·x − z·Σ x
        acc = acc * (2.0 ** (149 - DENORM_X)) - tl.reshape(z, (w.shape[0],)) * xsum
    return acc


@triton.jit
def _denormal_code(w, I: tl.constexpr, BITS: tl.constexpr):
    """Code in slot I as a float32 denormal — the masked bits themselves, `q·2^(sh − 149)`
    (sh: where its bits sit, below float32's exponent field at bit 23). int4: slots 0–4
    (bits 0–19) in the word itself, slots 5–7 in the word shifted right by 12 (bits 8–19): one
    shift per word. int8: each 16-bit half (slots 2–3 from `_high(w)`)."""
    SH: tl.constexpr = ((4 * I if I <= 4 else 4 * I - 12) if BITS == 4 else (I % 2) * 8)
    return (w & (((1 << BITS) - 1) << SH)).to(tl.float32, bitcast=True)


DENORM_X = tl.constexpr(64)  # the activations' scale 2^64: code × x products are normal floats


@triton.jit
def _denormal_scale(pos, BITS: tl.constexpr):
    """Per stored position, the activation's factor `2^(DENORM_X − sh)` (sh: where its code
    sits in the register `_denormal_code` masks), as float32 bits. A denormal code `q·2^(sh − 149)` times the
    scaled activation is `q·x·2^(DENORM_X − 149)`, a normal float for |q·x| ≥ 2^−41, exact as
    float32 `q·x` is; activations up to 2^64 do not overflow."""
    slot = pos % (32 // BITS)
    if BITS == 4:
        sh = 4 * slot - tl.where(slot > 4, 12, 0)
    else:
        sh = (slot % 2) * 8
    exponent = tl.full(pos.shape, 127 + DENORM_X, tl.int32) - sh
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def _gemv_inputs(x_row, s_ptr, z_ptr, b, b1, k_in, s, z, offs_n, n_mask, N, K, NG,
                 BITS: tl.constexpr, GROUP: tl.constexpr):
    """Block b's activations (stored order, float32; zeros past K or when b ≥ b1) and, with
    groups, its scales and zeros (K-pad blocks: any finite scale, x is 0 there)."""
    BK: tl.constexpr = 256 // BITS
    kk = b * BK + k_in
    # A limit of 0 masks a block past the split (scalar & tensor masks upset the interpreter).
    inside = kk < tl.where(b < b1, K, 0)
    xv = tl.load(x_row + kk, mask=inside, other=0.0).to(tl.float32)
    if GROUP > 0:
        g = tl.minimum(b * BK // GROUP, NG - 1)
        s = _col_params(s_ptr, g, offs_n, n_mask, N)
        z = _col_params(z_ptr, g, offs_n, n_mask, N)
    return xv, s, z


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A PDL kernel's first step: under `ops.PdlTrigger.START` (2) the next kernel may launch."""
    if PDL == 2:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the previous kernel's writes (any PDL mode); under `ops.PdlTrigger.AFTER_WAIT`
    (3) the next kernel may launch from here."""
    if PDL > 0:
        gdc_wait()
    if PDL == 3:
        gdc_launch_dependents()


@triton.jit
def _gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, cnt_ptr,
                 M, N, K, NBLK, NG, stride_xm, stride_ym, magic32,
                 BITS: tl.constexpr, GROUP: tl.constexpr,
                 SPLIT_K, BLOCK_N: tl.constexpr, SPLIT_P2: tl.constexpr, PF: tl.constexpr = True,
                 DENORM: tl.constexpr = False, PDL: tl.constexpr = 0,
                 STAGES: tl.constexpr = 1, EPI: tl.constexpr = 0, HEAD_D: tl.constexpr = 128,
                 ATOMIC: tl.constexpr = False,
                 e_row_ptr=None, e_w_ptr=None, e_y2_ptr=None, e_cos_ptr=None, e_sin_ptr=None,
                 e_pos_ptr=None, e_kc_ptr=None, e_vc_ptr=None, e_eps=0.0, e_nq=0, e_nkv=0,
                 e_cache_s=0, c_m_ptr=None, c_l_ptr=None, c_acc_ptr=None, c_nsplit=1, c_group=1,
                 C_BLOCK_G: tl.constexpr = 16, C_NSPLIT_P2: tl.constexpr = 1):
    """See the module docstring; one token row per grid row (program_id 2). A `[BLOCK_N, 8]`
    block with BLOCK_N = 128·num_warps gives each thread all 8 words of its 4 columns. GROUP:
    0 (per-channel) or a multiple of the block (one group per block). The next block's words
    are loaded before the current one is used; with PF its activations, scales and zeros too
    (each iteration would otherwise wait on those loads).

    PDL (launched with `launch_pdl=True`, Hopper's programmatic dependent launch): with
    STAGES = 1 the first block's words, scales and zeros are loaded before waiting on the
    previous kernel, which wrote x — weights never depend on it; the staged loop's prologue
    comes after the wait. The next kernel may launch after the loop (PDL = 1), from the start
    (2) or after the wait (3; `ops.PdlTrigger`). Nothing in the workspace is touched before
    the wait, so overlapping GEMVs share it safely.

    STAGES > 1: the words come through Triton's software pipeline instead (`tl.range` with
    num_stages: cp.async into STAGES − 1 shared-memory buffers ahead of the one in use), so
    each program keeps several blocks in flight without holding them in registers; the
    one-block register prefetch of the words is then off.

    ATOMIC (EPI = 0): the splits add their partials into `split_k.split_accumulators` in
    arrival order, and the last one reads the one row of sums, instead of storing them for it
    to sum in split order.

    EPI (M = 1): what the program completing a column tile does with it instead of storing it
    (`gemv_epilogue`); the `e_*` arguments are its inputs. With `c_acc_ptr` (M = 1) the
    program first writes its K range of x itself, the attention output combined from the
    flash-decoding partials `c_*` (`gemv_epilogue.combine_heads`; heads of HEAD_D)."""
    BK: tl.constexpr = 256 // BITS
    OUT: tl.constexpr = y_ptr.dtype.element_ty
    pdl_start(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_j = tl.arange(0, 8)
    k_in = _stored_k(tl.arange(0, BK), BITS)  # source k of a block's stored positions
    per = tl.cdiv(NBLK, SPLIT_K)
    b0 = pid_k * per
    b1 = tl.minimum(b0 + per, NBLK)
    x_row = x_ptr + m * stride_xm
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    s = _col_params(s_ptr, 0, offs_n, n_mask, N)
    z = _col_params(z_ptr, 0, offs_n, n_mask, N)
    w_ptrs = qw_ptr + (b0 * 8 + offs_j)[None, :] * N + offs_n[:, None]
    if STAGES == 1:
        w_next = tl.load(w_ptrs, mask=(offs_n < tl.where(b0 < b1, N, 0))[:, None], other=0)
    pdl_wait(PDL)
    k1 = tl.minimum(b1 * BK, K)  # this split's K range is [b0·BK, k1)
    if c_acc_ptr is not None:
        epi.combine_heads(c_m_ptr, c_l_ptr, c_acc_ptr, x_row, b0 * BK, k1, c_nsplit, c_group,
                          C_BLOCK_G, HEAD_D, C_NSPLIT_P2)
    if EPI >= epi.RMS_SWIGLU:
        sumsq = epi.slice_sumsq(e_row_ptr, b0 * BK, k1)
    if PF:
        x_next, s_next, z_next = _gemv_inputs(x_row, s_ptr, z_ptr, b0, b1, k_in, s, z, offs_n,
                                              n_mask, N, K, NG, BITS, GROUP)
    for b in tl.range(b0, b1, num_stages=STAGES):
        if STAGES == 1:
            w = w_next
            w_ptrs += 8 * N
            w_next = tl.load(w_ptrs, mask=(offs_n < tl.where(b + 1 < b1, N, 0))[:, None],
                             other=0)
        else:
            w = tl.load(qw_ptr + (b * 8 + offs_j)[None, :] * N + offs_n[:, None],
                        mask=n_mask[:, None], other=0)
        if PF:
            xv, s, z = x_next, s_next, z_next
            x_next, s_next, z_next = _gemv_inputs(x_row, s_ptr, z_ptr, b + 1, b1, k_in, s, z,
                                                  offs_n, n_mask, N, K, NG, BITS, GROUP)
        else:
            xv, s, z = _gemv_inputs(x_row, s_ptr, z_ptr, b, b1, k_in, s, z, offs_n, n_mask, N,
                                    K, NG, BITS, GROUP)
        part = _fma_codes(w, z, xv, magic32, BITS, DENORM)
        if GROUP > 0:
            acc += part * tl.reshape(s, (BLOCK_N,))
        else:
            acc += part
    if PDL == 1:
        gdc_launch_dependents()
    if GROUP == 0:
        acc = acc * tl.reshape(s, (BLOCK_N,))
    if EPI == epi.PLAIN:
        _finish(acc, y_ptr + m * stride_ym + offs_n, ws_ptr + m * N + offs_n, M * N, n_mask,
                cnt_ptr, m * tl.num_programs(0) + pid_n, pid_k, SPLIT_K, OUT, True, SPLIT_P2,
                ATOMIC)
    else:
        rms_parts = ws_ptr + SPLIT_K * N + pid_n * SPLIT_P2  # past the partials (M = 1)
        if EPI >= epi.RMS_SWIGLU and SPLIT_K > 1:
            tl.store(rms_parts + pid_k, sumsq)
        last, total = split_total(acc, ws_ptr + offs_n, N, n_mask, cnt_ptr, pid_n, pid_k,
                                  SPLIT_K, True, SPLIT_P2)
        if last:
            if EPI == epi.RESIDUAL:
                epi.residual(total, offs_n, n_mask, y_ptr, e_row_ptr, e_w_ptr, e_y2_ptr, OUT)
            else:
                total *= epi.inv_rms(rms_parts, sumsq, pid_k, SPLIT_K, K, e_eps, SPLIT_P2)
                if EPI == epi.RMS_SWIGLU:
                    epi.swiglu(total, pid_n, N, y_ptr, BLOCK_N, OUT)
                else:
                    epi.rope_cache(total, pid_n, y_ptr, e_w_ptr, e_cos_ptr, e_sin_ptr, e_pos_ptr,
                                   e_kc_ptr, e_vc_ptr, e_nq, e_nkv, e_cache_s, BLOCK_N, HEAD_D,
                                   OUT)


# ---------------------------------------------------------------------------------------------
# 2 ≤ M ≤ 64: tensor cores


@triton.jit
def _wna16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, cnt_ptr, w_desc,
                  M, N, K, NBLK, NG, stride_xm, stride_ym, magic32, MB, SPLIT_K,
                  BITS: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
                  FAST: tl.constexpr, UPCAST: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, U: tl.constexpr,
                  PF: tl.constexpr = True, JOIN: tl.constexpr = False, TMA: tl.constexpr = False):
    """See the module docstring. NBLK: blocks of 8 word rows (BK = 8·32/bits k each); U blocks
    per loop iteration (fewer when a group is smaller than U blocks). With groups of whole
    blocks (GMODE 1) an iteration lies in one group: its partial product is scaled once, and
    with PF the next group's scales and zeros are loaded an iteration ahead. JOIN builds each
    iteration's operand at once (not with FAST; groups smaller than a block ignore it). MB
    (the M bucket) is only the autotuning key."""
    BK: tl.constexpr = 256 // BITS  # 64 k per block for int4, 32 for int8
    D: tl.constexpr = 16 // BITS  # K = 16 slices per block
    GMODE: tl.constexpr = 0 if GROUP == 0 else (1 if GROUP % BK == 0 else 2)
    UU: tl.constexpr = U if GMODE != 1 or GROUP % (U * BK) == 0 else 1
    WHOLE: tl.constexpr = JOIN and GMODE != 2
    tl.static_assert(not (JOIN and FAST), "JOIN takes float32 codes, not the FAST pairs")
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
    if WHOLE:
        w_base = qw_ptr + tl.arange(0, 8 * UU)[None, :] * N + offs_n[:, None]
        x_base = x_ptr + rows[None, :] * stride_xm + tl.arange(0, UU * BK)[:, None]
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
        if WHOLE:
            w = tl.load(w_base + (k_it // BK) * 8 * N, mask=n_mask[:, None], other=0)
            a = _block_operand(w, zo, magic32, BITS, DT)  # [BN, UU·BK]
            if EVEN_K:
                xt = tl.load(x_base + k_it)
            else:
                xt = tl.load(x_base + k_it, mask=(k_it + tl.arange(0, UU * BK) < K)[:, None],
                             other=0.0)
            part = _dot(a, xt, part, UPCAST)
        else:
            for u in tl.static_range(UU):
                k0 = k_it + u * BK
                if TMA:
                    w = tl.trans(w_desc.load([(k0 // BK) * 8, pid_n * BLOCK_N]))
                else:
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


# ---------------------------------------------------------------------------------------------
# M > 64: dequantize, then cuBLAS


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


def _bucket(m: int) -> int:
    return min(triton.next_power_of_2(m), 64)


def _word_block(nargs: dict) -> None:
    """Autotuner pre-hook: the word descriptor's box is one block of 8 word rows × the tile."""
    if nargs.get("w_desc") is not None:
        nargs["w_desc"].block_shape = [8, nargs["BLOCK_N"]]


def _cfg(bm: int, bn: int, sk: int, warps: int, stages: int, u: int = 2, pf: bool = True,
         maxnreg: int | None = None, tma: bool = False) -> triton.Config:
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=sk, U=u, PF=pf, TMA=tma),
                         num_warps=warps, num_stages=stages, maxnreg=maxnreg, pre_hook=_word_block)


# Tensor-core kernel, per M bucket, from sweeps of explicit configs on an H200: decode
# (BLOCK_M = 16, split-K so that about one wave of programs fills the GPU) and small batches.
# Split-K is a run-time argument, so it costs no compiles.
CONFIGS = {
    16: [_cfg(16, 128, sk, 4, 2, pf=pf, maxnreg=r) for sk in (1, 2, 4, 8, 16)
         for pf in (True, False) for r in (None, 96)]
    + [_cfg(16, bn, sk, 4, 2, pf=pf) for bn, pf in ((256, False), (64, True))
       for sk in (2, 4, 8, 16)]
    + [_cfg(16, 64, sk, 4, 2, 1) for sk in (16, 32)]  # small N: one block per program
    # three stages: qwen_down M = 16 28.7 µs (split 9) against 30.5 autotuned without them;
    # on the K/V shapes 64 columns without prefetch (qwen_kv 10.0 µs against 12.2, llama_kv
    # 10.4 against 12.8; bf16 10.3 and 11.2)
    + [_cfg(16, bn, sk, 4, 3, u=u, pf=pf) for bn, pf in ((128, True), (64, False)) for u in (1, 2)
       for sk in (4, 8, 16)]
    + [_cfg(16, 128, 8, 4, 3, u=4)],
    64: [_cfg(64, 128, sk, 8, 2, pf=pf) for sk in (1, 2, 4, 8) for pf in (True, False)]
    + [_cfg(64, 64, sk, 4, 3, pf=False) for sk in (1, 2, 4, 8)]
    + [_cfg(64, 256, sk, 8, 2, pf=False) for sk in (1, 2, 4)]
    # one block per iteration, 3–4 stages: 55.4 vs 62.9 µs at qwen_up M = 64
    + [_cfg(64, 128, 4, 8, st, u=1, pf=False) for st in (3, 4)]
    # 4 warps, 3 stages, prefetch: every MLP shape 1.00–1.20× bf16 (qwen_up 46.2 against 53.4
    # µs autotuned without them); smaller token tiles on the K/V shapes (qwen_kv 11.0 against 13.1)
    + [_cfg(64, 128, sk, 4, 3, u=u) for u in (1, 2) for sk in (1, 2, 4, 8)]
    + [_cfg(bm, 64, sk, 4, 3, u=2, pf=False) for bm in (16, 32) for sk in (4, 8)]
    + [_cfg(32, 128, sk, 4, 3) for sk in (2, 4)],
}
# The words through TMA (`_word_desc`; H100): three stages won every shape of the
# sweep; qwen_up M = 16 24.2 µs against 27.6 with per-thread copies, qwen_down M = 64 42.2
# against 46.8. The K/V shapes keep the per-thread copies (qwen_kv M = 16 12.1 against 10.8).
CONFIGS[16] += [_cfg(16, 128, sk, 4, 3, u=u, tma=True) for u in (1, 2) for sk in (2, 4, 8)]
CONFIGS[64] += [_cfg(bm, 128, sk, 4, 3, u=u, tma=True) for bm in (32, 64) for u in (1, 2)
                for sk in (1, 2, 4)]
# JOIN (int8 under bf16): the configs that won for the previous tile-joining int8 kernel
# (64 columns, 16 words per iteration, 3–4 stages).
JOIN_CONFIGS = {
    16: [_cfg(16, 64, sk, 4, st, pf=False) for sk in (1, 2, 4, 8, 16) for st in (3, 4)]
    + [_cfg(16, 128, sk, 4, 3, pf=False) for sk in (2, 4, 8)],
    64: [_cfg(bm, 64, sk, 4, 3, pf=False) for bm in (32, 64) for sk in (1, 2, 4, 8)],
}
def _gemv_meta(kw: dict) -> dict:
    """The GEMV's meta-parameters with SPLIT_P2 (its one-load reduction's row count) for the split."""
    return {**kw, "SPLIT_P2": triton.next_power_of_2(kw["SPLIT_K"])}


# GEMV: 128 columns per warp, split-K over blocks (the listed powers of 2 plus the WAVES
# splits). With whole-wave splits one- and two-warp programs are within 5% of each other on
# the Qwen2-7B MLP shapes at M = 1 on an H200 (qwen_up: 1 warp, split 7 = 518 programs,
# 20.5 µs; qwen_down: 2 warps, split 38, 22.2 µs; the best power of 2 22.5 and 23.4 µs;
# a sweep of explicit configs); four-warp ones slower. With DENORM the picks were
# qwen_up 2 warps split 11, 19.8 µs; qwen_down 1 warp split 38, 20.5 µs.
GEMV_CONFIGS = [triton.Config(_gemv_meta(dict(BLOCK_N=128 * w, SPLIT_K=sk, PF=pf, DENORM=dn)),
                              num_warps=w, num_stages=1, maxnreg=r)
                for w, regs in ((1, (None, 128)), (2, (None,))) for r in regs
                for sk in (4, 8, 16, 32) for pf, dn in ((True, False), (False, False), (True, True))]
# The words through the software pipeline (STAGES).
GEMV_CONFIGS += [triton.Config(_gemv_meta(dict(BLOCK_N=128 * w, SPLIT_K=sk, PF=True, DENORM=True,
                                               STAGES=st)), num_warps=w, num_stages=1)
                 for w in (1, 2, 4) for st in (3, 5) for sk in (4, 8, 16, 32)]
DECODE_MAX_M = 64  # above: dequantize + cuBLAS
DEQUANT_BLOCK_N = 128


def _with_split(c: triton.Config, split: int) -> triton.Config:
    kw = dict(c.kwargs, SPLIT_K=split)
    if "SPLIT_P2" in kw:
        kw = _gemv_meta(kw)
    return triton.Config(kw, num_warps=c.num_warps, num_stages=c.num_stages, maxnreg=c.maxnreg,
                         pre_hook=c.pre_hook)


def _split_candidates(configs, tiles_of, sms: int, cap: int | None = None) -> list[triton.Config]:
    """The listed configs plus, per distinct config apart from its split, the WAVES splits up
    to `cap` (default: the largest listed one — for the tensor-core kernel more splits, with
    their longer final reduction, were picked by the autotuner and ran slower: 20 vs 13 µs at
    K×N = 3584×512, M = 64)."""
    out, seen = [], set()
    cap = cap or max(c.kwargs["SPLIT_K"] for c in configs)
    for c in configs:
        base = (tuple(sorted((k, v) for k, v in c.kwargs.items() if k not in ("SPLIT_K", "SPLIT_P2"))),
                c.num_warps, c.num_stages, c.maxnreg)
        splits = [c.kwargs["SPLIT_K"]] + sorted(min(cap, s) for s in wave_splits(tiles_of(c), sms))
        for sk in splits:
            if (base, sk) not in seen:
                seen.add((base, sk))
                out.append(c if sk == c.kwargs["SPLIT_K"] else _with_split(c, sk))
    return out


def _prune(configs, named_args, lo: int = 1, hi: int = 16, min_iters: int = 1,
           max_split: int | None = None, **_):
    """Keep configs (with the WAVES splits added) whose grid gives lo–hi programs per SM and
    ≥ min_iters loop iterations per split (else the grid nearest that window)."""
    n, nblk, m = named_args["N"], named_args["NBLK"], named_args["M"]
    sms = sm_count(named_args["y_ptr"].device, 8)
    if "w_desc" in named_args and named_args["w_desc"] is None:
        configs = [c for c in configs if not c.kwargs.get("TMA")]

    def tiles(c: triton.Config) -> int:
        return triton.cdiv(n, c.kwargs["BLOCK_N"]) * triton.cdiv(m, c.kwargs.get("BLOCK_M", 1))

    scored = []
    for c in _split_candidates(configs, tiles, sms, max_split):
        kw = c.kwargs
        if kw["SPLIT_K"] > 1 and nblk // kw.get("U", 1) < min_iters * kw["SPLIT_K"]:
            continue
        scored.append((tiles(c) * kw["SPLIT_K"], c))
    keep = [c for p, c in scored if lo * sms <= p <= hi * sms]
    if keep:
        return keep
    if not scored:
        return [min(configs, key=lambda c: c.kwargs["SPLIT_K"])]
    best = max(p for p, _ in scored) if all(p < lo * sms for p, _ in scored) else \
        min(p for p, _ in scored)
    return [c for p, c in scored if p == best]


# The GEMV's last split reads all partials in one load: splits up to 64 stay cheap (qwen_down,
# 296 blocks: split 38 = 532 programs, 22.2 µs against 23.4 at split 32).
PRUNE = {"fused": _prune, "gemv": functools.partial(_prune, lo=2, hi=32, min_iters=2, max_split=64)}


def _tuner(kernel, configs, keys, prune):
    return triton.autotune(configs=configs, key=keys, do_bench=autotune_bench, cache_results=True,
                           prune_configs_by={"early_config_prune": prune})(kernel)


_FUSED_KEY = ["MB", "N", "K", "BITS", "GROUP"]
TUNERS = {
    "gemv": _tuner(_gemv_kernel, GEMV_CONFIGS, ["N", "K", "BITS", "GROUP", "ATOMIC"],
                   PRUNE["gemv"]),
    **{f"m{b}": _tuner(_wna16_kernel, c, _FUSED_KEY, PRUNE["fused"]) for b, c in CONFIGS.items()},
    **{f"m{b}_join": _tuner(_wna16_kernel, c, _FUSED_KEY, PRUNE["fused"])
       for b, c in JOIN_CONFIGS.items()},
}

# One small config per path for the CPU interpreter (autotuning there would run every config).
INTERPRET_CONFIGS = {
    "gemv": dict(BLOCK_N=64, SPLIT_K=2, PF=True, DENORM=True),
    16: dict(BLOCK_M=16, BLOCK_N=32, SPLIT_K=2, U=1),
    64: dict(BLOCK_M=32, BLOCK_N=32, SPLIT_K=2, U=2),
}
IMPLS = {"auto": "auto", "gemv": "gemv", "fma": "gemv", "fused": "fused", "mid": "fused",
         "tiled": "fused", "gluon": "gluon", "dequant": "dequant"}


def _fast(p: PackedWNA16, dtype: torch.dtype) -> bool:
    """The packed half-precision dequantization (inline PTX): int4, or int8 under fp16."""
    return not interpret_mode() and (p.bits == 4 or dtype == torch.float16)


def dequantize(p: PackedWNA16, dtype: torch.dtype) -> torch.Tensor:
    """The weight `[N, K]` in `dtype` (the stored column order), one Triton pass."""
    n, k = p.out_features, p.in_features
    w = torch.empty(n, k, dtype=dtype, device=p.qweight.device)
    grid = (triton.cdiv(n, DEQUANT_BLOCK_N), triton.cdiv(k, 256 // p.bits))
    _dequant_kernel[grid](p.qweight, p.scales, p.zeros, w, n, k, p.scales.shape[0], MAGIC32,
                          BITS=p.bits, GROUP=p.group_constexpr, FAST=_fast(p, dtype),
                          BLOCK_N=DEQUANT_BLOCK_N, num_warps=4)
    return w


@functools.lru_cache(maxsize=1024)
def _max_split(tuner: str, n: int, nblk: int, m: int, device: torch.device) -> int:
    """The largest split-K the autotuner may pick for a shape (sizes the workspace; cached:
    pruning builds the candidate configs, too slow to redo per eager call)."""
    prune = PRUNE["gemv" if tuner == "gemv" else "fused"]
    return largest_split(prune, TUNERS[tuner].configs, device, N=n, NBLK=nblk, M=m)


def _launch_gemv(x: torch.Tensor, p: PackedWNA16, out: torch.Tensor, config: dict | None,
                 epilogue: dict | None = None) -> None:
    m, k = x.shape[0], p.in_features
    n = p.out_features
    nblk = p.qweight.shape[0] // 8
    epilogue = epilogue or {}
    if config is None and interpret_mode():
        config = dict(INTERPRET_CONFIGS["gemv"])
        config["BLOCK_N"] = max(config["BLOCK_N"], epilogue.get("HEAD_D", 0))
    if config is not None:
        config = _gemv_meta(config)
    if config is None:
        max_split = _max_split("gemv", n, nblk, m, out.device)
    else:
        max_split = config["SPLIT_K"]
    # ATOMIC: the partials added into accumulators (plain GEMV only: an epilogue's splits also
    # store their row sums past the partials, fewer than N)
    atomic = not epilogue and (config or {}).get("ATOMIC", atomic_sums())
    ws, cnt = split_buffers(x.device, m, n, max_split + (1 if epilogue else 0), atomic)
    args = (x, p.qweight, p.scales, p.zeros, out, ws, cnt, m, n, k, nblk, p.scales.shape[0],
            x.stride(0), out.stride(0), MAGIC32)
    common = dict(BITS=p.bits, GROUP=p.group_constexpr)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"], m)  # noqa: E731
    kern = TUNERS["gemv"] if config is None else _gemv_kernel
    pdl = {} if (config or {}).get("PDL") else pdl_launch(x)
    kern[grid](*args, **common, **{**(config or {}), "ATOMIC": atomic}, **pdl, **epilogue)


def wna16_gemv_epilogue(x: torch.Tensor, p: PackedWNA16, out: torch.Tensor, epilogue: dict,
                        config: dict | None = None) -> torch.Tensor:
    """One token row `x [1, K]` times the packed weight through the GEMV, whose last split
    applies `epilogue` (`gemv_epilogue`: EPI, HEAD_D and the `e_*` inputs) and writes `out`
    (and what else the epilogue names) instead of the plain product."""
    if x.shape[0] != 1 or not p.gemv_ok or p.perm is not None or x.stride(1) != 1:
        raise ValueError("GEMV epilogues take one contiguous token row and no act-order gather")
    _launch_gemv(x, p, out, config, epilogue=epilogue)
    return out


def _launch_fused(x: torch.Tensor, p: PackedWNA16, out: torch.Tensor, config: dict | None) -> None:
    m, k = x.shape
    n = p.out_features
    bucket = 16 if m <= 16 else 64
    config = dict(config or {})
    join = config.pop("JOIN", not _fast(p, x.dtype))
    w_desc = None if join else _word_desc(p)
    if not config and interpret_mode():
        config = INTERPRET_CONFIGS[bucket]
    tuned = f"m{bucket}_join" if join else f"m{bucket}"
    nblk = p.qweight.shape[0] // 8
    if not config:
        max_split = _max_split(tuned, n, nblk, m, out.device)
    else:
        max_split = config["SPLIT_K"]
    ws, cnt = split_workspaces(x.device, m, n, max_split)
    _check_tma(config, w_desc)
    args = (x, p.qweight, p.scales, p.zeros, out, ws, cnt, w_desc, m, n, k, nblk, p.scales.shape[0],
            x.stride(0), out.stride(0), MAGIC32, _bucket(m))
    common = dict(BITS=p.bits, GROUP=p.group_constexpr, EVEN_K=k % BLOCK_K == 0,
                  FAST=_fast(p, x.dtype) and not join, UPCAST=interpret_mode(), JOIN=join)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]),  # noqa: E731
                         meta["SPLIT_K"])
    if config:
        _wna16_kernel[grid](*args, **common, **config)
    else:
        TUNERS[tuned][grid](*args, **common)


def _word_desc(p: PackedWNA16) -> TensorDescriptor | None:
    """A TMA descriptor over the packed words (Hopper's bulk copies: deeper pipelines without
    the registers and issue slots of per-thread copies), where the device has TMA and the word
    rows are 16-byte aligned; None otherwise."""
    q = p.qweight
    if q.shape[1] % 4 or not (interpret_mode() or use_triton(q, (9, 0))):
        return None
    return TensorDescriptor.from_tensor(q, [8, 16])  # the box is the config's (_word_block)


def _check_tma(config: dict | None, w_desc: TensorDescriptor | None) -> None:
    """An explicit config's TMA needs a descriptor; its box is the config's tile."""
    if not (config or {}).get("TMA"):
        return
    if w_desc is None:
        raise ValueError("TMA=True needs a TMA-capable device (sm_90+) and N a multiple of 4, "
                         "and takes no JOIN")
    _word_block({"w_desc": w_desc, **config})


def _launch(path: str, x: torch.Tensor, p: PackedWNA16, out: torch.Tensor,
            config: dict | None) -> None:
    if path == "gemv":
        _launch_gemv(x, p, out, config)
    elif path == "gluon":
        _gluon().w4_matmul(x, p, out, **(config or {}))
    elif path == "fused":
        _launch_fused(x, p, out, config)
    else:
        torch.matmul(x, dequantize(p, x.dtype).t(), out=out)


@functools.cache
def _gluon():
    """`gluon_wna16`, or None where this Triton has no Gluon (imported on first use)."""
    try:
        from quantlab.kernels import gluon_wna16
    except ImportError:
        return None
    return gluon_wna16


def _auto_path(x: torch.Tensor, p: PackedWNA16) -> str:
    """The GEMV at M = 1 (when it takes the group size), the tensor-core kernel up to
    DECODE_MAX_M — its Gluon version on Hopper where it applies and wins (`gluon_wna16`) —,
    dequantize + cuBLAS above. On an H200 the GEMV beat the tensor-core kernel at M = 1 on
    all 16 benchmark cases but one (within 4%), the tensor-core kernel beats it from M = 2
    (it reads the weights once for all tokens). The Gluon kernel also lost to the GEMV at
    M = 1 on an H100 (qwen_down 20.4 against 19.8 µs, qwen_up 19.9 against 19.1)."""
    m = x.shape[0]
    if m > DECODE_MAX_M:
        return "dequant"
    if m == 1 and p.gemv_ok:
        return "gemv"
    g = _gluon() if not interpret_mode() else None
    return "gluon" if g is not None and g.supports(x, p) and g.preferred(p) else "fused"


def wna16_matmul(x: torch.Tensor, p: PackedWNA16, impl: str = "auto",
                 config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, K]` (bf16/fp16, unit column stride) times the packed weight → `[M, N]` in x's dtype.

    impl: "auto" (see `_auto_path`), "gemv" (alias "fma"; per-channel or groups of whole
    blocks), "fused" (aliases "mid", "tiled": the tensor-core kernel), "gluon" (its Hopper
    version in `gluon_wna16`; config: block_n, split, stages, red, atomic, warps) or "dequant".
    `config` (meta-parameters, optionally num_warps/num_stages/maxnreg) skips autotuning: with
    impl "auto" it names the tensor-core kernel if it holds BLOCK_M, else the GEMV; the
    tensor-core kernel also takes JOIN (default: int8 under bf16 and the interpreter). Under
    TRITON_INTERPRET=1 a fixed small config is used. `out` (contiguous `[M, N]`) is written
    in place."""
    if not p.kernel_ok:
        raise ValueError(f"group size {p.group_size} unsupported by the Triton kernels")
    if impl not in IMPLS:
        raise ValueError(f"impl {impl!r}: choose from {', '.join(IMPLS)}")
    assert x.dim() == 2 and x.shape[1] == p.in_features and x.stride(1) == 1
    assert x.dtype in (torch.bfloat16, torch.float16), f"bf16/fp16 activations, got {x.dtype}"
    m = x.shape[0]
    if p.perm is not None:
        x = x.index_select(1, p.perm)
    if out is None:
        out = torch.empty(m, p.out_features, dtype=x.dtype, device=x.device)
    assert out.shape == (m, p.out_features) and out.is_contiguous() and out.dtype == x.dtype
    if m == 0:
        return out
    path = IMPLS[impl]
    if path == "gluon" and (_gluon() is None or not _gluon().supports(x, p)):
        raise ValueError("impl 'gluon' takes int4 in groups of 128 at M ≤ 64 on sm_90 with "
                         "Triton's Gluon (see gluon_wna16.supports)")
    if path == "auto":
        path = _auto_path(x, p) if config is None else "fused" if "BLOCK_M" in config else "gemv"
    if path == "gemv" and not p.gemv_ok:
        raise ValueError(f"the GEMV takes groups of {256 // p.bits} k or multiples, "
                         f"got {p.group_size}")
    _launch(path, x, p, out, config)
    return out
