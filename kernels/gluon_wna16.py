"""W4A16 at M ≤ 64 on Hopper, written in Gluon (Triton's explicit-layout dialect) so that the
weights reach the tensor cores without a trip through shared memory in registers' order.
Imported lazily: needs triton with Gluon and an sm_90 GPU to run (the CPU tests compile it).

Why a second kernel. The Triton tensor-core kernel (`triton_wna16._wna16_kernel`) leaves the
layouts to the compiler, which moves either the packed words or the dequantized operand
through shared memory into wgmma's register order: 5 CTA barriers per iteration and 20%
occupancy (Nsight Compute, H100, M = 16). Here the layouts are chosen:

* The accumulator `[BN, BM]` (weight columns × tokens) is wgmma's layout, `ACC`.
* The int32 word tile `[BN, 8]` is loaded from its TMA buffer in `DotOperandLayout(0, ACC,
  k_width=1)`. That gives each thread words j = lane % 4 and j + 4 of rows lane / 4 and + 8:
  under our packing (`layout.kernel_k_order`), those words' 16-bit halves are exactly the
  thread's bf16/fp16 pairs k = 2j, 2j + 1 of a K = 16 slice in `DotOperandLayout(0, ACC,
  k_width=2)`, the register operand wgmma takes. Splitting each word into its halves and
  joining them back along k is a renaming (`convert_layout(..., assert_trivial=True)`
  compiles only if it is).
* Dequantization is the same LOP3 + packed FMA as the Triton kernel's (`q − z` exact in the
  half type), then one wgmma per K = 16 slice reads the activations straight from their TMA
  buffer (a 16-column view of a 128B-swizzled `[BM, 128]` tile).
* Scales and zeros are loaded per thread in the slice layouts they are used in, a group
  ahead.
* Split-K partials move in a layout of 4 columns per thread (`_finish`). Each program adds
  its partial into a float32 accumulator per tile with 16-byte vector atomics, and the last
  program to arrive (a counter, as in `split_k`) writes the tile. Addition in arrival order
  is not deterministic, so under `torch.use_deterministic_algorithms(True)` the partials are
  stored instead and the last program sums them in split order. That ordered sum cost qwen_down
  about 2.8 µs at M = 16 (128 columns, split 14): its last program reads 112 KB of partials.

One group of 128 k (two blocks of 8 word rows) per iteration through a STAGES-deep ring of
TMA buffers. Tiles: 16, 32 or 64 tokens (wgmma's N), 64 or 128 weight columns; `plan` picks
them and the split. One warpgroup per program, or two on 128 columns (`warps=8`, only through
an explicit config; the auto path does not pick it). Scope: int4 with groups of 128, bf16/fp16 activations, N a multiple of
64, the padded K of 128, M ≤ 64, sm_90.

Measured on an H100 through the auto path (`benchmarks/gemm.py --ms 1,16,64`, atomic sums):
qwen_up M = 16 20.6 µs = 2.56× bf16 cuBLAS, qwen_down 19.7 µs = 2.66× (22.9 µs with the
ordered sum). On an H200 the same two are 2.02× and 2.21× (benchmarks/results/gemm_nvidia_h200.md):
there the kernel is bound by its own latency, not by the bytes it reads. At M = 64 every benchmark shape is faster than bf16,
1.13× on qwen_qkv to 2.00× on qwen_down; the Triton kernel was 0.86–0.98× on the attention
shapes. The layout matters for the ordered sum at M = 64: read in wgmma's layout (a thread's
values N apart, 4-byte loads), each split cost about 1 µs, and qwen_down took 33.6 µs at
split 16 against 28.5 at split 7.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from quantlab.kernels.common import cuda_capability, sm_count
from quantlab.kernels.layout import PackedWNA16
from quantlab.kernels.split_k import atomic_sums, split_buffers

# Names that moved between Triton releases: the CTA barrier (`thread_barrier` in 3.6,
# `barrier` later) and the TMA load (`async_copy_global_to_shared`, later `async_load`).
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

GROUP = 128  # k per group and per iteration: two blocks of 8 int4 word rows
BLOCK_NS = (64, 128)  # weight columns per program: one or two wgmma row tiles of 64
BLOCK_MS = (16, 32, 64)  # token tiles (wgmma's N): the smallest that holds M is used
MAX_M = BLOCK_MS[-1]


@dataclass(frozen=True)
class TileRule:
    """How `plan` sizes the grid for one token tile: split K so that about `per_sm` programs
    run per SM, at most `cap` splits of at least `min_groups` groups each; take 128 columns
    (N permitting) where those tiles still give `wide_share` of that many programs, else 64
    (None: always 64)."""

    per_sm: float
    cap: int
    wide_share: float | None
    min_groups: int = 2


# Per way of summing the split-K partials and token tile, fitted to H100 sweeps of explicit
# configs on all eight benchmark shapes. The ordered sum reads every partial in the last program, so it favours
# fewer, smaller partials (at M = 64 qwen_down ran 28.5 µs at split 7, 33.6 at 16); the
# atomic one reads one tile whatever the split.
RULES = {"ordered": {16: TileRule(3.4, 16, 0.75, 3), 32: TileRule(4, 12, None),
                     64: TileRule(3, 8, None)},
         "atomic": {16: TileRule(3, 16, 0.5), 32: TileRule(2.5, 16, 0.5), 64: TileRule(3, 12, None)}}

# `(w & 0x000F000F) | magic` is the half pair `magic + q`; one packed FMA with `-(magic + z)`
# gives the exact `q − z` (magic 128 for bf16, 1024 for fp16); the pair leaves as two halves.
_DEQUANT_BF16 = gl.constexpr(
    "{.reg .b32 m, o, t, r; mov.b32 m, 0x43004300; mov.b32 o, 0x3F803F80; "
    "lop3.b32 t, $2, 0x000F000F, m, 0xEA; fma.rn.bf16x2 r, t, o, $3; mov.b32 {$0, $1}, r;}")
_DEQUANT_FP16 = gl.constexpr(
    "{.reg .b32 m, o, t, r; mov.b32 m, 0x64006400; mov.b32 o, 0x3C003C00; "
    "lop3.b32 t, $2, 0x000F000F, m, 0xEA; fma.rn.f16x2 r, t, o, $3; mov.b32 {$0, $1}, r;}")


@gluon.jit
def _issue(w_desc, x_desc, bar, w_buf, x_buf, g, off_n):
    """Start the TMA copies of group g's words `[16, BN]` and activations `[BM, 128]`."""
    mbarrier.expect(bar, w_desc.block_type.nbytes + x_desc.block_type.nbytes)
    _tma_load(w_desc, [g * 16, off_n], bar, w_buf)
    _tma_load(x_desc, [0, g * 128], bar, x_buf)


@gluon.jit
def _slice_operand(w, d: gl.constexpr, nz, A_L: gl.constexpr, FP16: gl.constexpr):
    """K = 16 slice d of a block's words `[BN, 8]` as the register operand `[BN, 16]`."""
    if FP16:
        lo, hi = gl.inline_asm_elementwise(_DEQUANT_FP16, "=h,=h,r,r", [w >> (4 * d), nz],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=1)
    else:
        lo, hi = gl.inline_asm_elementwise(_DEQUANT_BF16, "=h,=h,r,r", [w >> (4 * d), nz],
                                           dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
    return gl.convert_layout(gl.reshape(gl.join(lo, hi), [w.shape[0], 16]), A_L, assert_trivial=True)


@gluon.jit
def _zero_pairs(z, FP16: gl.constexpr):
    """`-(magic + z)` as the packed half pair the dequantization adds, int32 `[BN, 1]`."""
    if FP16:
        nz = (-(z + 1024.0)).to(gl.float16).to(gl.int16, bitcast=True)
    else:
        nz = (-(z + 128.0)).to(gl.bfloat16).to(gl.int16, bitcast=True)
    nz = nz.to(gl.int32) & 0xFFFF
    return gl.expand_dims(nz | (nz << 16), 1)


@gluon.jit
def _w4_kernel(w_desc, x_desc, s_ptr, z_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, NG,
               STAGES: gl.constexpr, RED: gl.constexpr, ATOMIC: gl.constexpr,
               num_warps: gl.constexpr):
    """One `[BN, BM]` tile of Yᵀ over the split `program_id(1)` of the K groups; see the
    module docstring."""
    BN: gl.constexpr = w_desc.block_type.shape[1]
    BM: gl.constexpr = x_desc.block_type.shape[0]
    FP16: gl.constexpr = x_desc.dtype == gl.float16
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BM, 16])  # 8 warps: 2 warpgroups
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    W_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=1)
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    split = gl.num_programs(1)
    off_n = pid_n * BN
    per = gl.cdiv(NG, split)
    g0 = pid_k * per
    g1 = gl.minimum(g0 + per, NG)

    w_s = gl.allocate_shared_memory(gl.int32, [STAGES, 16, BN], w_desc.layout)
    x_s = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, 128], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES - 1):
        if g0 + i < g1:
            _issue(w_desc, x_desc, bars.index(i), w_s.index(i), x_s.index(i), g0 + i, off_n)

    z_cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, W_L))
    s_cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
    g_first = gl.minimum(g0, NG - 1)  # a split past the last group loads nothing else
    z_next = gl.load(z_ptr + g_first * N + z_cols)
    s_next = gl.load(s_ptr + g_first * N + s_cols)
    acc = gl.zeros([BN, BM], gl.float32, ACC)
    for g in range(g0, g1):
        it = g - g0
        st = it % STAGES
        if g + STAGES - 1 < g1:  # refill the buffer the previous iteration's wgmma released
            ns = (it + STAGES - 1) % STAGES
            _issue(w_desc, x_desc, bars.index(ns), w_s.index(ns), x_s.index(ns), g + STAGES - 1, off_n)
        nz = _zero_pairs(z_next.to(gl.float32), FP16)
        sc = s_next.to(gl.float32)
        g_next = gl.minimum(g + 1, NG - 1)
        z_next = gl.load(z_ptr + g_next * N + z_cols)
        s_next = gl.load(s_ptr + g_next * N + s_cols)
        mbarrier.wait(bars.index(st), (it // STAGES) & 1)
        part = gl.zeros([BN, BM], gl.float32, ACC)
        for u in gl.static_range(2):
            w = w_s.index(st).slice(8 * u, 8, dim=0).permute((1, 0)).load(W_L)
            nz_w = nz + gl.zeros_like(w)
            for d in gl.static_range(4):
                a = _slice_operand(w, d, nz_w, A_L, FP16)
                xb = x_s.index(st).slice(64 * u + 16 * d, 16, dim=1).permute((1, 0))
                part = warpgroup_mma(a, xb, part, is_async=True)
        part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
        acc += part * gl.expand_dims(sc, 1)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    _finish(acc, y_ptr, ws_ptr, cnt_ptr, M, N, pid_n, pid_k, split, RED, ATOMIC)


@gluon.jit
def _finish(acc, y_ptr, ws_ptr, cnt_ptr, M, N, pid_n, pid_k, split, RED: gl.constexpr,
            ATOMIC: gl.constexpr):
    """Write the tile `acc [BN, BM]` (weight columns × tokens) to `y [M, N]`. Split, each
    program adds its partial into the tile's float32 accumulator (ATOMIC: order of arrival) or
    stores it (else), and the program arriving last writes y: from the accumulator, which it
    zeroes for the next call, or from every stored partial summed in split order
    (deterministic). In a layout of 4 consecutive columns per thread: stores, loads and the
    atomic adds are 16-byte, coalesced along N (in wgmma's layout each thread holds pairs of
    tokens, N elements apart: at M = 64 the ordered sum was bound by load count). Partials and
    accumulators sit tile by tile, whole `[BM, BN]` blocks, so they need no mask."""
    BN: gl.constexpr = acc.shape[0]
    BM: gl.constexpr = acc.shape[1]
    TN: gl.constexpr = 32 if BN >= 128 else BN // 4
    OUT: gl.constexpr = gl.BlockedLayout([4, 1], [TN, 32 // TN], [1, gl.num_warps()], [0, 1])
    out = gl.convert_layout(acc, OUT)
    cols = gl.arange(0, BN, layout=gl.SliceLayout(1, OUT))
    rows = gl.arange(0, BM, layout=gl.SliceLayout(0, OUT))
    y_offs = gl.expand_dims(rows, 0) * N + gl.expand_dims(pid_n * BN + cols, 1)
    y_mask = gl.expand_dims(rows < M, 0) & gl.expand_dims(cols < BN, 1)  # (cols: the tile's shape)
    if split > 1:
        in_tile = gl.expand_dims(rows, 0) * BN + gl.expand_dims(cols, 1)
        tile_ws = ws_ptr + pid_n * (BN * BM) + in_tile
        stride = gl.num_programs(0) * (BN * BM)  # one split's partials
        if ATOMIC:
            gl.atomic_add(tile_ws, out, sem="relaxed")
        else:
            gl.store(tile_ws + pid_k * stride, out)
        _cta_barrier()
        arrived = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if arrived == split - 1:
            if ATOMIC:
                out = gl.load(tile_ws, cache_modifier=".cg")
                gl.store(tile_ws, gl.zeros_like(out))
            else:
                out = _ordered_sum(tile_ws, stride, split, RED, OUT, BN, BM)
            gl.store(cnt_ptr + pid_n, 0)
            gl.store(y_ptr + y_offs, out.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        gl.store(y_ptr + y_offs, out.to(y_ptr.dtype.element_ty), mask=y_mask)


@gluon.jit
def _ordered_sum(tile_ws, stride, split, RED: gl.constexpr, L: gl.constexpr, BN: gl.constexpr,
                 BM: gl.constexpr):
    """Every split's stored partial of a tile, summed in split order, RED loads per round."""
    out = gl.zeros([BN, BM], gl.float32, L)
    whole = split // RED * RED
    for sk in range(0, whole, RED):  # RED independent loads per round
        for i in gl.static_range(RED):
            out += gl.load(tile_ws + (sk + i) * stride, cache_modifier=".cg")
    for sk in range(whole, split):
        out += gl.load(tile_ws + sk * stride, cache_modifier=".cg")
    return out


MIN_WEIGHTS = 1 << 20  # N·K from which the auto path takes this kernel: it beat the Triton
# kernel on all 8 benchmark shapes at M = 16, 32 and 64, down to qwen_kv (3584 × 512; H100);
# smaller weights were not measured


@dataclass(frozen=True)
class Plan:
    """One launch's shape: `block_n` weight columns × `block_m` tokens per program, the K groups
    split over `split` programs, a `stages`-deep TMA ring; the split-K partials added
    atomically (`atomic`), or stored and summed in split order, `red` loads per round; `warps`
    4 (one warpgroup) or 8 (two, each 64 of 128 columns: half the dequantization and wgmma
    chain per thread, for the latency the kernel is bound by at M = 16 on an H200)."""

    block_n: int
    block_m: int
    split: int
    stages: int
    red: int
    atomic: bool
    warps: int = 4


def preferred(p: PackedWNA16) -> bool:
    """Whether the auto path should take this kernel for a weight it supports."""
    return p.out_features * p.in_features >= MIN_WEIGHTS


def supports(x: torch.Tensor, p: PackedWNA16) -> bool:
    """Whether this kernel takes the call: int4 in groups of 128, 1–MAX_M contiguous bf16/fp16
    token rows with 16-byte aligned starts, N a multiple of 64 and the padded K of 128, no
    act-order gather, on an sm_90 GPU."""
    return ((cuda_capability(x) or (0, 0))[0] == 9
            and p.bits == 4 and p.group_size == GROUP and p.perm is None
            and x.dtype in (torch.bfloat16, torch.float16) and 1 <= x.shape[0] <= MAX_M
            and x.is_contiguous() and x.data_ptr() % 16 == 0
            and p.out_features % BLOCK_NS[0] == 0 and (p.qweight.shape[0] * 8) % GROUP == 0
            and p.in_features % 8 == 0 and p.scales.dtype == x.dtype)


def split_for(tiles: int, groups: int, sms: int, rule: TileRule) -> int:
    """The split that puts about `rule.per_sm` programs on each SM, within the rule's cap and
    group minimum."""
    return max(1, min(round(rule.per_sm * sms / tiles), rule.cap, groups // rule.min_groups))


def plan(m: int, n: int, groups: int, sms: int, block_n: int | None = None,
         split: int | None = None, stages: int = 2, red: int | None = None,
         atomic: bool | None = None, warps: int = 4) -> Plan:
    """The launch for `[m, K] · [K, n]`: the smallest token tile that holds m; atomic adds of
    the partials unless torch is asked for deterministic algorithms; 128 or 64 columns and
    the split by RULES; for the ordered sum, as many partials per round as fit in 64
    registers a thread. Any of them can be forced."""
    block_m = next(b for b in BLOCK_MS if b >= m)
    atomic = atomic_sums() if atomic is None else atomic
    rule = RULES["atomic" if atomic else "ordered"][block_m]
    narrow, wide = BLOCK_NS
    if warps not in (4, 8):
        raise ValueError(f"warps must be 4 or 8 (one or two warpgroups), got {warps}")
    if warps == 8:  # each warp 16 of the tile's columns
        block_n = block_n or wide
        if block_n != wide:
            raise ValueError(f"8 warps need block_n {wide} (16 columns a warp), got {block_n}")
    if block_n is None:
        use_wide = (rule.wide_share is not None and n % wide == 0
                    and n // wide * split_for(n // wide, groups, sms, rule)
                    >= rule.wide_share * rule.per_sm * sms)
        block_n = wide if use_wide else narrow
    if n % block_n:
        raise ValueError(f"block_n {block_n} must divide N = {n}")
    split = split or split_for(n // block_n, groups, sms, rule)
    red = red or max(1, min(8, 64 * 128 // (block_n * block_m)))
    return Plan(block_n, block_m, split, stages, red, atomic, warps)


@functools.lru_cache(maxsize=None)
def _shared_layouts(dtype: torch.dtype, block_n: int, block_m: int):
    half = gl.float16 if dtype == torch.float16 else gl.bfloat16
    return (gl.NVMMASharedLayout.get_default_for([16, block_n], gl.int32),
            gl.NVMMASharedLayout.get_default_for([block_m, GROUP], half))


def w4_matmul(x: torch.Tensor, p: PackedWNA16, out: torch.Tensor, **forced) -> torch.Tensor:
    """`out [M, N] = x [M, K] · Wᵀ` for the calls `supports` accepts (the TMA boxes read the
    tokens past M and the k past K, up to the padded K of the weights, as zeros). `forced`:
    any of `plan`'s block_n, split, stages, red, atomic, warps."""
    m = x.shape[0]
    n = p.out_features
    groups = p.qweight.shape[0] * 8 // GROUP
    pl = plan(m, n, groups, sm_count(x.device, 1), **forced)
    w_layout, x_layout = _shared_layouts(x.dtype, pl.block_n, pl.block_m)
    w_desc = TensorDescriptor.from_tensor(p.qweight, [16, pl.block_n], w_layout)
    x_desc = TensorDescriptor.from_tensor(x, [pl.block_m, GROUP], x_layout)  # rows ≥ M, k ≥ K read as 0
    ws, cnt = split_buffers(x.device, pl.block_m, n, pl.split, pl.atomic)  # whole token tiles
    _w4_kernel[(n // pl.block_n, pl.split)](w_desc, x_desc, p.scales, p.zeros, out, ws, cnt, m, n, groups,
                                            STAGES=pl.stages, RED=pl.red, ATOMIC=pl.atomic,
                                            num_warps=pl.warps)
    return out
