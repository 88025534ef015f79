"""What the Triton kernels and their dispatch (`ops`) share, below both: the device's compute
capability and SM count, the interpreter switch, the PDL launch options, the autotuners'
timers, and the GEMV epilogue kinds. The kernel modules import these from here, never from
`ops`, which imports the kernel modules (lazily) to dispatch to them. Imports no triton at
import time."""

from __future__ import annotations

import enum
import importlib.util
import math
import os
import statistics
from typing import Callable, Sequence, TypeVar

import torch


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


class Epilogue(enum.IntEnum):
    """What the GEMV's last split does with its tile (`gemv_epilogue` has the kernels)."""

    PLAIN = 0
    RESIDUAL = 1
    RMS_SWIGLU = 2
    RMS_ROPE_CACHE = 3
