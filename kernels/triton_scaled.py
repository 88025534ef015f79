"""Triton scaled GEMM for W8A8 int8 and FP8 e4m3: `Y = (A·Bᵀ) ⊙ s_a ⊗ s_b` with the scales
(and the int8 asymmetric-zero correction) fused in the epilogue. Imported lazily: needs triton.

Operands come in through TMA tensor descriptors (Hopper's bulk copy engine; the descriptors
zero-fill out-of-bounds tiles, so odd M and N need no masks in the K loop). Both operands are
K-major (`A [M, K]`, `B [N, K]`), the only layout wgmma takes for 8-bit types. Tiles are
ordered in groups of GROUP_M row tiles so concurrently running tiles share B in L2. The
autotuner picks between one program per tile and persistent programs (one per SM walking the
tiles in one flattened, software-pipelined loop, so a tile's loads overlap the previous
tile's epilogue): at M = 4096 on an H200 the persistent ones won the large FP8 shapes
(`benchmarks/gemm.py --ms 4096`). Persistent configs with SPLIT_TAIL also split
the K loops of the last, partial wave of tiles across all the programs (`_tail_split`), so
that SMs do not idle through it (qwen_down FP8 at M = 4096 on an H100: 3.5–7.6% faster).
Persistent configs with TMA_STORE hand each finished tile to the copy engine through a TMA
descriptor of the output, which stores it while the next tile's K loop runs, instead of
moving it through shared memory into 16-byte stores by every thread (128 × 256 tiles, FP8 at
M = 4096 on an H100: llama_up and llama_down 3–5% faster than the same tile stored by the
threads).

At M ≤ 64 the K loop is also split across programs (`split_k.py`; int32 partials stay exact),
so a weight of few column tiles fills the GPU: W8A8 at M = 1 on the Qwen2-7B down projection
went from 52.0 to 32.7 µs on an H200 (bf16 48.9).

Above M = 64 on Hopper the auto path also has `gluon_scaled`, the same GEMM written in Gluon
so that the int8 wgmma runs asynchronously (Triton's pipeliner drains it every K step), and
keeps whichever of the two autotuned kernels is faster for the shape (`_faster`).

Requirements: K a multiple of 16 (TMA row strides are 16-byte aligned); contiguous operands.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from quantlab.kernels.common import autotune_bench, fastest, interpret_mode, retime_top, sm_count
from quantlab.kernels.layout import PackedFP8, PackedW8A8
from quantlab.kernels.split_k import (largest_split, split_total, split_workspaces, tail_buffers,
                                      wave_splits)


@triton.jit
def _epilogue(acc, off_m, off_n, sa_ptr, sb_ptr, zc_ptr, rs_ptr, y_ptr, M, N, stride_ym,
              ROW_A: tl.constexpr, ROW_B: tl.constexpr, ZC: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, y_desc=None):
    """The zero correction (int8 with asymmetric weights) and the scales, then the store:
    through `y_desc` (TMA; the copy engine clips the tile at M and N) when given."""
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    if ZC:
        rs = tl.load(rs_ptr + offs_m, mask=m_mask, other=0)
        zc = tl.load(zc_ptr + offs_n, mask=n_mask, other=0)
        acc = acc - rs[:, None] * zc[None, :]
    out = acc.to(tl.float32)
    if ROW_A:
        out = out * tl.load(sa_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
    else:
        out = out * tl.load(sa_ptr)
    if ROW_B:
        out = out * tl.load(sb_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    else:
        out = out * tl.load(sb_ptr)
    if y_desc is not None:
        y_desc.store([off_m, off_n], out.to(y_desc.dtype))
    else:
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]  # M × N can pass 2³¹
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _tile_origin(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """A tile's first row and column: GROUP_M row tiles at a time, walked column-major, so that
    running tiles share B in L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (tile // per_group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    return (first_m + (tile % per_group) % rows) * BLOCK_M, ((tile % per_group) // rows) * BLOCK_N


@triton.jit
def _k_range(off_m, off_n, k_lo, k_hi, a_desc, b_desc, IS_INT: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The tile's product over K tiles [k_lo, k_hi): int32 for int8 operands, else float32."""
    if IS_INT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_lo, k_hi):
        a = a_desc.load([off_m, k * BLOCK_K])
        b = b_desc.load([off_n, k * BLOCK_K])
        if IS_INT:
            acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _scaled_tile(tile, pid_k, split_k, a_desc, b_desc, sa_ptr, sb_ptr, zc_ptr, rs_ptr, y_ptr,
                 ws_ptr, cnt_ptr, M, N, K, stride_ym,
                 ROW_A: tl.constexpr, ROW_B: tl.constexpr, ZC: tl.constexpr, IS_INT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, first_tail=-1, y_desc=None):
    """One output tile (or split `pid_k` of its K loop): the K loop, then the epilogue — after
    the last split sums the partials, when split. The partials go to an `[M, N]` plane per
    split, or, for the tiles from `first_tail` on (`_tail_split`), to `split_k` tile-sized
    slots per tile (`split_k.tail_buffers`)."""
    off_m, off_n = _tile_origin(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    iters = tl.cdiv(K, BLOCK_K)
    per = tl.cdiv(iters, split_k)
    acc = _k_range(off_m, off_n, pid_k * per, tl.minimum(pid_k * per + per, iters), a_desc, b_desc,
                   IS_INT, BLOCK_M, BLOCK_N, BLOCK_K)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if first_tail >= 0:
        slot = tile - first_tail
        local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        last, total = split_total(acc, ws_ptr + slot * split_k * BLOCK_M * BLOCK_N + local,
                                  BLOCK_M * BLOCK_N, mask, cnt_ptr, slot, pid_k, split_k)
    else:
        last, total = split_total(acc, ws_ptr + offs_m[:, None] * N + offs_n[None, :], M * N,
                                  mask, cnt_ptr, tile, pid_k, split_k)
    if last:
        _epilogue(total, off_m, off_n, sa_ptr, sb_ptr, zc_ptr, rs_ptr, y_ptr, M, N, stride_ym,
                  ROW_A, ROW_B, ZC, BLOCK_M, BLOCK_N, y_desc)


@triton.jit
def _tail_split(tiles, programs, iters, MAX_PARTS_PER_SM: tl.constexpr = 2,
                PART_COST: tl.constexpr = 14):
    """(how many tiles the persistent programs take whole, how many ways the K loop of the
    rest — the last, partial wave — is split). A partial wave of r tiles leaves SMs idle; split s
    ways, its r·s parts take ⌈r·s / programs⌉ rounds, each of `iters / s + PART_COST` K steps.
    A part also fills the pipeline, stores its partial tile and may sum the others, and a
    partial wave runs at higher clocks under the power cap than a full one: on an H100 at
    M = 4096 with tiles of 128 × 256, qwen_down's last wave (52 of 448 tiles, 148 K steps)
    split 5 ways was 3.5–7.6% faster than whole, but llama_up's (76 of 1792, 32 K steps) split 3
    ways 4–7% slower, and that of Qwen2-7B's fused q/k/v projection (3584 × 4608: 48 of 576,
    28 K steps) split 2 ways 6–7% slower.
    Picks the s ≤ 8 of the fewest K steps, at most MAX_PARTS_PER_SM parts per program (the
    workspace); s = 1 (no split) unless it beats one round of whole tiles."""
    rest = tiles % programs
    best_steps = iters  # × best, one round of whole tiles
    best = 1
    for s in tl.static_range(2, 9):
        steps = tl.cdiv(rest * s, programs) * (iters + PART_COST * s)  # × s
        ok = (rest > 0) & (rest * s <= MAX_PARTS_PER_SM * programs) & (steps * best < best_steps * s)
        best_steps = tl.where(ok, steps, best_steps)
        best = tl.where(ok, s, best)
    return tiles - tl.where(best > 1, rest, 0), best


@triton.jit
def _scaled_mm_kernel(a_desc, b_desc, y_desc, sa_ptr, sb_ptr, zc_ptr, rs_ptr, y_ptr, ws_ptr, cnt_ptr,
                      M, N, K, stride_ym, MB, SPLIT_K,
                      ROW_A: tl.constexpr, ROW_B: tl.constexpr, ZC: tl.constexpr,
                      IS_INT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr = False,
                      SPLIT_TAIL: tl.constexpr = False, TMA_STORE: tl.constexpr = False):
    """MB (the M bucket) is only the autotuning key. PERSISTENT: one program per SM walks the
    tiles (flattened into one pipelined loop, so the next tile's loads overlap this epilogue;
    no split-K); with SPLIT_TAIL the K loops of the last, partial wave are split across all
    the programs (`_tail_split`). Otherwise program (tile, split). TMA_STORE: whole tiles leave
    through `y_desc` (the copy engine stores one while the next tile's K loop runs)."""
    tile_desc = y_desc if TMA_STORE else None
    if PERSISTENT:
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        whole = num_tiles
        if SPLIT_TAIL:
            whole, split = _tail_split(num_tiles, tl.num_programs(0), tl.cdiv(K, BLOCK_K))
        for tile in tl.range(tl.program_id(0), whole, tl.num_programs(0), flatten=True):
            _scaled_tile(tile, 0, 1, a_desc, b_desc, sa_ptr, sb_ptr, zc_ptr, rs_ptr, y_ptr, ws_ptr,
                         cnt_ptr, M, N, K, stride_ym, ROW_A, ROW_B, ZC, IS_INT, BLOCK_M, BLOCK_N,
                         BLOCK_K, GROUP_M, -1, tile_desc)
        if SPLIT_TAIL:
            # Part u is split u // tail of tile u % tail: the programs running at once share
            # their K steps (and the operands' slabs in L2) as whole tiles do.
            tail = num_tiles - whole
            for u in range(tl.program_id(0), tail * split, tl.num_programs(0)):
                _scaled_tile(whole + u % tail, u // tail, split, a_desc, b_desc, sa_ptr, sb_ptr,
                             zc_ptr, rs_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_ym, ROW_A,
                             ROW_B, ZC, IS_INT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, whole)
    else:
        _scaled_tile(tl.program_id(0), tl.program_id(1), SPLIT_K, a_desc, b_desc, sa_ptr, sb_ptr,
                     zc_ptr, rs_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_ym, ROW_A, ROW_B, ZC,
                     IS_INT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, -1, tile_desc)


def _set_blocks(nargs):
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk]
    if nargs.get("y_desc") is not None:
        nargs["y_desc"].block_shape = [bm, bn]


def _cfg(bm, bn, bk, warps, stages, group_m=8, persistent=False, split_tail=False, tma_store=False):
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, PERSISTENT=persistent,
                              SPLIT_TAIL=split_tail, SPLIT_K=1, TMA_STORE=tma_store),
                         num_warps=warps, num_stages=stages, pre_hook=_set_blocks)


SMALL_M_CONFIGS = [_cfg(64, bn, 128, 4, st) for bn in (64, 128, 256) for st in (3, 4, 5)]
LARGE_M_CONFIGS = [_cfg(128, 256, 128, 8, 3), _cfg(128, 256, 128, 8, 4), _cfg(256, 128, 128, 8, 3),
                   _cfg(256, 128, 128, 8, 4), _cfg(128, 128, 128, 8, 4), _cfg(128, 128, 128, 4, 4),
                   _cfg(128, 128, 128, 8, 5), _cfg(128, 256, 64, 8, 4), _cfg(128, 128, 256, 8, 3),
                   # narrow N (K/V projections): more, smaller tiles to fill the SMs
                   _cfg(128, 64, 128, 4, 4), _cfg(64, 128, 128, 4, 4), _cfg(128, 64, 256, 4, 3)]
# The same tiles walked by one program per SM, in L2 groups of 4–16 row tiles: on an H200 at
# M = 4096 these won every FP8 shape of a config sweep where the one-tile programs trailed
# torch._scaled_mm.
LARGE_M_CONFIGS += [_cfg(*c, group_m=g, persistent=True)
                    for c, groups in (((128, 256, 128, 8, 3), (4, 8, 16)), ((128, 256, 128, 8, 4), (8, 16)),
                                      ((256, 128, 128, 8, 4), (8,)), ((128, 128, 128, 8, 5), (4,)),
                                      ((128, 128, 128, 8, 4), (4, 8)), ((128, 128, 128, 4, 4), (4, 8)))
                    for g in groups]
# The large persistent tiles again with the last, partial wave's K loops split (`_tail_split`):
# at M = 4096 qwen_down makes 448 tiles of 128 × 256 for 132 SMs, 3.4 waves, and its last wave
# split 5 ways took it from 429–431 to 412–414 µs on an H100 (torch._scaled_mm 435).
SPLIT_TAIL_CONFIGS = [_cfg(*c, group_m=g, persistent=True, split_tail=True)
                    for c, groups in (((128, 256, 128, 8, 3), (8, 16)), ((128, 256, 128, 8, 4), (8, 16)),
                                      ((256, 128, 128, 8, 4), (8,)), ((128, 128, 128, 8, 4), (8,)),
                                      ((128, 128, 128, 8, 6), (8,)))
                    for g in groups]
LARGE_M_CONFIGS += SPLIT_TAIL_CONFIGS
# The persistent 128 × 256 tiles of 3 stages again, each tile stored through a TMA descriptor
# (the 4-stage ones leave no room for its 64 KB staging buffer). On an H100 at M = 4096 FP8
# they took llama_up from 369.5–386.5 to 358.0–367.7 µs and llama_down from 353.0–373.9 to
# 341.6–353.9 (torch._scaled_mm 391.6 and 379.0).
LARGE_M_CONFIGS += [_cfg(128, 256, 128, 8, 3, group_m=g, persistent=True, tma_store=True)
                    for g in (4, 8, 16)]
SPLIT_TAIL_TILE = max(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] for c in SPLIT_TAIL_CONFIGS)
# At M ≤ 64 a weight of few column tiles (qwen_down: 56 tiles of 64 for 132 SMs, each walking
# K = 18944) leaves SMs idle: the small-M configs also run with the K loop split so that 1–4
# whole waves of programs fill the GPU (`split_k.wave_splits`), each split ≥ MIN_SPLIT_ITERS
# K tiles long.
SPLIT_WAVES = 4
MIN_SPLIT_ITERS = 4


def _small_m_splits(configs, named_args, **_) -> list[triton.Config]:
    """The small-M configs, each also with its whole-wave splits of the K loop."""
    m, n, k = named_args["M"], named_args["N"], named_args["K"]
    sms = sm_count(named_args["y_ptr"].device, 4)
    out = []
    for c in configs:
        kw = c.kwargs
        tiles = triton.cdiv(m, kw["BLOCK_M"]) * triton.cdiv(n, kw["BLOCK_N"])
        iters = triton.cdiv(k, kw["BLOCK_K"])
        splits = {1} | {s for s in wave_splits(tiles, sms)
                        if tiles * s <= SPLIT_WAVES * sms and iters >= MIN_SPLIT_ITERS * s}
        out += [triton.Config(dict(kw, SPLIT_K=s), num_warps=c.num_warps, num_stages=c.num_stages,
                              pre_hook=c.pre_hook) for s in sorted(splits)]
    return out


SMALL_M = 64  # the largest M of the small-M configs


def _bucket(m: int) -> int:
    return min(triton.next_power_of_2(m), 8192)


def _stores(configs, named_args, **_) -> list[triton.Config]:
    """The large-M configs, less the TMA-store ones where the output takes no descriptor."""
    if named_args["y_desc"] is not None:
        return configs
    return [c for c in configs if not c.kwargs["TMA_STORE"]]


def _autotuned(configs, prune=None):
    return triton.autotune(configs=configs, key=["MB", "N", "K", "IS_INT"], do_bench=autotune_bench,
                           cache_results=True, prune_configs_by={"early_config_prune": prune} if prune else None
                           )(_scaled_mm_kernel)


_SMALL = _autotuned(SMALL_M_CONFIGS, _small_m_splits)
_LARGE = _autotuned(LARGE_M_CONFIGS, _stores)


INTERPRET_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2)


@functools.lru_cache(maxsize=1024)
def _max_split(m: int, n: int, k: int, device: torch.device) -> int:
    """The largest split the small-M autotuner may pick for a shape (sizes the workspace)."""
    return largest_split(_small_m_splits, SMALL_M_CONFIGS, device, M=m, N=n, K=k)


IMPLS = ("auto", "triton", "gluon")


def _gluon():
    """`gluon_scaled`, or None where this Triton has no Gluon (imported on first use)."""
    try:
        from quantlab.kernels import gluon_scaled
    except ImportError:
        return None
    return gluon_scaled


def _path(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, impl: str,
          configured: bool = False) -> str:
    """"triton", "gluon" or, for "auto" above SMALL_M on Hopper, "faster": whichever of the two
    autotuned kernels is faster for the shape (`_faster`). Otherwise, at split-K sizes, and
    when a config is given (it is this module's kernel's), this module's kernel."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    g = _gluon() if not interpret_mode() else None
    ok = g is not None and g.supports(a, b, out_dtype)
    if impl == "gluon" and not ok:
        raise ValueError("impl 'gluon' takes int8 or e4m3 operands (K % 16 == 0) on "
                         "sm_90 with Triton's Gluon (see gluon_scaled.supports)")
    if impl == "auto":
        return "faster" if ok and a.shape[0] > SMALL_M and not configured else "triton"
    return impl


_FASTER: dict[tuple, str] = {}


def _faster(key: tuple, run) -> str:
    """The faster impl for a shape, decided once per key (after each kernel's own autotuning)
    by `ops.fastest`: on an H100 at M = 4096 the Gluon kernel won every int8 shape
    measured and the FP8 K/V projections; Triton's persistent programs won FP8 qwen_qkv and
    llama_down."""
    if key not in _FASTER:
        impls = ("triton", "gluon")
        for impl in impls:
            run(impl)  # autotunes outside the timer's graph capture
        _FASTER[key] = impls[fastest([lambda impl=impl: run(impl) for impl in impls])]
    return _FASTER[key]


def _launch(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
            zc: torch.Tensor | None, rs: torch.Tensor | None, out_dtype: torch.dtype,
            is_int: bool, config: dict | None, out: torch.Tensor | None,
            impl: str = "auto") -> torch.Tensor:
    """Check the call, pick the kernel (`_path`, `_faster`) and run it into `out` (or a new y)."""
    m, k = a.shape
    n = b.shape[0]
    if k % 16:
        raise ValueError(f"K must be a multiple of 16 for the TMA kernels, got {k}")
    a, b = a.contiguous(), b.contiguous()
    y = torch.empty(m, n, dtype=out_dtype, device=a.device) if out is None else out
    assert y.shape == (m, n) and y.is_contiguous() and y.dtype == out_dtype
    path = _path(a, b, out_dtype, impl, configured=config is not None)
    if config is None and interpret_mode():
        config = INTERPRET_CONFIG
    if m == 0:
        return y
    sa, sb = sa.float().contiguous(), sb.float().contiguous()
    key = (_bucket(m), n, k, a.dtype, out_dtype, sa.numel(), sb.numel(), zc is not None)  # tuning caches'
    if path == "faster":
        path = _faster(key, lambda i: _launch(a, b, sa, sb, zc, rs, out_dtype, is_int, config, y, i))
    if path == "gluon":
        g = _gluon()
        cfg = g.Config(**config) if config is not None else g.tuned(a, b, sa, sb, zc, rs, y, key)
        return g.scaled_matmul(a, b, sa, sb, zc, rs, y, cfg)
    return _launch_triton(a, b, sa, sb, zc, rs, y, is_int, config)


def _buffers(device: torch.device, m: int, n: int, k: int, sms: int,
             config: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The workspace and counters a launch may sum partials in: the small-M splits' (sized for
    the largest split the autotuner may pick), or, where persistent programs may split the last
    wave (every large-M autotuned call, or a SPLIT_TAIL config), tile-sized slots."""
    if config is not None and config.get("SPLIT_TAIL", False):
        return tail_buffers(device, sms, config["BLOCK_M"] * config["BLOCK_N"])
    if config is not None:
        return split_workspaces(device, m, n, config.get("SPLIT_K", 1))
    if m <= SMALL_M:
        return split_workspaces(device, m, n, _max_split(m, n, k, device))
    return tail_buffers(device, sms, SPLIT_TAIL_TILE)


def _store_desc(y: torch.Tensor) -> TensorDescriptor | None:
    """A TMA descriptor for the output `y [M, N]` (its block shape set per config by
    `_set_blocks`), or None where TMA cannot take it: rows must start 16-byte aligned."""
    if y.stride(1) != 1 or (y.stride(0) * y.element_size()) % 16 or y.data_ptr() % 16:
        return None
    return TensorDescriptor.from_tensor(y, [8, 16])


def _launch_triton(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                   zc: torch.Tensor | None, rs: torch.Tensor | None, y: torch.Tensor,
                   is_int: bool, config: dict | None) -> torch.Tensor:
    """This module's kernel: autotuned (small-M split-K or large-M configs) or `config`."""
    m, k = a.shape
    n = b.shape[0]
    dummy = [8, 16]  # replaced by the config's block shape before launch
    a_desc = TensorDescriptor.from_tensor(a, dummy)
    b_desc = TensorDescriptor.from_tensor(b, dummy)
    zc_t = zc if zc is not None else sb
    rs_t = rs if rs is not None else sa
    flags = dict(ROW_A=sa.numel() == m, ROW_B=sb.numel() == n, ZC=zc is not None, IS_INT=is_int)
    sms = sm_count(a.device, 4)
    ws, cnt = _buffers(a.device, m, n, k, sms, config)
    tma_store = config.get("TMA_STORE", False) if config is not None else m > SMALL_M
    y_desc = _store_desc(y) if tma_store else None
    if tma_store and config is not None and y_desc is None:
        raise ValueError("config TMA_STORE needs an output whose rows start 16-byte aligned "
                         f"(N·{y.element_size()} bytes a multiple of 16), got N = {n}")

    def grid(meta):
        tiles = triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])
        return (min(tiles, sms),) if meta.get("PERSISTENT") else (tiles, meta.get("SPLIT_K", 1))

    args = (a_desc, b_desc, y_desc, sa, sb, zc_t, rs_t, y, ws, cnt, m, n, k, y.stride(0), _bucket(m))
    if config is not None:
        meta = {kk: config[kk] for kk in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}
        meta["PERSISTENT"] = bool(config.get("PERSISTENT", False))
        meta["SPLIT_TAIL"] = bool(config.get("SPLIT_TAIL", False))
        meta["TMA_STORE"] = bool(tma_store)
        meta["SPLIT_K"] = config.get("SPLIT_K", 1)
        _set_blocks({"a_desc": a_desc, "b_desc": b_desc, "y_desc": y_desc, **meta})
        _scaled_mm_kernel[grid](*args, **flags, **meta, num_warps=config.get("num_warps", 4),
                                num_stages=config.get("num_stages", 2))
    elif m <= SMALL_M:
        _SMALL[grid](*args, **flags)
    else:
        tuned = len(_LARGE.cache)
        _LARGE[grid](*args, **flags)
        if len(_LARGE.cache) > tuned and not interpret_mode():
            # a new shape was just tuned (its key the last one cached): re-time its best few
            retime_top(_LARGE, [next(reversed(_LARGE.cache))],
                       lambda c: _launch_triton(a, b, sa, sb, zc, rs, y, is_int, _config_dict(c)))
    return y


def _config_dict(c: triton.Config) -> dict:
    """An autotuner config as the `config` argument of the launch functions."""
    return {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}


def w8a8_matmul(xq: torch.Tensor, sx: torch.Tensor, p: PackedW8A8,
                out_dtype: torch.dtype = torch.bfloat16, config: dict | None = None,
                out: torch.Tensor | None = None, impl: str = "auto") -> torch.Tensor:
    """int8 `xq [M, K]` with per-token scales `sx [M]` (or one `[1]`) × int8 weight → out_dtype.
    `impl`: "auto", "triton" (this module's kernel) or "gluon" (`gluon_scaled`); `config`
    is that kernel's (a `gluon_scaled.Config`'s fields for "gluon").

    An asymmetric weight zero point needs the activation row sums (one small torch reduction)."""
    rs = xq.sum(dim=1, dtype=torch.int32) if p.zc is not None else None
    return _launch(xq, p.w, sx, p.scale, p.zc, rs, out_dtype, True, config, out, impl)


def fp8_matmul(xq: torch.Tensor, sx: torch.Tensor, p: PackedFP8,
               out_dtype: torch.dtype = torch.bfloat16, config: dict | None = None,
               out: torch.Tensor | None = None, impl: str = "auto") -> torch.Tensor:
    """FP8 `xq [M, K]` with scales `[M]` or `[1]` × FP8 weight (scale `[N]` or `[1]`); `impl`
    and `config` as for `w8a8_matmul`."""
    return _launch(xq, p.w, sx, p.scale, None, None, out_dtype, False, config, out, impl)
