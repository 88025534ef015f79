"""What every peer script shares: its command line, the shared token files, timing, and
scoring with quantlab's own perplexity function.

Peer scripts run inside the peer's own virtualenv (its torch/transformers versions), with
the repository root on PYTHONPATH so `quantlab.eval.perplexity` (which needs only torch) is
the one scorer for every tool. Only torch, safetensors and the standard library are used
here, so this module imports in any peer environment.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import traceback
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import load_file


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", required=True, help="float model directory (HF layout)")
    p.add_argument("--calib", help="safetensors with input_ids [samples, seq_len] (not for float)")
    p.add_argument("--eval", required=True, help="safetensors with input_ids [tokens] (the test stream)")
    p.add_argument("--method", required=True, choices=["float", "gptq", "awq"])
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--sym", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--damp", type=float, default=0.01)
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--seq-len", type=int, default=2048, help="perplexity window")
    p.add_argument("--windows", type=int, default=None, help="first k windows; all when omitted")
    p.add_argument("--workdir", required=True, help="scratch directory for checkpoints")
    p.add_argument("--out", required=True, help="result JSON")
    return p.parse_args()


def calibration_ids(path: str) -> torch.Tensor:
    return load_file(path)["input_ids"].to(torch.int64)


def eval_stream(path: str) -> torch.Tensor:
    return load_file(path)["input_ids"].to(torch.int64)


class Timer:
    """Seconds spent inside `measure(name)` blocks, by name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def measure(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - start, 2)


def score(model: torch.nn.Module, args: argparse.Namespace) -> dict[str, Any]:
    """quantlab's perplexity over the shared test stream (the same windows for every tool)."""
    from quantlab.eval.perplexity import perplexity

    model.eval()
    return perplexity(model, eval_stream(args.eval), args.seq_len, args.windows).to_dict()


def versions(*packages: str) -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", *packages):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def write_result(args: argparse.Namespace, payload: dict[str, Any]) -> None:
    payload.setdefault("torch_threads", torch.get_num_threads())
    payload.setdefault("pid", os.getpid())
    target = Path(args.out)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".partial")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(target)


def record_failure(result: dict[str, Any], exc: Exception, limit: int = 400) -> None:
    """A peer's failure goes into its result (type and first line of the message) instead of
    crashing the benchmark; the traceback goes to the log."""
    traceback.print_exc()
    text = str(exc).strip()
    result.update(status="failed", error=f"{type(exc).__name__}: {text.splitlines()[0][:limit] if text else ''}")


def finish(args: argparse.Namespace, result: dict[str, Any], timer: "Timer") -> int:
    """Write the result with its stage timings; the exit code says whether the peer ran."""
    result["seconds"] = timer.seconds
    write_result(args, result)
    return 0 if result["status"] == "ok" else 1
