"""AWQ (Lin et al., 2023): activation-aware per-input-channel scales, then weight clipping.

Channels that see large activations matter more to a Linear's output, so AWQ multiplies
their weight columns by `s > 1` before rounding (relatively finer steps for them) and divides
the op that produces those inputs (a norm, or the previous Linear's output rows) by `s`.
The folded float model computes exactly the same function; only the rounding changes.

Per scaling group of the ArchSpec (a producer and the Linears reading its output):
  * `s(α) = x̄^α` — or with duo scaling `x̄^α / w̄^(1−α)` (w̄: mean of |W| normalized per
    quantization group, as AutoAWQ) — normalized by `sqrt(max·min)`, with α on a grid in
    [0, 1); the identity (plain RTN) is always a candidate, so AWQ never picks a scale that
    measures worse than no scale;
  * the error of a candidate is the MSE of the group's *Linear outputs* (q,k,v outputs
    concatenated; gate,up concatenated; o_proj; down_proj) between float weights and
    fake-quantized scaled weights, over a token subsample.
Then each Linear (except q/k by default: their rounding error is amplified by the qk
product, which a per-Linear objective cannot see) gets a per-(row, group) clipping range
shrunk over a grid to minimize that group's output error; weights are clamped in place.

Speed: all errors are quadratic forms in the input Gram matrix `H = XᵀX / T`, so
`‖X(Ŵ − W)ᵀ‖² / T = Σ (D H) ⊙ D` with `D = Ŵ − W`: one `in × in` Gram per distinct input
(q/k/v share one) is accumulated in a forward over a seeded subsample of batches/tokens,
and the grid searches never touch activations again. Clipping uses the Gram's diagonal
blocks (per-group errors, ignoring cross-group terms, like AutoAWQ's clip search).

Mixture-of-experts layers: each expert's statistics come from the tokens routed to it. The
post-attention norm's one scale vector serves every expert (and the router, which absorbs it
in float); it is searched on the error summed over experts, each weighted by its tokens
(`RoutedGram`). An expert no calibration token reached gets no search or clipping of its own
(plain RTN of its weights, scaled with its group) and is reported.

AWQ does not choose the final codes; it returns the RTN encoding of its rescaled, clipped
weights so that it works as the last weight stage, and a following rtn/gptq stage re-encodes
the same float weights (the engine writes codes back only after all stages ran).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Any, Callable, Iterable

import torch
from torch import nn

from quantlab.engine import distributed
from quantlab.engine.sequential import LayerContext, is_ignored
from quantlab.models.arch import ArchSpec
from quantlab.progress import console
from quantlab.quant.primitives import (
    QuantizedWeight,
    compute_qparams,
    group_ranges,
    grouped,
    num_groups,
    quantize_weight,
)
from quantlab.quant.scheme import WeightScheme

MIN_SCALE = 1e-4  # floor of x̄^α and of the duo ratio (dead channels must not blow up 1/s)


# --------------------------------------------------------------------------- primitives


def fake_quantize(
    w: torch.Tensor, scheme: WeightScheme, lo: torch.Tensor | None = None, hi: torch.Tensor | None = None
) -> torch.Tensor:
    """Dequantized `w [out, in]` — the same arithmetic as `quantize_weight`, vectorized over
    groups. Given per-(row, group) ranges `lo, hi [out, groups]`, weights are first clamped to
    them: exactly what `quantize_weight` computes after `apply_clip`."""
    out_f, in_f = w.shape
    g = grouped(w.float(), scheme.group_size)
    if lo is not None and hi is not None:
        lo, hi = lo.unsqueeze(-1), hi.unsqueeze(-1)
        g = torch.maximum(torch.minimum(g, hi), lo)
    return fake_quantize_groups(g, scheme, lo, hi).reshape(out_f, -1)[:, :in_f]


def fake_quantize_groups(
    g: torch.Tensor, scheme: WeightScheme, lo: torch.Tensor | None = None, hi: torch.Tensor | None = None
) -> torch.Tensor:
    """Quantize-dequantize `g [..., G]`, one range per last-dim slice (`lo, hi [..., 1]`,
    default its min/max), in a fresh tensor with in-place steps: the searches call this a few
    hundred times per layer, so memory passes are the cost."""
    if lo is None or hi is None:
        lo, hi = torch.aminmax(g, dim=-1, keepdim=True)
    scale, zero = compute_qparams(lo, hi, scheme.bits, scheme.symmetric)
    return g.div(scale).round_().add_(zero).clamp_(0, scheme.qmax).sub_(zero).mul_(scale)


def weight_mean(w: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """Per input channel: mean over rows of |W| normalized by its quantization group's max."""
    in_f = w.shape[1]
    g = grouped(w.float().abs(), group_size)
    g = g / (g.amax(dim=-1, keepdim=True) + 1e-6)
    return g.reshape(w.shape[0], -1)[:, :in_f].mean(dim=0)


def candidate_scales(
    x_mean: torch.Tensor, w_mean: torch.Tensor | None, alpha: float
) -> torch.Tensor:
    """`x̄^α` (or `x̄^α / w̄^(1−α)` when `w_mean` is given), normalized by `sqrt(max·min)` so the
    scales straddle 1 and neither side of the fold drifts in magnitude."""
    if w_mean is None:
        s = x_mean.pow(alpha).clamp(min=MIN_SCALE)
    else:
        s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + MIN_SCALE)).clamp(min=MIN_SCALE)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


@dataclass
class RoutedGram:
    """Inputs of a stacked weight whose row blocks read different tokens (MoE experts, each
    fed the tokens routed to it): block i has `rows[i]` rows and reads `tokens[i]` tokens with
    Gram `grams[i]`."""

    rows: list[int]
    grams: list[torch.Tensor]
    tokens: list[int]


def output_error(delta: torch.Tensor, gram: torch.Tensor | RoutedGram) -> float:
    """MSE of the outputs `X δᵀ` per output element, from `gram = XᵀX / T`; for a RoutedGram,
    over every (token, output) pair an expert actually computes."""
    if isinstance(gram, RoutedGram):
        blocks = zip(delta.split(gram.rows), gram.grams, gram.tokens, gram.rows)
        squared = sum(output_error(d, g) * t * r for d, g, t, r in blocks)
        return squared / sum(t * r for t, r in zip(gram.tokens, gram.rows))
    return ((delta @ gram) * delta).sum().item() / delta.shape[0]


def scaled_gram(gram: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Gram of the inputs `X / s` after the producer absorbed `1 / s`."""
    inv = 1.0 / s
    return gram * inv[:, None] * inv[None, :]


@dataclass
class ScaleSearch:
    scales: torch.Tensor  # [in], positive
    alpha: float | None  # None: the identity (no scaling) won
    error: float  # output MSE of the chosen scales
    identity_error: float  # output MSE of plain RTN (s = 1)
    errors: dict[float, float]  # α → output MSE, for every grid point


def search_scales(
    w: torch.Tensor,
    x_mean: torch.Tensor,
    gram: torch.Tensor | RoutedGram,
    scheme: WeightScheme,
    grid: int = 20,
    duo_scaling: bool = True,
    error_of: Callable[[torch.Tensor], float] | None = None,
) -> ScaleSearch:
    """Grid-search α for the Linears stacked in `w [out, in]` that read inputs with per-channel
    mean |x| `x_mean` and Gram `gram`; minimizes the output MSE of `Q(W·s)/s` vs `W` (or
    `error_of(s)` when given)."""
    w = w.float()
    w_mean = weight_mean(w, scheme.group_size) if duo_scaling else None

    def linear_error(s: torch.Tensor) -> float:
        return output_error(fake_quantize(w * s, scheme).div_(s).sub_(w), gram)

    error_of = error_of or linear_error

    ones = torch.ones_like(x_mean)
    identity_error = error_of(ones)
    best = (identity_error, None, ones)
    errors = {}
    for i in range(grid):
        alpha = i / grid
        s = candidate_scales(x_mean, w_mean, alpha)
        errors[alpha] = err = error_of(s)
        if err < best[0]:
            best = (err, alpha, s)
    return ScaleSearch(best[2], best[1], best[0], identity_error, errors)


def diagonal_blocks(gram: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """`[groups, G, G]` diagonal blocks of the Gram; a short tail group is zero-padded (the
    padded weight columns then contribute nothing to the error)."""
    in_f = gram.shape[0]
    g = in_f if group_size is None else group_size
    n = num_groups(in_f, group_size)
    padded = torch.zeros(n * g, n * g, dtype=gram.dtype, device=gram.device)
    padded[:in_f, :in_f] = gram
    blocks = padded.reshape(n, g, n, g).diagonal(dim1=0, dim2=2)  # [g, g, n]
    return blocks.permute(2, 0, 1).contiguous()


def clip_ranges(w: torch.Tensor, scheme: WeightScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """The unclipped quantization range per (row, group): min/max, or ±absmax if symmetric."""
    lo, hi = group_ranges(w, scheme.group_size)
    if scheme.symmetric:
        a = torch.maximum(lo.abs(), hi.abs())
        lo, hi = -a, a
    return lo, hi


def group_errors(d: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Per (group, row) output MSE `δ H_gg δᵀ` of `d [groups, out, G]`, shape `[groups, out]`."""
    return (torch.bmm(d, blocks) * d).sum(dim=-1)


def search_clip(
    w: torch.Tensor, gram: torch.Tensor, scheme: WeightScheme, grid: int = 20, max_shrink: float = 0.5
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (row, group) shrink of the quantization range, ratios from 1 down to
    `1 − max_shrink` in `grid` steps, minimizing that group's output error.

    Returns `(lo, hi, error, unclipped_error)`, each `[out, groups]`: the best range, and the
    measured per-group error with and without clipping (ratio 1 is a candidate, so
    `error ≤ unclipped_error` elementwise).
    """
    blocks = diagonal_blocks(gram, scheme.group_size)
    lo0, hi0 = clip_ranges(w, scheme)
    lo0, hi0 = lo0.T.unsqueeze(-1), hi0.T.unsqueeze(-1)  # [groups, out, 1]
    wg = grouped(w.float(), scheme.group_size).transpose(0, 1).contiguous()  # [groups, out, G]
    best_lo, best_hi = lo0.clone(), hi0.clone()
    best_err = unclipped = None
    for r in torch.linspace(1.0, 1.0 - max_shrink, grid).tolist():
        lo, hi = lo0 * r, hi0 * r
        clamped = torch.maximum(torch.minimum(wg, hi), lo) if r < 1 else wg
        err = group_errors(fake_quantize_groups(clamped, scheme, lo, hi).sub_(wg), blocks).unsqueeze(-1)
        if best_err is None:
            best_err, unclipped = err, err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_lo, best_hi = torch.where(better, lo, best_lo), torch.where(better, hi, best_hi)
    return tuple(t.squeeze(-1).T for t in (best_lo, best_hi, best_err, unclipped))


def apply_clip(w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """Clamp `w` in place to its per-(row, group) range; `quantize_weight` on the result then
    derives exactly the searched range (the extreme weight sits on the clamp bound)."""
    idx = (torch.arange(w.shape[1], device=w.device) // (w.shape[1] if group_size is None else group_size))
    return w.clamp_(lo[:, idx].to(w.dtype), hi[:, idx].to(w.dtype))


def producer_width(prev: nn.Module) -> int:
    """Channels a producer emits: a Linear's out_features, a norm's weight length."""
    return prev.weight.shape[0]


# --------------------------------------------------------------------------- observation


@dataclass
class InputStats:
    """What AWQ needs of one Linear input: mean |x| per channel and the Gram `XᵀX / T`."""

    abs_sum: torch.Tensor | None = None
    gram_sum: torch.Tensor | None = None
    tokens: int = 0  # rows in abs_sum
    sampled: int = 0  # rows in gram_sum

    def add(self, x: torch.Tensor, keep: torch.Tensor | None) -> None:
        """`keep`: the rows that enter the Gram (None: all of them)."""
        x = x.detach().reshape(-1, x.shape[-1]).float()
        sel = x if keep is None else x[keep]
        if self.abs_sum is None:
            self.abs_sum = torch.zeros(x.shape[1], device=x.device)
            self.gram_sum = torch.zeros(x.shape[1], x.shape[1], device=x.device)
        self.abs_sum += x.abs().sum(dim=0)
        self.gram_sum.addmm_(sel.T, sel)
        self.tokens += x.shape[0]
        self.sampled += sel.shape[0]

    @property
    def x_mean(self) -> torch.Tensor:
        return self.abs_sum / self.tokens

    @property
    def gram(self) -> torch.Tensor:
        return self.gram_sum / self.sampled

    def reduce(self, width: int, device: torch.device, tokens: int, sampled: int) -> None:
        """Sum every process's sums, given the summed counts (a process this input never
        reached, a MoE expert not routed to there, adds zeros of its `width`)."""
        if self.abs_sum is None:
            self.abs_sum = torch.zeros(width, device=device)
            self.gram_sum = torch.zeros(width, width, device=device)
        distributed.sum_(self.abs_sum)
        distributed.sum_(self.gram_sum)
        self.tokens, self.sampled = tokens, sampled

    def rescale(self, s: torch.Tensor) -> None:
        """The producer absorbed `1 / s`: the inputs are now `X / s`."""
        self.abs_sum = self.abs_sum / s
        self.gram_sum = scaled_gram(self.gram_sum, s)


def input_sites(spec: ArchSpec) -> dict[str, str]:
    """Linear → the Linear whose input it shares (the first of its input set)."""
    return {name: names[0] for names in spec.input_sets for name in names}


def pooled(stats: list[InputStats], rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | RoutedGram]:
    """Mean |x| and Gram of a scaling group whose Linears read different tokens of one producer
    (MoE experts): |x| pooled over every routed token, errors weighted by each one's tokens."""
    if len(stats) == 1:
        return stats[0].x_mean, stats[0].gram
    x_mean = sum(st.abs_sum for st in stats) / sum(st.tokens for st in stats)
    return x_mean, RoutedGram(rows, [st.gram for st in stats], [st.tokens for st in stats])


def token_subsample(
    sizes: list[int], max_tokens: int, generator: torch.Generator
) -> tuple[list[int], list[torch.Tensor]]:
    """Seeded choice of whole batches covering `max_tokens` tokens (each batch costs a layer
    forward), then of `max_tokens` token rows among them; returns the chosen batch indices
    and, per chosen batch, the row indices kept for the Gram."""
    order = torch.randperm(len(sizes), generator=generator).tolist()
    chosen, total = [], 0
    for i in order:
        if total >= max_tokens:
            break
        chosen.append(i)
        total += sizes[i]
    chosen.sort()
    keep = torch.randperm(total, generator=generator)[:max_tokens].sort().values
    rows, start = [], 0
    for i in chosen:
        mask = (keep >= start) & (keep < start + sizes[i])
        rows.append(keep[mask] - start)
        start += sizes[i]
    return chosen, rows


def collect_input_stats(
    ctx: LayerContext, sites: Iterable[str], max_tokens: int, seed: int
) -> dict[str, InputStats]:
    """Forward the layer over a seeded batch subsample with hooks on the site Linears. A MoE
    expert sees only the tokens routed to it (or none: its stats stay empty); all of those
    enter its Gram, as the batch's row sample does not index them."""
    sites = sorted(set(sites))
    sizes = [b.hidden.shape[0] * b.hidden.shape[1] for b in ctx.batches]
    chosen, rows = _local_subsample(sizes, max_tokens, torch.Generator().manual_seed(seed))
    stats = {name: InputStats() for name in sites}
    batch = -1

    def next_batch(_module: nn.Module, _args: tuple) -> None:
        nonlocal batch
        batch += 1

    def hook(name: str):
        def observe(_module: nn.Module, args: tuple, _output: Any) -> None:
            x = args[0]
            whole = x.numel() // x.shape[-1] == sizes[chosen[batch]]
            stats[name].add(x, rows[batch].to(x.device) if whole else None)
        return observe

    handles = [ctx.layer.register_forward_pre_hook(next_batch)]
    handles += [ctx.linear(name).register_forward_hook(hook(name)) for name in sites]
    try:
        dataclasses.replace(ctx, batches=[ctx.batches[i] for i in chosen]).forward()
    finally:
        for handle in handles:
            handle.remove()
    reduce_stats(ctx, stats)
    return stats


def _local_subsample(
    sizes: list[int], max_tokens: int, generator: torch.Generator
) -> tuple[list[int], list[torch.Tensor]]:
    """`token_subsample` of this process's batches: drawn over every process's batches in
    order (the single-process draw), keeping the chosen ones of this share, re-indexed."""
    if not distributed.current().active:
        return token_subsample(sizes, max_tokens, generator)
    everyone, offset = distributed.gather_list(sizes)
    chosen, rows = token_subsample(everyone, max_tokens, generator)
    mine = [(i - offset, r) for i, r in zip(chosen, rows) if offset <= i < offset + len(sizes)]
    return [i for i, _ in mine], [r for _, r in mine]


def reduce_stats(ctx: LayerContext, stats: dict[str, InputStats]) -> None:
    """Sum every process's statistics of each site; sums and counts, so the means are
    over every token."""
    if not distributed.current().active:
        return
    counts = distributed.sum_(torch.tensor([[st.tokens, st.sampled] for st in stats.values()], dtype=torch.int64))
    for (name, st), (tokens, sampled) in zip(stats.items(), counts.tolist()):
        if tokens:
            st.reduce(ctx.linear(name).weight.shape[1], ctx.device, tokens, sampled)


# --------------------------------------------------------------------------- engine adapter


@dataclass
class AWQ:
    """Engine adapter: per layer, observe once (a seeded subsample, seed = layer index), fold
    each scaling group's best scales, clip, and return the RTN codes of the result.

    Under several processes the statistics are reduced as they are collected, and every
    process then runs the same searches on them: the Gram searches are cheap next to the
    observation, the block objective's forwards are split over the shares anyway, and each
    scaling group depends on the folds before it, so spreading the groups would need a
    broadcast per group. Rank 0's resulting parameters are broadcast once per layer, so the
    weights are identical everywhere even where kernels are not bitwise deterministic.

    `records` keeps one entry per scaling group (chosen α — None when the identity won —,
    its error and plain RTN's, or why the group was skipped) and per clipped Linear.
    """

    scheme: WeightScheme
    grid: int = 20
    duo_scaling: bool = True
    clip: bool = True
    clip_grid: int = 20
    max_shrink: float = 0.5
    clip_skip: list[str] = field(default_factory=lambda: ["self_attn.q_proj", "self_attn.k_proj"])
    max_tokens: int = 8192
    ignore: list[str] = field(default_factory=list)
    # "block": the scales of a group fed by a norm (q/k/v, gate/up) are judged on the decoder
    # layer's output, as AutoAWQ judges them on the attention / MLP output, over the first
    # batches covering `block_tokens`; "linear": on the group's Linear outputs (Gram form).
    # MoE layers always use "linear" (their experts' routed Grams).
    objective: str = "linear"
    block_tokens: int = 2048
    records: list[dict[str, Any]] = field(default_factory=list)  # one per scaling group / clip

    def __post_init__(self) -> None:
        if self.scheme.type != "int" or self.scheme.per_tensor:
            raise ValueError(f"awq searches integer per-group/per-channel schemes, not {self.scheme.name}")

    def apply(self, ctx: LayerContext) -> dict[str, QuantizedWeight]:
        targets = self._targets(ctx)
        if not targets:
            return {}
        stats = self.scale_layer(ctx)
        if self.clip:
            site_of = input_sites(ctx.spec)
            for name in targets:
                if not any(fnmatch(name, p) for p in self.clip_skip):
                    self._clip(ctx, name, stats[site_of[name]])
        distributed.broadcast_parameters_(ctx.layer)
        return {name: quantize_weight(ctx.linear(name).weight.data, self.scheme) for name in targets}

    def scale_layer(self, ctx: LayerContext) -> dict[str, InputStats]:
        """Observe the layer once, then search and fold each scaling group's scales in spec
        order; returns the input statistics per site, rescaled to the folded layer."""
        site_of = input_sites(ctx.spec)
        stats = collect_input_stats(ctx, site_of.values(), self.max_tokens, seed=ctx.index)
        targets = self._targets(ctx)
        block = _BlockError.of(ctx, self.block_tokens) if self.objective == "block" and not ctx.spec.experts else None
        for group in ctx.spec.scaling:
            self._scale_group(ctx, group.prev, list(group.linears), targets, stats, site_of, block)
        return stats

    def _targets(self, ctx: LayerContext) -> list[str]:
        return [n for n in ctx.spec.linears if not is_ignored(ctx.full_name(n), self.ignore)]

    def _scale_group(
        self, ctx: LayerContext, prev_name: str, names: list[str], targets: list[str],
        stats: dict[str, InputStats], site_of: dict[str, str], block: "_BlockError | None" = None,
    ) -> None:
        record: dict[str, Any] = {"layer": ctx.index, "prev": prev_name, "linears": names}
        self.records.append(record)
        quantized = [n for n in names if n in targets]
        prev = _submodule(ctx.layer, prev_name)
        consumers = [ctx.linear(n) for n in names]
        if not quantized:
            record["skipped"] = "no quantized Linear in the group"
            return
        if prev is None or getattr(prev, "weight", None) is None:
            record["skipped"] = f"no module {prev_name!r} with a weight to absorb the scales"
            return
        width = producer_width(prev)
        mismatch = [f"{n} in {c.weight.shape[1]}" for n, c in zip(names, consumers) if c.weight.shape[1] != width]
        if mismatch:  # GQA: v_proj emits kv_heads·d channels, o_proj reads heads·d
            record["skipped"] = f"shape mismatch: {prev_name} out {width} ≠ {', '.join(mismatch)}"
            return
        # MoE: the group's experts read different tokens (one input site each); experts that
        # no calibration token reached are left out of the search but still absorb the scales.
        sites = [site for site in dict.fromkeys(site_of[n] for n in quantized) if stats[site].tokens]
        unreached = [n for n in quantized if not stats[site_of[n]].tokens]
        if unreached:
            record["no_tokens"] = unreached
            console.print(f"awq: {ctx.prefix}: no calibration tokens reached {', '.join(unreached)} "
                          "(MoE experts never routed to): scaled with the rest of the group, or not at all")
        if not sites:
            record["skipped"] = "no calibration tokens reached its Linears"
            return
        searched = [[n for n in quantized if site_of[n] == site] for site in sites]
        w = torch.cat([ctx.linear(n).weight.data.float() for part in searched for n in part], dim=0)
        rows = [sum(ctx.linear(n).weight.shape[0] for n in part) for part in searched]
        x_mean, gram = pooled([stats[site] for site in sites], rows)
        if block is not None and not isinstance(prev, nn.Linear):
            linears = [ctx.linear(n) for part in searched for n in part]
            found = search_scales(w, x_mean, gram, self.scheme, self.grid, self.duo_scaling,
                                  error_of=lambda s: block.error(linears, s, self.scheme))
        else:
            found = search_scales(w, x_mean, gram, self.scheme, self.grid, self.duo_scaling)
        record.update(alpha=found.alpha, error=found.error, identity_error=found.identity_error)
        if found.alpha is not None:
            ctx.spec.fold_scales(prev, consumers, found.scales)
            ctx.divided_outputs(prev_name, found.scales)
            for site in sites:
                stats[site].rescale(found.scales)

    def _clip(self, ctx: LayerContext, name: str, stats: InputStats) -> None:
        if not stats.sampled:  # a MoE expert no calibration token reached: plain min/max ranges
            self.records.append({"layer": ctx.index, "clip": name, "skipped": "no calibration tokens"})
            return
        weight = ctx.linear(name).weight.data
        lo, hi, err, unclipped = search_clip(weight, stats.gram, self.scheme, self.clip_grid, self.max_shrink)
        apply_clip(weight, lo, hi, self.scheme.group_size)
        self.records.append({"layer": ctx.index, "clip": name, "error": err.sum().item() / err.shape[0],
                             "unclipped_error": unclipped.sum().item() / err.shape[0]})


@dataclass
class _BlockError:
    """The decoder layer's output error when some Linears are fake-quantized with scales `s`
    (`Q(W·s)/s`: the function of the folded, quantized layer), against the float layer."""

    ctx: LayerContext
    batches: list[Any]
    reference: list[torch.Tensor]

    @classmethod
    def of(cls, ctx: LayerContext, tokens: int) -> "_BlockError":
        """Over the first batches covering `tokens` tokens (under several processes, the first
        of every process's batches in order: each process runs those of its share)."""
        sizes = (b.hidden.shape[0] * b.hidden.shape[1] for b in ctx.batches)
        if distributed.current().active:
            everyone, offset = distributed.gather_list(list(sizes))
            chosen = ctx.batches[: max(_covering(everyone, tokens) - offset, 0)]
        else:
            chosen = ctx.batches[: _covering(sizes, tokens)]
        view = dataclasses.replace(ctx, batches=chosen)
        return cls(view, chosen, view.forward())

    @torch.no_grad()
    def error(self, linears: list[nn.Linear], s: torch.Tensor, scheme: WeightScheme) -> float:
        saved = [lin.weight.data for lin in linears]
        try:
            for lin in linears:
                w = lin.weight.data.float()
                lin.weight.data = (fake_quantize(w * s, scheme) / s).to(lin.weight.dtype)
            outs = self.ctx.forward()
        finally:
            for lin, w in zip(linears, saved):
                lin.weight.data = w
        squared = sum(float((o.float() - r.float()).pow(2).sum()) for o, r in zip(outs, self.reference))
        count = sum(r.numel() for r in self.reference)
        if distributed.current().active:
            squared, count = distributed.sum_(torch.tensor([squared, count], dtype=torch.float64)).tolist()
        return squared / count


def _covering(sizes: Iterable[int], tokens: int) -> int:
    """How many leading batches of these token counts cover `tokens` tokens (reads no more)."""
    count, total = 0, 0
    for size in sizes:
        if total >= tokens:
            break
        count, total = count + 1, total + size
    return count


def _submodule(layer: nn.Module, name: str) -> nn.Module | None:
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None
