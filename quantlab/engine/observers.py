"""Range observers: running statistics of activations seen during calibration.

`absmax` keeps the running max of |x| (per tensor or per channel). `percentile`, `mse` and
`histogram` keep a 2048-bin histogram of |x| (rebinned as the range grows, as TensorRT's
calibrators do) and pick one per-tensor clipping threshold from it: the given percentile, the
threshold minimising the expected quantization MSE of the target format (int8 or FP8 e4m3:
the error is computed with the real quantizer, so FP8's non-uniform grid is accounted for), or
the one minimising the KL divergence between the clipped-and-quantized and the original
distribution (entropy calibration, defined for int8's 128 uniform levels only).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal

import torch
from torch import nn

from quantlab.engine import distributed
from quantlab.errors import UserError
from quantlab.quant.activations import INT8_MAX, fake_quant, qmax_of

ObserverKind = Literal["absmax", "percentile", "mse", "histogram"]
QuantKind = Literal["int8", "fp8"]
BINS = 2048
# What several calibration processes can combine exactly: a max is a max in any order, but each
# process's histogram has its own range (rebinned as its data grew), so merged histograms
# would not be the one a single process builds.
REDUCIBLE: tuple[ObserverKind, ...] = ("absmax",)


def require_reducible(kind: str, field: str = "activations.observer") -> None:
    """Refuse an observer that several calibration processes cannot combine exactly."""
    if kind not in REDUCIBLE:
        raise UserError(f"{field}: {kind} cannot be combined across calibration processes (--gpus); "
                        f"use {' or '.join(REDUCIBLE)}, or calibrate in one process")


@dataclass
class RangeObserver:
    kind: ObserverKind = "absmax"
    per_channel: bool = False
    percentile: float = 99.99
    quant: QuantKind = "int8"  # the format the mse / histogram thresholds are chosen for
    absmax: torch.Tensor | None = None
    hist: torch.Tensor | None = None
    hist_max: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        # Refuse what would silently fall back to something else.
        if self.per_channel and self.kind != "absmax":
            raise ValueError(f"{self.kind} observers pick one per-tensor threshold; per-channel needs absmax")
        if self.kind == "histogram" and self.quant != "int8":
            raise ValueError("the histogram (KL entropy) observer is defined for int8; use mse or percentile for FP8")

    @classmethod
    def for_scheme(cls, scheme: Any) -> "RangeObserver":
        """The per-tensor observer an `ActivationScheme` asks for, tuned to its format."""
        return cls(scheme.observer, percentile=scheme.percentile, quant=scheme.kind)

    def update(self, x: torch.Tensor) -> None:
        a = x.detach().float().abs().reshape(-1, x.shape[-1])
        cur = a.amax(dim=0) if self.per_channel else a.amax()
        self.absmax = cur if self.absmax is None else torch.maximum(self.absmax, cur)
        self.count += a.shape[0]
        if self.kind != "absmax":
            self._update_hist(a.flatten())

    def reduce(self) -> None:
        """Combine every calibration process's observations (a no-op in one process)."""
        if distributed.current().active:
            require_reducible(self.kind)
            distributed.max_(self.absmax)

    def _update_hist(self, a: torch.Tensor) -> None:
        top = float(a.max())
        if self.hist is None:
            self.hist_max = max(top, 1e-8)
            self.hist = torch.zeros(BINS, dtype=torch.float64)
        elif top > self.hist_max:  # widen the range: fold old bins into the new, coarser grid
            old_edges = torch.linspace(0, self.hist_max, BINS + 1, dtype=torch.float64)[:-1]
            self.hist_max = top
            idx = (old_edges / self.hist_max * BINS).long().clamp(max=BINS - 1)
            self.hist = torch.zeros(BINS, dtype=torch.float64).index_add_(0, idx, self.hist)
        # counted on x's device (fp32 counts are exact per batch), accumulated in fp64 on the CPU
        self.hist += torch.histc(a.float(), bins=BINS, min=0, max=self.hist_max).double().cpu()

    def result(self) -> torch.Tensor:
        """The absmax to build scales from (clipped for the histogram-based kinds)."""
        assert self.absmax is not None, "observer saw no data"
        if self.kind == "absmax":
            return self.absmax.cpu()
        return torch.tensor(self._threshold(), dtype=torch.float32)

    def _threshold(self) -> float:
        assert self.hist is not None
        width = self.hist_max / BINS
        if self.kind == "percentile":
            cdf = torch.cumsum(self.hist, 0) / self.hist.sum()
            return float((torch.searchsorted(cdf, self.percentile / 100).clamp(max=BINS - 1) + 1) * width)
        candidates = torch.arange(BINS // 16, BINS + 1, BINS // 128)
        losses = torch.stack([self._loss(int(c)) for c in candidates])
        return float(candidates[int(torch.argmin(losses))] * width)

    def _loss(self, cut: int) -> torch.Tensor:
        width = self.hist_max / BINS
        centers = (torch.arange(BINS, dtype=torch.float64) + 0.5) * width
        threshold = cut * width
        if self.kind == "mse":
            scale = torch.tensor(threshold / qmax_of(self.quant), dtype=torch.float64)
            q = fake_quant(centers, scale, self.quant)
            return (self.hist * (centers - q) ** 2).sum()
        return _kl_loss(self.hist, cut, int(INT8_MAX) + 1)


def _kl_loss(hist: torch.Tensor, cut: int, levels: int) -> torch.Tensor:
    """KL(P || Q): P = histogram clipped at `cut` with the outliers added to its last bin, Q =
    the unclipped slice quantized to `levels` bins and spread back over its non-empty bins."""
    p = hist[:cut].clone()
    p[-1] += hist[cut:].sum()
    bucket = torch.arange(cut) * min(levels, cut) // cut
    nonzero = (hist[:cut] > 0).double()
    mass = torch.zeros(levels, dtype=torch.float64).index_add_(0, bucket, hist[:cut])
    filled = torch.zeros(levels, dtype=torch.float64).index_add_(0, bucket, nonzero)
    q = (mass / filled.clamp(min=1))[bucket] * nonzero
    p, q = p / p.sum(), q / q.sum().clamp(min=1e-12)
    mask = p > 0
    return (p[mask] * torch.log(p[mask] / q[mask].clamp(min=1e-12))).sum()


@dataclass
class LinearObservers:
    """Observers on the inputs (and optionally outputs) of a set of Linears."""

    inputs: dict[str, RangeObserver] = field(default_factory=dict)
    outputs: dict[str, RangeObserver] = field(default_factory=dict)


@contextlib.contextmanager
def observe_linears(
    layer: nn.Module, names: list[str], make: Callable[[], RangeObserver], outputs: bool = False
) -> Iterator[LinearObservers]:
    """Attach observers to the Linears `names` of `layer` for the duration of the block."""
    obs = LinearObservers()
    handles = []
    for name in names:
        obs.inputs[name] = make()
        if outputs:
            obs.outputs[name] = make()

        def hook(_m, args, out, name=name):
            obs.inputs[name].update(args[0])
            if outputs:
                obs.outputs[name].update(out)

        handles.append(layer.get_submodule(name).register_forward_hook(hook))
    try:
        yield obs
    finally:
        for h in handles:
            h.remove()
