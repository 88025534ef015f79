"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights before W8A8.

A few input channels of a Linear carry activations 10–100× larger than the rest, so one
per-tensor (or per-token) int8 scale wastes most of its levels on them. Dividing channel c of
the input by `s_c` and multiplying weight column c by `s_c` leaves `X Wᵀ` unchanged; with
`s = max|X|^α / max|W|^(1−α)` (max over tokens, and over the rows of every Linear reading X)
the difficulty is split between activations and weights, α setting how much moves.

The division is folded into the op that produces X — the norm before q,k,v and before
gate,up, or the previous Linear's output rows (v → o when v's outputs are o's inputs, i.e.
not under GQA; up → down) — so the float model computes the same function afterwards; only
what quantization sees changes. Biases of the consumers are untouched (input scaling does not
reach them: Qwen2's q,k,v biases stay as they are); a producer Linear's bias is divided with
its rows.

α is fixed, or searched per layer and group over `i/grid` (plus "no smoothing") by the error
of the group's Linear outputs under W8A8 fake quantization (weights per the stage's scheme,
by default the following weight stage's; activations per the act_ranges stage's) against the
float outputs, on a seeded token subsample. For a static per-tensor scheme the search
quantizes with the range the act_ranges stage will deploy: with the `absmax` observer that is
exactly `max_c(max|X_c| / s_c)` over every calibration token (the per-channel absmax is
observed in full, so rare outlier tokens missing from the subsample still set the range);
with a clipping observer (percentile / mse / histogram) it is that observer run on the
smoothed subsample.

SmoothQuant returns no codes: weight stages after it encode the smoothed weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Sequence

import torch
from torch import nn

from quantlab.engine import distributed
from quantlab.engine.observers import RangeObserver
from quantlab.engine.sequential import LayerContext
from quantlab.models.arch import ScalingGroup
from quantlab.quant.activations import fake_quant_activation
from quantlab.quant.primitives import QuantizedWeight, fake_quantize_weight
from quantlab.quant.scheme import PRESETS, ActivationScheme, WeightScheme

MIN_SCALE = 1e-5


def smoothing_scales(x_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """`max|X|^α / max|W|^(1−α)` per input channel; channels never seen active (or with all-zero
    weights) keep `s = 1` so an uncalibrated channel is never blown up."""
    x, w = x_absmax.float(), w_absmax.float()
    s = (x.clamp(min=MIN_SCALE).pow(alpha) / w.clamp(min=MIN_SCALE).pow(1 - alpha)).clamp(min=MIN_SCALE)
    dead = (x <= 0) | (w <= 0) | ~torch.isfinite(s)
    return torch.where(dead, torch.ones_like(s), s)


def column_absmax(linears: list[nn.Linear]) -> torch.Tensor:
    return torch.stack([lin.weight.detach().abs().amax(dim=0) for lin in linears]).amax(dim=0).float()


def can_smooth(layer: nn.Module, group: ScalingGroup) -> bool:
    """A norm can always absorb the scales; a Linear only if its outputs are the consumers'
    inputs one to one (v_proj → o_proj fails under GQA: v has fewer output channels)."""
    prev = layer.get_submodule(group.prev)
    in_f = layer.get_submodule(group.linears[0]).in_features
    if isinstance(prev, nn.Linear):
        return prev.out_features == in_f
    weight = getattr(prev, "weight", None)
    return weight is not None and weight.dim() == 1 and weight.numel() == in_f


@dataclass
class GroupInputs:
    """What one group's shared input looked like over the calibration set."""

    absmax: RangeObserver = field(default_factory=lambda: RangeObserver("absmax", per_channel=True))
    sample: list[torch.Tensor] = field(default_factory=list)  # token subsample, [n, in] each


def observe_groups(
    ctx: LayerContext, groups: list[ScalingGroup], tokens_per_batch: int, generator: torch.Generator,
    skip: Sequence[int] = (),
) -> dict[str, GroupInputs]:
    """Per-channel absmax of each group's input over every token, plus a seeded token subsample.
    Under several processes both cover every process's tokens: absmax is maxed, the subsample
    gathered in rank order, and `skip` (the token counts of the batches of the processes
    before this one) advances the generator past their draws, so the subsample is the one a
    single process draws."""
    seen = {g.prev: GroupInputs() for g in groups}
    for size in skip if tokens_per_batch else ():
        for _ in groups:
            torch.randperm(size, generator=generator)

    def hook_for(key: str):
        def hook(_m: nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            seen[key].absmax.update(x)
            if tokens_per_batch:
                idx = torch.randperm(x.shape[0], generator=generator)[:tokens_per_batch]
                seen[key].sample.append(x[idx.to(x.device)].float())

        return hook

    handles = [ctx.linear(g.linears[0]).register_forward_pre_hook(hook_for(g.prev)) for g in groups]
    try:
        ctx.forward()
    finally:
        for h in handles:
            h.remove()
    if distributed.current().active:
        for inputs in seen.values():
            inputs.absmax.reduce()
            if tokens_per_batch:
                inputs.sample = [distributed.gather_rows(torch.cat(inputs.sample))]
    return seen


def w8a8_error(
    x: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor, wscheme: WeightScheme, ascheme: ActivationScheme,
    reference: torch.Tensor, static_absmax: torch.Tensor | None = None,
) -> float:
    """Squared error of the group's outputs with smoothing `s` under W8A8 fake quantization.
    A static scheme quantizes `x / s` with `static_absmax` when given (the deployed range),
    else with the scheme's observer run on `x / s` itself."""
    xs = x / s
    absmax = None if ascheme.dynamic else static_absmax if static_absmax is not None else _static_absmax(xs, ascheme)
    xq = fake_quant_activation(xs, ascheme, absmax)
    wq = torch.cat([fake_quantize_weight(w * s, wscheme).float() for w in weights], dim=0)
    return (xq @ wq.T - reference).pow(2).sum().item()


def _static_absmax(x: torch.Tensor, scheme: ActivationScheme) -> torch.Tensor:
    obs = RangeObserver.for_scheme(scheme)
    obs.update(x)
    return obs.result().to(x.device)


def deployed_static_absmax(scheme: ActivationScheme, x_absmax: torch.Tensor, s: torch.Tensor) -> torch.Tensor | None:
    """The exact per-tensor range act_ranges will find for `X / s` when that is computable
    from the full per-channel absmax (static `absmax` observer); None otherwise."""
    if scheme.dynamic or scheme.observer != "absmax":
        return None
    return (x_absmax.to(s.device) / s).max()


def _all_batches(ctx: LayerContext) -> tuple[int, list[int]]:
    """How many calibration batches every process holds together, and the token counts of the
    batches before this process's share (one process: its own batches, none before)."""
    if not distributed.current().active:
        return len(ctx.batches), []
    sizes, offset = distributed.gather_list([b.hidden.shape[0] * b.hidden.shape[1] for b in ctx.batches])
    return len(sizes), sizes[:offset]


@dataclass
class SmoothQuant:
    alpha: float = 0.5
    search: bool = False
    grid: int = 10
    weights: WeightScheme | None = field(default_factory=lambda: PRESETS["W8A16"])
    activations: ActivationScheme | None = field(default_factory=ActivationScheme)
    max_tokens: int = 1024
    skip: list[str] = field(default_factory=list)
    seed: int = 0
    chosen: dict[str, float | None] = field(default_factory=dict)  # full producer name → α (None: unsmoothed)

    def __post_init__(self) -> None:
        if self.activations is None:  # a stage built outside a Recipe: the recipe defaults
            self.activations = ActivationScheme()
        if self.weights is None:
            self.weights = PRESETS["W8A16"]

    def groups(self, ctx: LayerContext) -> list[ScalingGroup]:
        return [g for g in ctx.spec.scaling
                if not any(fnmatch(g.prev, p) for p in self.skip) and can_smooth(ctx.layer, g)]

    def apply(self, ctx: LayerContext) -> dict[str, QuantizedWeight]:
        ctx.spec.require_dense("smoothquant")
        groups = self.groups(ctx)
        generator = torch.Generator().manual_seed(self.seed * 100_003 + ctx.index)
        batches, before = _all_batches(ctx)
        per_batch = -(-self.max_tokens // max(batches, 1)) if self.search else 0
        inputs = observe_groups(ctx, groups, per_batch, generator, before)
        for group in groups:
            seen = inputs[group.prev]
            linears = [ctx.linear(n) for n in group.linears]
            w_absmax = column_absmax(linears).to(seen.absmax.result().device)
            x_absmax = seen.absmax.result()
            if self.search:
                s, alpha = self._search(torch.cat(seen.sample), linears, x_absmax, w_absmax)
            else:
                s, alpha = smoothing_scales(x_absmax, w_absmax, self.alpha), self.alpha
            self.chosen[ctx.full_name(group.prev)] = alpha
            if alpha is not None:
                ctx.spec.fold_scales(ctx.layer.get_submodule(group.prev),
                                     [ctx.layer.get_submodule(n) for n in group.linears], s)
                ctx.divided_outputs(group.prev, s)
        distributed.broadcast_parameters_(ctx.layer)  # every process searched the same statistics
        return {}

    def _search(
        self, x: torch.Tensor, linears: list[nn.Linear], x_absmax: torch.Tensor, w_absmax: torch.Tensor
    ) -> tuple[torch.Tensor, float | None]:
        """Best of "no smoothing" and α = i/grid by the W8A8 output error (ties keep the first)."""
        weights = [lin.weight.detach().float().to(x.device) for lin in linears]
        reference = x @ torch.cat(weights, dim=0).T
        candidates = [(None, torch.ones(x.shape[1], device=x.device))]
        candidates += [(i / self.grid, smoothing_scales(x_absmax, w_absmax, i / self.grid).to(x.device))
                       for i in range(self.grid + 1)]
        best: tuple[float, float | None, torch.Tensor] | None = None
        for alpha, s in candidates:
            static = deployed_static_absmax(self.activations, x_absmax, s)
            err = w8a8_error(x, weights, s, self.weights, self.activations, reference, static)
            if best is None or err < best[0]:
                best = (err, alpha, s)
        assert best is not None
        return best[2], best[1]

    def summary(self) -> dict[str, float | None]:
        return dict(self.chosen)
