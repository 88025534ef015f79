"""Measured time and memory peaks of a stage, recorded next to its outputs so the memory plan's
estimate can be checked against what a run really used (benchmarks/scale.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def host_peak_bytes() -> int | None:
    """The process's peak resident set (VmHWM) since start or the last `reset_host_peak`."""
    if not _STATUS.is_file():
        return None
    for line in _STATUS.read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def reset_host_peak() -> None:
    """Restart VmHWM from the current resident set (Linux: `5` to clear_refs); elsewhere the
    peak stays the process's lifetime peak."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        pass


@dataclass
class MemoryPeaks:
    """Wall time, peak GPU memory (allocated and reserved by PyTorch's allocator) and peak host
    RSS between `start` and `stop`."""

    device: torch.device
    started: float

    @classmethod
    def start(cls, device: torch.device) -> "MemoryPeaks":
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        reset_host_peak()
        return cls(device, time.perf_counter())

    def stop(self) -> dict[str, float | int]:
        """`quantize_seconds`-style figures for the stage's record (bytes are integers)."""
        out: dict[str, float | int] = {}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(self.device)
            out["peak_gpu_reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
        host = host_peak_bytes()
        if host is not None:
            out["peak_host_bytes"] = host
        return {"quantize_seconds": round(time.perf_counter() - self.started, 2), **out}
