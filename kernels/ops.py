"""Dispatch: Triton kernels on a CUDA GPU (or under TRITON_INTERPRET=1), torch reference
otherwise. This module imports no triton at import time, so `quantlab.kernels` loads on a
CPU-only machine without triton installed."""

from __future__ import annotations

import enum
import importlib.util
import math
import os
import statistics
from typing import Callable, Sequence, TypeVar

import torch

from quantlab.kernels import reference
from quantlab.kernels.layout import PackedFP8, PackedW8A8, PackedWNA16


# Decided once, outside any traced code: torch.compile cannot trace importlib's find_spec or
# functools.cache, and a graph break per Linear would undo the compiled decode step.
_TRITON = importlib.util.find_spec("triton") is not None
_CAPABILITY: dict[int, tuple[int, int]] = {}
_SMS: dict[int, int] = {}
T = TypeVar("T")


def triton_installed() -> bool:
    return _TRITON


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def sm_count(device: torch.device, interpreted: int) -> int:
    """Streaming multiprocessors of a CUDA device, cached (launch grids ask on every call);
    `interpreted` stands in on the CPU, where the Triton interpreter runs the grid."""
    if device.type != "cuda":
        return interpreted
    index = device.index or 0
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def capture_graph(fn: Callable[[], T], warmups: int = 1) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run fn `warmups` times on a side stream (compiles, autotunes, allocates outside the
    graph's pool), then capture one call; returns the graph and that call's output, which every
    replay rewrites in place."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_replay(fn: Callable[[], object]) -> Callable[[], None]:
    """fn as a CUDA-graph replay: timing it excludes host launch overhead, as a decode step under
    CUDA graphs or torch.compile would see it."""
    return capture_graph(fn)[0].replay


_FLUSH: dict[torch.device, torch.Tensor] = {}
FLUSH_BYTES = 256 << 20  # five times an H100's or H200's 50 MB L2


def flush_l2(device: torch.device, dirty: bool = False) -> None:
    """Evict the L2 cache before a timed run. The default reads a buffer five times its size,
    leaving clean lines, as a decode step finds L2 after the previous layer's weight reads.
    `dirty` writes it instead (triton's do_bench zeroes a buffer): every line is then dirty,
    and a kernel that reads fresh bytes also pays for writing back as many — up to 50 MB,
    which costs a 36 MB int4 weight read far more than a 136 MB bf16 one."""
    buf = _FLUSH.get(device)
    if buf is None:
        buf = _FLUSH[device] = torch.ones(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    if dirty:
        buf.fill_(1)
    else:
        buf.amax()


def bench_cold(fn: Callable[[], object], warmup_ms: float = 5, rep_ms: float = 20,
               quantiles=None, dirty: bool = False):
    """do_bench's protocol (CUDA events around each run, L2 flushed before it, runs for about
    `rep_ms` after `warmup_ms`) with `flush_l2`'s choice of flush. Returns the median in ms,
    or the list of `quantiles` as do_bench does."""
    device = torch.device("cuda", torch.cuda.current_device())
    fn()
    torch.cuda.synchronize()
    probe = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    probe[0].record()
    for _ in range(5):
        flush_l2(device, dirty)
        fn()
    probe[1].record()
    torch.cuda.synchronize()
    estimate = max(probe[0].elapsed_time(probe[1]) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    runs = max(1, int(rep_ms / estimate))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(runs)]
    for start, end in events:
        flush_l2(device, dirty)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = torch.tensor([s.elapsed_time(e) for s, e in events])
    if quantiles is None:
        return times.median().item()
    return torch.quantile(times, torch.tensor(quantiles)).tolist()


def autotune_bench(fn: Callable[[], object], quantiles=None):
    """The autotuners' timer: CUDA-graph replays, L2 flushed (clean, `flush_l2`) before each.
    Timed eagerly, a 10–20 µs kernel hides behind its own launch overhead and the autotuner
    picks at random among the small-shape configs (an H200, W4A16 at K×N = 3584×512, M = 64:
    20.0 µs picked against 13.1 µs for the best config)."""
    import triton.testing

    if torch.cuda.is_available() and not interpret_mode():
        return bench_cold(graph_replay(fn), quantiles=quantiles)
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def interleaved_rounds(timers: Sequence[Callable[[], float]], rounds: int,
                       rotate: bool = False) -> list[list[float]]:
    """Each timer's results over `rounds` rounds that call every timer once, in order (`rotate`:
    each round starting one timer later), so that the drift of a loaded GPU's clocks reaches
    all of them alike instead of whichever was timed last."""
    out: list[list[float]] = [[] for _ in timers]
    n = len(timers)
    for r in range(rounds if n else 0):
        start = r % n if rotate else 0
        for i in [*range(start, n), *range(start)]:
            out[i].append(timers[i]())
    return out


def fastest(runs: Sequence[Callable[[], object]], rounds: int = 3) -> int:
    """The index of the fastest of `runs`: each timed `rounds` times by `autotune_bench`, the
    rounds interleaved, compared by median. One timing each let the noise pick: on an H100 the
    same FP8 kernel config timed 15.2–16.3 µs in one process, and the Gluon tuner kept a tile
    order about 0.5 µs slower in one of two runs."""
    times = interleaved_rounds([lambda fn=fn: autotune_bench(fn) for fn in runs], rounds)
    medians = [statistics.median(ts) for ts in times]
    return min(range(len(runs)), key=medians.__getitem__)


def retime_top(tuner, keys, launch: Callable[[object], object], top: int = 6, rounds: int = 5) -> None:
    """For each key a Triton autotuner has just benchmarked (`keys`, new in `tuner.cache`):
    time its `top` fastest configs again in `rounds` interleaved rounds (`fastest`, each config
    run by `launch(config)`) and keep the best median. The autotuner times every config once,
    in turn, and among configs within a few percent of each other that timing is noise. On an
    H200 at M = 4096 (FP8) the config fastest in
    interleaved rounds was the autotuner's 1st, 5th, 6th and 6th on four MLP shapes: the 3
    best kept it 0.8–3.7% slower on three of them, the 6 best found it on all four.
    Needs the autotuner's `configs_timings` (Triton ≥ 3.2); without them the pick stands."""
    ranked = list(autotuner_ranking(tuner))[:top]
    if keys and len(ranked) > 1:
        best = ranked[fastest([lambda c=c: launch(c) for c in ranked], rounds)]
        tuner.cache.update(dict.fromkeys(keys, best))


def autotuner_ranking(tuner) -> dict:
    """The configs a Triton autotuner last benchmarked that compiled, fastest first, each with
    its median time in ms; empty without `configs_timings` (Triton < 3.2)."""
    timings = getattr(tuner, "configs_timings", None) or {}
    ran = {c: _first(t) for c, t in timings.items() if math.isfinite(_first(t))}  # inf: did not compile
    return dict(sorted(ran.items(), key=lambda item: item[1]))


def _first(timing) -> float:
    """An autotuner timing: a float, or the list of do_bench quantiles, median first."""
    return timing[0] if isinstance(timing, (list, tuple)) else timing


def pdl_requested() -> bool:
    """QUANTLAB_PDL=1: launch the GEMV and attention kernels with programmatic dependent launch
    (and compile the decode step's glue with Inductor's PDL), for measuring on Hopper."""
    return os.environ.get("QUANTLAB_PDL", "0") == "1"


def pdl_on(t: torch.Tensor) -> bool:
    """Whether a kernel launch on `t`'s device uses PDL (requested, sm_90+, not interpreted)."""
    return pdl_requested() and t.is_cuda and not interpret_mode() and use_triton(t, (9, 0))


class PdlTrigger(enum.IntEnum):
    """Where a PDL kernel lets the next kernel launch (its `PDL` constexpr; 0 is PDL off).

    START lets a chain of PDL kernels cascade: each one's programs launch as soon as the
    previous one's have all started, so several kernels' programs can sit waiting at once.
    AFTER_WAIT keeps at most one kernel waiting ahead: the next launches once this one's wait
    is over, that is once the kernel before it has finished."""
    AFTER_LOOP = 1
    START = 2
    AFTER_WAIT = 3


def pdl_launch(t: torch.Tensor) -> dict:
    """The launch options of a PDL-capable kernel on `t`'s device: none where `pdl_on` fails,
    else `launch_pdl` and the trigger QUANTLAB_PDL_TRIGGER names: "wait" (the default) or
    "start". The fused batch-1 decode step on H100s (benchmarks/decode.py) ran at 414–419
    tok/s without PDL; with it at 339.6 under START and 393–425 under AFTER_WAIT (three
    machines)."""
    if not pdl_on(t):
        return {}
    name = os.environ.get("QUANTLAB_PDL_TRIGGER", "wait")
    trigger = {"start": PdlTrigger.START, "wait": PdlTrigger.AFTER_WAIT}.get(name)
    if trigger is None:
        raise ValueError(f"QUANTLAB_PDL_TRIGGER: choose start or wait, got {name!r}")
    return dict(PDL=int(trigger), launch_pdl=True)


def cuda_capability(t: torch.Tensor) -> tuple[int, int] | None:
    """The compute capability of a CUDA tensor's device (cached: kernels ask on every call),
    None off CUDA."""
    if t.device.type != "cuda":
        return None
    index = t.device.index or 0
    if index not in _CAPABILITY:  # filled by the first (eager) call on the device
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


def use_triton(t: torch.Tensor, min_capability: tuple[int, int] = (8, 0)) -> bool:
    """Whether a tensor on this device should go through the Triton kernels."""
    if not _TRITON:
        return False
    if t.device.type == "cuda":
        return cuda_capability(t) >= min_capability
    return t.device.type == "cpu" and interpret_mode()


def _flat(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    lead = tuple(x.shape[:-1])
    x2 = x.reshape(-1, x.shape[-1])
    return (x2 if x2.stride(-1) == 1 else x2.contiguous()), lead


# The Triton launches as torch custom ops: torch.compile (the runner's decode="compile") then
# treats each GEMM as one opaque node instead of tracing into the autotuner's Python. Eager
# calls skip the op's dispatch: it cost 40–75 µs of host time per call on the H200 machine
# (W4A16 at M = 512: 137 µs through the op against 61 µs direct), and an eager 512-token
# prefill is host-bound (`_wna16_mm`, `_scaled_mm`).


@torch.library.custom_op("quantlab::wna16_mm", mutates_args=())
def _wna16_mm_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 perm: torch.Tensor | None, bits: int, group_size: int, in_features: int, out_features: int,
                 impl: str) -> torch.Tensor:
    return _wna16_direct(x, qweight, scales, zeros, perm, bits, group_size, in_features, out_features, impl)


@_wna16_mm_op.register_fake
def _(x, qweight, scales, zeros, perm, bits, group_size, in_features, out_features, impl):
    return x.new_empty(x.shape[0], out_features)


@torch.library.custom_op("quantlab::scaled_mm", mutates_args=())
def _scaled_mm_op(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                  zc: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    return _scaled_direct(xq, sx, w, scale, zc, out_dtype)


@_scaled_mm_op.register_fake
def _(xq, sx, w, scale, zc, out_dtype):
    return xq.new_empty(xq.shape[0], w.shape[0], dtype=out_dtype)


@torch.library.custom_op("quantlab::decode_attention", mutates_args=())
def _decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         pos: torch.Tensor, k_scale: torch.Tensor | None,
                         v_scale: torch.Tensor | None) -> torch.Tensor:
    return _decode_attention_direct(q, k, v, mask, pos, k_scale, v_scale)


@_decode_attention_op.register_fake
def _(q, k, v, mask, pos, k_scale, v_scale):
    return torch.empty_like(q)


def _decode_attention_direct(q, k, v, mask, pos, k_scale, v_scale):
    from quantlab.kernels.triton_attention import decode_attention as kernel

    return kernel(q, k, v, mask, pos, k_scale, v_scale)


@torch.library.custom_op("quantlab::attention_partials", mutates_args=())
def _partials_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                 start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _partials_direct(q, k, v, pos, start)


@_partials_op.register_fake
def _(q, k, v, pos, start):
    from quantlab.kernels.triton_attention import partials_shape

    shape = partials_shape(q, k)
    return (q.new_empty(shape[:3], dtype=torch.float32), q.new_empty(shape[:3], dtype=torch.float32),
            q.new_empty(shape, dtype=torch.float32))


def _partials_direct(q, k, v, pos, start):
    from quantlab.kernels.triton_attention import attention_partials

    return tuple(attention_partials(q, k, v, None, pos, start))


def decode_attention_ok(q: torch.Tensor) -> bool:
    """Whether the Triton decode-attention kernel takes `q [B, H, D]` here (D a power of two)."""
    d = q.shape[-1]
    return use_triton(q) and d >= 16 and d & (d - 1) == 0


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     pos: torch.Tensor, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query per row over the static KV cache (`triton_attention.decode_attention`); the
    caller checks `decode_attention_ok` and keeps its torch path otherwise."""
    fn = _decode_attention_op if torch.compiler.is_compiling() else _decode_attention_direct
    return fn(q, k, v, mask, pos, k_scale, v_scale)


def attention_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                       start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decode attention's first launch over a compute-dtype cache, keys from `start[b]`
    to the step's (`triton_attention.attention_partials`, no mask): `(m, l, acc)` for an
    o_proj GEMV that combines them (`wna16_gemv_epilogue(partials, ...)`)."""
    fn = _partials_op if torch.compiler.is_compiling() else _partials_direct
    return fn(q, k, v, pos, start)


def _wna16_direct(x, qweight, scales, zeros, perm, bits, group_size, in_features, out_features, impl):
    from quantlab.kernels.triton_wna16 import wna16_matmul

    p = PackedWNA16(qweight, scales, zeros, bits, group_size or None, in_features, out_features, perm)
    return wna16_matmul(x, p, impl=impl)


def _scaled_direct(xq, sx, w, scale, zc, out_dtype):
    from quantlab.kernels import triton_scaled

    if w.dtype == torch.int8:
        return triton_scaled.w8a8_matmul(xq, sx, PackedW8A8(w, scale, zc), out_dtype)
    return triton_scaled.fp8_matmul(xq, sx, PackedFP8(w, scale), out_dtype)


def _wna16_mm(*args) -> torch.Tensor:
    """The custom op while torch.compile traces, else its implementation called directly."""
    return (_wna16_mm_op if torch.compiler.is_compiling() else _wna16_direct)(*args)


def _scaled_mm(*args) -> torch.Tensor:
    """As `_wna16_mm`, for the scaled int8 / FP8 GEMM."""
    return (_scaled_mm_op if torch.compiler.is_compiling() else _scaled_direct)(*args)


def wna16_linear(x: torch.Tensor, p: PackedWNA16, bias: torch.Tensor | None = None,
                 impl: str = "auto") -> torch.Tensor:
    """`x [..., K]` (bf16/fp16) @ Wᵀ for packed W4A16 / W8A16 weights."""
    x2, lead = _flat(x)
    if p.kernel_ok and use_triton(x2):
        y = _wna16_mm(x2, p.qweight, p.scales, p.zeros, p.perm, p.bits, p.group_constexpr,
                      p.in_features, p.out_features, impl)
    else:
        y = reference.wna16_mm(x2, p)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, p.out_features)


# GEMV epilogues (`gemv_epilogue`): the batch-1 decode step's layer as four GEMVs and the
# attention. One custom op for the three kinds; what it writes besides its outputs (the KV
# cache) is declared mutated.


class Epilogue(enum.IntEnum):
    """What the GEMV's last split does with its tile (`gemv_epilogue` has the kernels)."""

    PLAIN = 0
    RESIDUAL = 1
    RMS_SWIGLU = 2
    RMS_ROPE_CACHE = 3


@torch.library.custom_op("quantlab::wna16_gemv_epilogue", mutates_args=("k_cache", "v_cache"))
def _epilogue_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bits: int, group_size: int, in_features: int, out_features: int, kind: int,
                 row: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor | None,
                 sin: torch.Tensor | None, pos: torch.Tensor | None, k_cache: torch.Tensor | None,
                 v_cache: torch.Tensor | None, nq: int, nkv: int, attn_m: torch.Tensor | None,
                 attn_l: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return _epilogue_direct(x, qweight, scales, zeros, bits, group_size, in_features, out_features, kind,
                            row, weight, eps, cos, sin, pos, k_cache, v_cache, nq, nkv, attn_m, attn_l)


def _epilogue_outputs(row: torch.Tensor, kind: int, out_features: int, weight: torch.Tensor | None,
                      nq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty outputs of an epilogue GEMV, always two (Inductor takes no list outputs from a
    mutating op): RESIDUAL `(y, y·w)` (the second empty without w), RMS_SWIGLU `(act, —)`
    (half the columns), RMS_ROPE_CACHE `(q, —)`."""
    if kind == Epilogue.RESIDUAL:
        return row.new_empty(1, out_features), row.new_empty(1, out_features if weight is not None else 0)
    return row.new_empty(1, out_features // 2 if kind == Epilogue.RMS_SWIGLU else nq), row.new_empty(0)


@_epilogue_op.register_fake
def _(x, qweight, scales, zeros, bits, group_size, in_features, out_features, kind, row, weight, eps, cos,
      sin, pos, k_cache, v_cache, nq, nkv, attn_m, attn_l):
    return _epilogue_outputs(row, kind, out_features, weight, nq)


def _epilogue_direct(x, qweight, scales, zeros, bits, group_size, in_features, out_features, kind, row,
                     weight, eps, cos, sin, pos, k_cache, v_cache, nq, nkv, attn_m, attn_l):
    from quantlab.kernels.triton_attention import Partials, prologue_args
    from quantlab.kernels.triton_wna16 import wna16_gemv_epilogue

    p = PackedWNA16(qweight, scales, zeros, bits, group_size or None, in_features, out_features)
    outs = _epilogue_outputs(row, kind, out_features, weight, nq)
    args: dict = dict(EPI=kind, e_row_ptr=row, e_w_ptr=weight, e_eps=eps)
    if attn_m is not None:  # x: the partials' values; the GEMV forms its own input row
        args.update(prologue_args(Partials(attn_m, attn_l, x), in_features // x.shape[-1]))
        x = row.new_empty(1, in_features)
    if kind == Epilogue.RESIDUAL:
        args["e_y2_ptr"] = outs[1] if weight is not None else None
    elif kind == Epilogue.RMS_ROPE_CACHE:
        args.update(HEAD_D=k_cache.shape[-1], e_cos_ptr=cos, e_sin_ptr=sin, e_pos_ptr=pos, e_kc_ptr=k_cache,
                    e_vc_ptr=v_cache, e_nq=nq, e_nkv=nkv, e_cache_s=k_cache.shape[-2])
    wna16_gemv_epilogue(x, p, outs[0], args)
    return outs


def wna16_gemv_epilogue(x: torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor], p: PackedWNA16,
                        kind: int, row: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 0.0,
                        rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                        cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                        nq: int = 0, nkv: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's GEMV with an epilogue (`gemv_epilogue`) on one token row `x [1, K]`, or
    on the attention output that the GEMV combines from `x = attention_partials(...)`: `row`
    is the residual (RESIDUAL) or the row whose 1/rms scales the product; `weight` the next
    norm's weight (RESIDUAL) or the bias (RMS_ROPE_CACHE); `rope` the cos/sin tables and the
    position, `cache` the KV caches of one row (`[KV heads, S, D]`). The caller checks that
    the Triton kernels run here (`use_triton`) and that the GEMV takes `p`."""
    cos, sin, pos = rope if rope is not None else (None, None, None)
    k_cache, v_cache = cache if cache is not None else (None, None)
    attn_m, attn_l, x = x if isinstance(x, tuple) else (None, None, x)
    fn = _epilogue_op if torch.compiler.is_compiling() else _epilogue_direct
    return fn(x, p.qweight, p.scales, p.zeros, p.bits, p.group_constexpr, p.in_features, p.out_features, kind,
              row, weight, eps, cos, sin, pos, k_cache, v_cache, nq, nkv, attn_m, attn_l)


def w8a8_mm(xq: torch.Tensor, sx: torch.Tensor, p: PackedW8A8,
            out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    if use_triton(xq, (9, 0)) and xq.shape[1] % 16 == 0:
        return _scaled_mm(xq, sx, p.w, p.scale, p.zc, out_dtype)
    return reference.w8a8_mm(xq, sx, p, out_dtype)


def fp8_mm(xq: torch.Tensor, sx: torch.Tensor, p: PackedFP8,
           out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    if use_triton(xq, (9, 0)) and xq.shape[1] % 16 == 0:
        return _scaled_mm(xq, sx, p.w, p.scale, None, out_dtype)
    return reference.fp8_mm(xq, sx, p, out_dtype)


def w8a8_linear(x: torch.Tensor, p: PackedW8A8, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dynamic per-token int8 activations × int8 weights (SmoothQuant-style A8W8)."""
    x2, lead = _flat(x)
    xq, sx = reference.quantize_act_int8(x2)
    y = w8a8_mm(xq, sx, p, x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, p.w.shape[0])


def fp8_linear(x: torch.Tensor, p: PackedFP8, bias: torch.Tensor | None = None,
               per_token: bool = True) -> torch.Tensor:
    """Dynamic FP8 activations (per token or per tensor) × FP8 weights."""
    x2, lead = _flat(x)
    xq, sx = reference.quantize_act_fp8(x2, per_row=per_token)
    y = fp8_mm(xq, sx, p, x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, p.w.shape[0])
