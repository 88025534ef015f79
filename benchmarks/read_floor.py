"""The read floor of a decode GEMM: a Triton kernel that only reads a weight's bytes (the packed
int4 words with their group scales and zeros, or a bf16 weight) with the W4A16 GEMV's grid
(column tiles × split-K) and writes a `[M, N]` output that is zero unless an XOR of the words
hits a run-time sentinel (so no load is dead code). No GEMM that reads those bytes once can
beat it, so `bf16 time / floor` bounds the speed-up any W4A16 kernel can reach on the device.
Used by gemm.py (`read_*` rows at M = 1) and decode.py (`--floor`: the W4A16 model with every
decode GEMM replaced by this kernel)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from quantlab.kernels.ops import autotune_bench

SENTINEL = 0x5EED1234


@triton.jit
def _read_kernel(qw_ptr, s_ptr, z_ptr, y_ptr, M, N, NBLK, NG, sentinel, SPLIT_K,
                 GROUP_BLOCKS: tl.constexpr, HAS_GROUPS: tl.constexpr, BLOCK_N: tl.constexpr,
                 PDL: tl.constexpr = False, STAGES: tl.constexpr = 1):
    """XOR of the word rows [8·b0, 8·b1) of `qw [8·NBLK, N]` (int32) for BLOCK_N columns, and
    with HAS_GROUPS of each block's scales and zeros row (one per GROUP_BLOCKS blocks, bf16
    `[NG, N]`), as the GEMV reads them. PDL (with `launch_pdl=True`): the next kernel may
    launch at once; the store waits for the previous kernel (which may read y). STAGES > 1:
    through Triton's software pipeline (cp.async, STAGES − 1 blocks ahead), as the GEMV may."""
    if PDL:
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_j = tl.arange(0, 8)
    per = tl.cdiv(NBLK, SPLIT_K)
    b0 = pid_k * per
    b1 = tl.minimum(b0 + per, NBLK)
    acc = tl.zeros([BLOCK_N, 8], dtype=tl.int32)
    for b in tl.range(b0, b1, num_stages=STAGES):
        acc ^= tl.load(qw_ptr + (b * 8 + offs_j)[None, :] * N + offs_n[:, None],
                       mask=n_mask[:, None], other=0)
        if HAS_GROUPS:
            g = tl.minimum(b // GROUP_BLOCKS, NG - 1)
            s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0)
            z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0.0)
            sz = s.to(tl.int16, bitcast=True).to(tl.int32) ^ z.to(tl.int16, bitcast=True).to(tl.int32)
            acc ^= sz[:, None]
    hit = tl.xor_sum(acc, axis=1) == sentinel
    out = tl.where(hit, 1.0, 0.0).to(y_ptr.dtype.element_ty)
    if PDL:
        gdc_wait()
    for m in range(M):
        tl.store(y_ptr + m * N + offs_n, out, mask=n_mask)


def _prune(configs, named_args, **_):
    return [c for c in configs if named_args["NBLK"] >= 2 * c.kwargs["SPLIT_K"]] or configs[:1]


# The GEMV's widths and splits, autotuned per shape like the kernels (CUDA-graph replays).
CONFIGS = [triton.Config(dict(BLOCK_N=bn, SPLIT_K=sk, STAGES=st), num_warps=w)
           for bn, w in ((128, 1), (256, 2), (1024, 4)) for st in (1, 4)
           for sk in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80)]
_TUNED = triton.autotune(configs=CONFIGS, key=["M", "N", "NBLK", "HAS_GROUPS"],
                         do_bench=autotune_bench, cache_results=True,
                         prune_configs_by={"early_config_prune": _prune})(_read_kernel)


def read_words(words: torch.Tensor, out: torch.Tensor, scales: torch.Tensor | None = None,
               zeros: torch.Tensor | None = None, group_blocks: int = 1,
               config: dict | None = None) -> torch.Tensor:
    """Read `words` (int32 `[8·nblk, N]`; with scales and zeros `[NG, N]`, bf16/fp16) with the
    fastest grid found for the shape (autotuned like the kernels, as CUDA-graph replays), or
    with `config`'s (BLOCK_N, SPLIT_K, STAGES, num_warps), and write `out [M, N]` (zeros)."""
    rows, n = words.shape
    assert rows % 8 == 0 and out.shape[1] == n and out.is_contiguous()
    groups = scales is not None
    s = scales if groups else out
    z = zeros if groups else out
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
    kernel = _TUNED if config is None else _read_kernel
    kernel[grid](words, s, z, out, out.shape[0], n, rows // 8, s.shape[0], SENTINEL,
                 GROUP_BLOCKS=group_blocks, HAS_GROUPS=groups, **(config or {}))
    return out


def read_weight_bytes(w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Read a dense weight's bytes (any dtype; its byte count a multiple of 32·N)."""
    n = out.shape[1]
    return read_words(w.reshape(-1).view(torch.int32).view(-1, n), out)


def read_packed(p, out: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """Read a PackedWNA16's words, scales and zeros as the GEMV does."""
    block_k = 256 // p.bits
    group_blocks = max(1, (p.group_size or p.in_features) // block_k)
    return read_words(p.qweight, out, p.scales, p.zeros, group_blocks, config)
