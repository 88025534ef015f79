"""Split-K for the decode-size GEMMs (`triton_wna16`, `triton_scaled`): at M ≤ 64 a weight of
few column tiles (a down projection: 28 tiles of 128 for 132 SMs) leaves most SMs idle unless
the K loop is split across programs. Imported lazily: needs triton.

Each split writes its partial tile into a float32 workspace; a counter per output tile elects
the last program to arrive, which sums the partials in split order (deterministic, unlike
atomic adds) and resets the counter — no memset per call, and CUDA-graph replays stay
correct. One workspace per device: calls on different streams must not overlap.

The M = 1 GEMV (`triton_wna16`, without a fused epilogue) and the Gluon W4A16 kernel
(`gluon_wna16`) add their partials atomically instead (`ATOMIC`), into accumulators that the
program completing a tile zeroes (`split_accumulators`), unless torch is in deterministic
mode (`atomic_sums`).

At M > 64 `triton_scaled`'s persistent programs may split the K loops of the last, partial wave
of tiles; their partials go to tile-sized slots instead of `[M, N]` planes (`tail_buffers`).
"""

from __future__ import annotations

import types

import torch
import triton
import triton.language as tl

# Split-K candidates per shape: the split that puts about W programs on every SM, for each W.
# A grid just over a whole number of resident waves runs a second, nearly empty wave (Nsight
# Compute on the W4A16 GEMV at qwen_up, 74 column tiles × split 8 = 592 programs with 528
# resident: 1.12 waves, SMs idle 26% of the kernel), so some W lands each shape on full waves.
WAVES = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def wave_splits(tiles: int, sms: int) -> set[int]:
    """The split-K that puts about W programs on each SM, for each W in WAVES."""
    return {max(1, round(w * sms / tiles)) for w in WAVES}


def largest_split(prune, configs, device: torch.device, **shape) -> int:
    """The largest split-K an autotuner's prune keeps for a shape (`shape`: the kernel arguments
    the prune reads), so the workspace can be sized before the launch. The prune reads only
    the output's device."""
    kept = prune(configs, dict(shape, y_ptr=types.SimpleNamespace(device=device)))
    return max(c.kwargs["SPLIT_K"] for c in kept)


@triton.jit
def split_total(acc, ws_ptrs, MN, mask, cnt_ptr, tile, pid_k, split_k,
                ONE_LOAD: tl.constexpr = False, SPLIT_P2: tl.constexpr = 1,
                ATOMIC: tl.constexpr = False):
    """(Whether this program completes its tile, the tile's sum): unsplit, `acc` itself with
    nothing stored; else `_arrive`'s."""
    last = pid_k == 0
    total = acc
    if split_k > 1:
        last, total = _arrive(acc, ws_ptrs, MN, mask, cnt_ptr, tile, pid_k, split_k, ONE_LOAD,
                              SPLIT_P2, ATOMIC)
    return last, total


@triton.jit
def _arrive(acc, ws_ptrs, MN, mask, cnt_ptr, tile, pid_k, split_k,
            ONE_LOAD: tl.constexpr, SPLIT_P2: tl.constexpr, ATOMIC: tl.constexpr):
    """Store this split's partial `acc` (float32 or int32, kept exact through a bitcast) at
    `ws_ptrs + pid_k·MN`; returns (whether this program arrived last, the sum of every split's
    partial in split order — meaningful only for the last). ONE_LOAD (1-D tiles; SPLIT_P2 a
    power of 2 ≥ split_k): the last program reads every partial in one load instead of one
    dependent load per split. ATOMIC (float32): add the partial into the accumulators at
    `ws_ptrs` instead (`split_accumulators`, zero between calls), in arrival order; the last
    program reads the sum and zeroes them."""
    IS_INT: tl.constexpr = acc.dtype == tl.int32
    if ATOMIC:
        tl.static_assert(not IS_INT, "atomic split-K sums are float32")
        tl.atomic_add(ws_ptrs, acc, mask=mask, sem="relaxed")
    elif IS_INT:
        tl.store(ws_ptrs + pid_k * MN, acc.to(tl.float32, bitcast=True), mask=mask)
    else:
        tl.store(ws_ptrs + pid_k * MN, acc, mask=mask)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
    last = arrived == split_k - 1
    total = acc
    if last:
        if ATOMIC:
            total = tl.load(ws_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(ws_ptrs, tl.zeros_like(total), mask=mask)
        elif ONE_LOAD:
            rows = tl.arange(0, SPLIT_P2)
            parts = tl.load(ws_ptrs[None, :] + rows[:, None] * MN,
                            mask=mask[None, :] & (rows < split_k)[:, None], other=0.0,
                            cache_modifier=".cg")
            if IS_INT:
                parts = parts.to(tl.int32, bitcast=True)
            total = tl.sum(parts, axis=0)
        else:
            total = tl.zeros_like(acc)
            for i in range(split_k):
                part = tl.load(ws_ptrs + i * MN, mask=mask, other=0.0, cache_modifier=".cg")
                if IS_INT:
                    part = part.to(tl.int32, bitcast=True)
                total += part
        tl.store(cnt_ptr + tile, 0)
    return last, total


_WORKSPACE: dict[tuple, torch.Tensor] = {}


def workspace(device: torch.device, numel: int, dtype: torch.dtype,
              kind: str = "partials") -> torch.Tensor:
    """A buffer per device, dtype and kind, grown on demand (the counters are zero between
    calls, and so are the "sums" accumulators)."""
    key = (str(device), dtype, kind)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.zeros(max(numel, 1 << 16), dtype=dtype, device=device)
        _WORKSPACE[key] = buf
    return buf


def _counters(device: torch.device, m: int, n: int) -> torch.Tensor:
    return workspace(device, m * triton.cdiv(n, 16) + 1, torch.int32)  # tiles ≥ 16 columns


def split_workspaces(device: torch.device, m: int, n: int,
                     max_split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The partials' workspace (float32, `max_split·m·n`) and the per-tile counters (int32; tiles
    are at least 16 columns wide). Unsplit calls get whatever buffers exist: a prefill GEMM
    must not grow them (M = 8192 × N = 37888 would be 78 MB of counters)."""
    if max_split <= 1:
        return workspace(device, 1, torch.float32), workspace(device, 1, torch.int32)
    return workspace(device, max_split * m * n, torch.float32), _counters(device, m, n)


def tail_buffers(device: torch.device, programs: int,
                 tile_elems: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For persistent programs that split the last wave's K loops (`triton_scaled._tail_split`,
    at most 2 parts per program): a float32 partial tile per part and a counter per tile
    (34.6 MB for 128 × 256 tiles on 132 SMs, the size of cuBLAS's own Hopper workspace)."""
    return (workspace(device, programs * 2 * tile_elems, torch.float32),
            workspace(device, programs, torch.int32))


def atomic_sums() -> bool:
    """Whether split-K partials may be added atomically: floating-point sums in arrival order
    differ from call to call in the last bits, so not under
    `torch.use_deterministic_algorithms(True)` (PyTorch's own convention for such kernels)."""
    return not torch.are_deterministic_algorithms_enabled()


def split_accumulators(device: torch.device, m: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For splits that add their partials atomically: a float32 accumulator per output
    (`m·n`), zero between calls — the program completing a tile zeroes it after reading —,
    apart from the partials (which other kernels leave dirty), and the counters."""
    return workspace(device, m * n, torch.float32, "sums"), _counters(device, m, n)


def split_buffers(device: torch.device, m: int, n: int, max_split: int,
                  atomic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """What a launch of up to `max_split` splits sums in, and its counters: the accumulators
    when it adds atomically, else the partials' workspace."""
    if atomic and max_split > 1:
        return split_accumulators(device, m, n)
    return split_workspaces(device, m, n, max_split)
