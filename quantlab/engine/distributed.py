"""The process group of a multi-GPU calibration, and the collectives the engine needs.

`quantlab run --gpus N` (or `torchrun --nproc-per-node N -m quantlab run`) starts N processes.
Each captures its contiguous share of the calibration samples (`share`) and runs it through
every decoder layer; the statistics the algorithms accumulate are summed (or maxed) over the
processes where they are finalized, so every process then holds what one process would have
accumulated over all samples, up to the order of the additions.

Every helper is a no-op in a single process (no copies, no synchronization), so that path is
the one it always was. NCCL moves CUDA tensors only: a CPU tensor (token counts, routed-expert
counts) is staged through this process's GPU and copied back.

The backend is NCCL for CUDA devices and gloo for the CPU (torchrun over a CPU run);
`QUANTLAB_DISTRIBUTED_BACKEND` overrides it, and `gloo` there also lets `--gpus N` start N CPU
processes on a machine without CUDA, so the multi-process path runs where no GPU is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from quantlab.errors import UserError

BACKEND_ENV = "QUANTLAB_DISTRIBUTED_BACKEND"
# The other processes wait in a collective while rank 0 resolves (perhaps downloads) the model
# and samples the calibration set; torchrun ends them all as soon as one process fails.
TIMEOUT = timedelta(hours=2)


@dataclass(frozen=True)
class World:
    """This process's place among the calibration processes."""

    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")  # this process's compute device
    staged: bool = False  # the backend moves CUDA tensors only (NCCL)

    @property
    def active(self) -> bool:
        return self.size > 1

    @property
    def main(self) -> bool:
        """The process that writes the run directory and prints progress."""
        return self.rank == 0


_world = World()


def current() -> World:
    return _world


def init_from_env(device_kind: str) -> World:
    """Join the process group torchrun describes in the environment (`WORLD_SIZE`, `RANK`,
    `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`); a single process when `WORLD_SIZE` ≤ 1.
    On CUDA each process takes the GPU numbered by its `LOCAL_RANK`."""
    global _world
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or _world.active:
        return _world
    backend = os.environ.get(BACKEND_ENV) or ("nccl" if device_kind == "cuda" else "gloo")
    device = torch.device("cpu")
    if device_kind == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=TIMEOUT, device_id=device if backend == "nccl" else None)
    _world = World(dist.get_rank(), dist.get_world_size(), device, staged=backend == "nccl")
    return _world


def close() -> None:
    """Leave the process group (after the last collective); later code runs as one process."""
    global _world
    if _world.active:
        dist.destroy_process_group()
    _world = World(device=_world.device)


def share(n: int, batch_size: int = 8, world: World | None = None) -> slice:
    """This process's contiguous share of `n` calibration samples: whole batches of
    `batch_size` (so every batch is the one a single process would run, and the statistics
    match it up to the order of additions), or, with fewer batches than processes, samples."""
    world = world or _world
    if not world.active or n == 0:
        return slice(0, n)
    if n < world.size:
        raise UserError(f"calibration.num_samples: {n} samples cannot be split over {world.size} processes; "
                        f"give at least {world.size}")
    batches = -(-n // batch_size)
    if batches >= world.size:
        first, end = batches * world.rank // world.size, batches * (world.rank + 1) // world.size
        return slice(first * batch_size, min(end * batch_size, n))
    return slice(n * world.rank // world.size, n * (world.rank + 1) // world.size)


def _staged(t: torch.Tensor, collective: Callable[[torch.Tensor], Any]) -> torch.Tensor:
    """Run `collective` on `t` in place, through a contiguous copy on the backend's device
    where `t` is not one already."""
    buf = t.to(_world.device if _world.staged else t.device).contiguous()
    collective(buf)
    if buf is not t:
        t.copy_(buf)
    return t


def sum_(t: torch.Tensor) -> torch.Tensor:
    """`t` ← the sum of every process's `t`, in place; returns `t`."""
    if not _world.active:
        return t
    return _staged(t, lambda buf: dist.all_reduce(buf, dist.ReduceOp.SUM))


def max_(t: torch.Tensor) -> torch.Tensor:
    """`t` ← the elementwise max of every process's `t`, in place; returns `t`."""
    if not _world.active:
        return t
    return _staged(t, lambda buf: dist.all_reduce(buf, dist.ReduceOp.MAX))


def broadcast_(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """`t` ← process `src`'s `t`, in place (same shape and dtype everywhere); returns `t`."""
    if not _world.active:
        return t
    return _staged(t, lambda buf: dist.broadcast(buf, src))


def broadcast_parameters_(module: nn.Module, src: int = 0) -> None:
    """Every parameter of `module` ← process `src`'s: after a search every process ran on the
    same reduced statistics, this guarantees identical weights even where kernels are not
    bitwise deterministic."""
    if _world.active:
        for p in module.parameters():
            broadcast_(p.data, src)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Process `src`'s `obj` (picklable; keep tensors out of it: they would unpickle onto
    `src`'s device), on every process."""
    if not _world.active:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every process's `obj` (picklable, no tensors), in rank order."""
    if not _world.active:
        return [obj]
    out: list[Any] = [None] * _world.size
    dist.all_gather_object(out, obj)
    return out


def gather_list(items: list[Any]) -> tuple[list[Any], int]:
    """Every process's `items` concatenated in rank order, and where this process's start:
    with contiguous shares, the single-process list of batches and this share's offset in it."""
    if not _world.active:
        return items, 0
    parts = all_gather_object(items)
    return [x for part in parts for x in part], sum(len(part) for part in parts[: _world.rank])


def gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Every process's `t [rows, ...]` (rows may differ, trailing dims may not) concatenated
    along dim 0 in rank order, on every process."""
    if not _world.active:
        return t
    counts = [int(c) for c in all_gather_object(t.shape[0])]
    device = _world.device if _world.staged else t.device
    padded = t.new_zeros((max(counts), *t.shape[1:]), device=device)
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded)
    return torch.cat([p[:c] for p, c in zip(parts, counts)]).to(t.device)


def barrier() -> None:
    if _world.active:
        dist.barrier()
