"""W8A8 int8 and FP8 GEMM for large M on Hopper, written in Gluon so that the int8 wgmma runs
asynchronously. Imported lazily: needs triton with Gluon and an sm_90 GPU to run (the CPU
tests compile it).

Why a second kernel. Triton's software pipeliner makes a wgmma "properly async" — issued
while the previous one still runs — only when its accumulator is float32 (Triton 3.6,
`WGMMAPipeline.cpp`, "Rule 2.1"). The int8 dot accumulates in int32, so `triton_scaled`'s K
loop ends every iteration in `wgmma.wait_group 0`: the tensor cores drain before the next
tile's wgmma is issued. Its FP8 loop waits with 1 outstanding. On an H100 at M = 4096 the
int8 kernel took 20.1 µs on the Qwen2-7B K/V projection where the FP8 one, same tiles and
bytes, took 17.2. Here the loop is written out: a
STAGES-deep ring of TMA buffers, one async wgmma per K tile, `warpgroup_mma_wait(1)` so that
the previous tile's wgmma is done before its buffers are refilled.

One program per `[BM, BN]` output tile, tiles in groups of GROUP_M row tiles (as in
`triton_scaled`) so that running tiles share B in L2. The epilogue is `triton_scaled`'s: the
int8 asymmetric-zero correction, the per-token × per-channel (or per-tensor) scales, then
stores of 16 bytes a thread; its scales are loaded before the K loop.

Measured on H100s at M = 4096 (`benchmarks/gemm.py`): int8 qwen_kv 15.6–16.7 µs,
1.48–1.56× bf16 (in one sweep, same 128 × 128 tile: 16.7 µs against the Triton kernel's 21.0);
FP8 qwen_kv 16.0–16.3 µs, 1.52–1.53× bf16 in five runs, after the ring's first copies were
moved up and the tiles grouped by 4 (`torch._scaled_mm` 16.9–17.3). On the large FP8 shapes
Triton's persistent programs stay ahead (qwen_qkv 82.0 against 89.2 µs), so `triton_scaled`
times both per shape (`ops.fastest`).
Two things cost this kernel 40% until fixed, both visible only below Triton: ptxas serialized
its wgmmas (info C7515) when the ring was refilled under a branch, and a TMA store of the tile,
waited on before the CTA exits, cost ~1.5 µs a call. A warp-specialized variant (a loader warp
feeding one warpgroup of MMA warps through empty/ready mbarriers, `gl.warp_specialize`) was
correct but slower (FP8 qwen_kv 17.1 against 16.4 µs) and was dropped.

Scope: int8 × int8 → int32 or e4m3 × e4m3 → float32, both operands K-major (`A [M, K]`,
`B [N, K]`), K a multiple of 16 (16-byte TMA rows), bf16/fp16/fp32 out.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from quantlab.kernels.common import cuda_capability, fastest

# Names that moved between Triton releases (see gluon_wna16).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _issue(a_desc, b_desc, bar, a_buf, b_buf, off_m, off_n, k, pred):
    """Start the TMA copies of K tile k of A's rows off_m… and B's rows off_n…, if pred
    (predicated, not branched: the loop stays one block)."""
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    _tma_load(a_desc, [off_m, k * a_desc.block_type.shape[1]], bar, a_buf, pred=pred)
    _tma_load(b_desc, [off_n, k * b_desc.block_type.shape[1]], bar, b_buf, pred=pred)


@gluon.jit
def _tile_origin(M, N, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
    """This program's tile, GROUP_M row tiles at a time walked column-major (L2 reuse of B)."""
    tile = gl.program_id(0)
    num_m = gl.cdiv(M, BM)
    per_group = GROUP_M * gl.cdiv(N, BN)
    first_m = (tile // per_group) * GROUP_M
    rows = gl.minimum(num_m - first_m, GROUP_M)
    return (first_m + (tile % per_group) % rows) * BM, ((tile % per_group) // rows) * BN


@gluon.jit
def _scaled_kernel(a_desc, b_desc, y_ptr, sa_ptr, sb_ptr, zc_ptr, rs_ptr, M, N, K, stride_ym,
                   ROW_A: gl.constexpr, ROW_B: gl.constexpr, ZC: gl.constexpr,
                   GROUP_M: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """One output tile: the pipelined K loop, then the scales and the store."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    IS_INT: gl.constexpr = a_desc.dtype == gl.int8
    INSTR_N: gl.constexpr = min(BN, 128) if IS_INT else BN  # Triton's int8 wgmma stops at n128
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, INSTR_N, 32])
    off_m, off_n = _tile_origin(M, N, BM, BN, GROUP_M)

    a_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_s = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    iters = gl.cdiv(K, BK)
    # Each stage's first copies go out right after its barrier's init, not after all of them:
    # every init and issue costs a CTA barrier (Triton's shared-memory hazard analysis), and
    # the first load left only after the sixth (FP8 qwen_kv and llama_kv at M = 4096 on an
    # H100: faster in 11 of 12 side-by-side timings, by 0.03–0.38 µs).
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
        if i < STAGES - 1:
            _issue(a_desc, b_desc, bars.index(i), a_s.index(i), b_s.index(i), off_m, off_n, i, i < iters)

    # The epilogue's operands are loaded before the K loop, not after its last wgmma (qwen_kv at
    # M = 4096 on an H100: 16.8 against 17.0 µs FP8, 16.7 against 16.9 int8).
    rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, ACC))
    cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, ACC))
    sa = _vector(sa_ptr, rows, M, ROW_A)
    sb = _vector(sb_ptr, cols, N, ROW_B)
    if ZC:
        rs = _vector(rs_ptr, rows, M, True)
        zc = _vector(zc_ptr, cols, N, True)

    acc = gl.zeros([BM, BN], gl.int32 if IS_INT else gl.float32, ACC)
    for it in range(iters):
        st = it % STAGES
        mbarrier.wait(bars.index(st), (it // STAGES) & 1)
        acc = warpgroup_mma(a_s.index(st), b_s.index(st).permute((1, 0)), acc, is_async=True)
        # One wgmma left in flight: the previous tile's is done, so its buffers can be refilled.
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        nxt = it + STAGES - 1
        ns = nxt % STAGES
        _issue(a_desc, b_desc, bars.index(ns), a_s.index(ns), b_s.index(ns), off_m, off_n, nxt, nxt < iters)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    if ZC:  # Σ_k a·(q − z) = Σ_k a·q − rowsum(a)·z, exact in int32
        acc = acc - gl.expand_dims(rs, 1) * gl.expand_dims(zc, 0)
    out = acc.to(gl.float32) * gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0)
    _store(out, y_ptr, off_m, off_n, M, N, stride_ym, num_warps)


@gluon.jit
def _vector(ptr, offs, n, PER_ELEMENT: gl.constexpr):
    """`ptr[offs]` (0 past n), or the one value at `ptr` for every offset."""
    if PER_ELEMENT:
        v = gl.load(ptr + offs, mask=offs < n, other=0)
    else:
        v = gl.load(ptr + offs * 0)
    return v


@gluon.jit
def _store(out, y_ptr, off_m, off_n, M, N, stride_ym, num_warps: gl.constexpr):
    """Store the tile through a layout of 16 bytes per thread along N, coalesced (a TMA store
    through shared memory, which the CTA then waits on, cost ~1.5 µs more at qwen_kv
    M = 4096, H100)."""
    BM: gl.constexpr = out.shape[0]
    BN: gl.constexpr = out.shape[1]
    SPT: gl.constexpr = 128 // y_ptr.dtype.element_ty.primitive_bitwidth
    TN: gl.constexpr = min(32, BN // SPT)
    OUT: gl.constexpr = gl.BlockedLayout([1, SPT], [32 // TN, TN], [num_warps, 1], [1, 0])
    y = gl.convert_layout(out.to(y_ptr.dtype.element_ty), OUT)
    r = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, OUT))
    c = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, OUT))
    mask = gl.expand_dims(r < M, 1) & gl.expand_dims(c < N, 0)
    rows = gl.expand_dims(r.to(gl.int64), 1)  # M × N passes 2³¹ at prefill sizes
    gl.store(y_ptr + rows * stride_ym + gl.expand_dims(c, 0), y, mask=mask)


@dataclass(frozen=True)
class Config:
    """One launch's tiles: `block_m × block_n` outputs per program, K tiles of `block_k`,
    a `stages`-deep TMA ring, `warps` (4 per 64 rows of the tile)."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    group_m: int = 8

    @property
    def warps(self) -> int:
        return self.block_m // 16

    def shared_bytes(self, out_size: int) -> int:
        """The TMA ring and the epilogue's layout change of the output tile."""
        return self.stages * (self.block_m + self.block_n) * self.block_k + self.block_m * self.block_n * out_size


SHARED_BYTES = 227 * 1024  # an sm_90 program's shared memory
CONFIGS = [Config(bm, bn, bk, st) for bm, bn, bk, st in (
    (128, 128, 128, 4), (128, 128, 128, 5), (128, 256, 128, 3), (128, 256, 64, 4), (128, 128, 64, 6),
    (64, 128, 128, 5), (64, 256, 128, 4), (128, 64, 128, 6), (64, 64, 128, 8))]
# Groups of 4 row tiles for the 128 × 128 tiles: FP8 qwen_kv at M = 4096 on an H100 took
# 15.9–16.7 µs against 16.5–16.9 in groups of 8 (5 stages, same runs). Six stages were no
# faster there and 5% slower on llama_kv.
CONFIGS += [Config(128, 128, 128, st, group_m=4) for st in (4, 5)]


def fitting(out_dtype: torch.dtype) -> list[Config]:
    """The CONFIGS whose ring and output tile fit in shared memory."""
    return [c for c in CONFIGS if c.shared_bytes(out_dtype.itemsize) <= SHARED_BYTES]


def supports(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether this kernel takes the call: int8 × int8 or e4m3 × e4m3, contiguous, K a multiple
    of 16, on an sm_90 GPU."""
    return ((cuda_capability(a) or (0, 0))[0] == 9 and a.dtype == b.dtype
            and a.dtype in _GL_OPERANDS and a.is_contiguous() and b.is_contiguous()
            and a.shape[1] % 16 == 0 and out_dtype in (torch.bfloat16, torch.float16, torch.float32))


_GL_OPERANDS = {torch.int8: gl.int8, torch.float8_e4m3fn: gl.float8e4nv}


@functools.lru_cache(maxsize=None)
def _layouts(dtype: torch.dtype, c: Config):
    op = _GL_OPERANDS[dtype]
    return (gl.NVMMASharedLayout.get_default_for([c.block_m, c.block_k], op),
            gl.NVMMASharedLayout.get_default_for([c.block_n, c.block_k], op))


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                  zc: torch.Tensor | None, rs: torch.Tensor | None, out: torch.Tensor,
                  config: Config) -> torch.Tensor:
    """`out [M, N] = (a [M, K] · b [N, K]ᵀ − rs ⊗ zc) ⊙ sa ⊗ sb` for the calls `supports`
    accepts; `sa`, `sb` float32, per row (`[M]`, `[N]`) or per tensor (`[1]`)."""
    m, k = a.shape
    n = b.shape[0]
    c = config
    a_l, b_l = _layouts(a.dtype, c)
    a_desc = TensorDescriptor.from_tensor(a, [c.block_m, c.block_k], a_l)
    b_desc = TensorDescriptor.from_tensor(b, [c.block_n, c.block_k], b_l)
    grid = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n),)
    _scaled_kernel[grid](a_desc, b_desc, out, sa, sb, zc if zc is not None else sb,
                         rs if rs is not None else sa, m, n, k, out.stride(0),
                         ROW_A=sa.numel() == m, ROW_B=sb.numel() == n, ZC=zc is not None,
                         GROUP_M=c.group_m, STAGES=c.stages, num_warps=c.warps)
    return out


_TUNED: dict[tuple, Config] = {}


def tuned(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
          zc: torch.Tensor | None, rs: torch.Tensor | None, out: torch.Tensor, key: tuple) -> Config:
    """The fastest fitting config for this call, found once per `key` (the caller's shape key,
    `triton_scaled`'s M bucket among it) by `ops.fastest` (graph replays, L2 flushed before
    each, three interleaved rounds) and remembered for the process."""
    if key not in _TUNED:
        configs = fitting(out.dtype)
        runs = [lambda c=c: scaled_matmul(a, b, sa, sb, zc, rs, out, c) for c in configs]
        _TUNED[key] = configs[fastest(runs)]
    return _TUNED[key]
