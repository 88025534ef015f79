"""GPTQ (Frantar et al., 2022): quantize a Linear column by column, pushing each column's
rounding error onto the not-yet-quantized columns through the inverse input Hessian.

For a Linear with inputs X (n tokens × in), the layer-wise loss ||X Wᵀ − X Ŵᵀ||² has Hessian
`H = 2 X Xᵀ / n`. With `U` the upper Cholesky factor of H⁻¹, quantizing column j and
updating `W[:, j+1:] -= (w_j − q_j) / U[j,j] · U[j, j+1:]` is the optimal (OBS) correction;
doing it for blocks of columns with one matrix product per block ("lazy batch updates")
keeps the work in matmuls.

The algorithm is the pure function `gptq_quantize` (weight + Hessian → codes); `GPTQ` at the
bottom is the thin adapter to the sequential engine that observes a layer's Linear inputs,
builds one Hessian per distinct input (q/k/v share one, gate/up another) and writes the
fake-quantized weights back group by group (`true_sequential`). Under several calibration
processes (`quantlab.engine.distributed`) the Hessians are summed over the processes and each
group's solves are spread over them (`GPTQ._results`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar, Iterator

import torch

from quantlab.engine import distributed
from quantlab.engine.sequential import LayerContext, is_ignored
from quantlab.progress import console
from quantlab.quant.primitives import (
    QuantizedWeight,
    compute_qparams,
    mse_qparams,
    num_groups,
    quantize,
    quantize_column,
    quantize_weight,
)
from quantlab.quant.scheme import WeightScheme

MAX_DAMP_RETRIES = 4  # 10×, 100×, 1000×, 10⁴× the requested damping before giving up


class HessianError(RuntimeError):
    """H is not usable even with heavy damping (NaN/inf activations)."""


# --------------------------------------------------------------------------- Hessian


@dataclass
class HessianAccumulator:
    """Running `Σ x xᵀ` over tokens in fp32; `hessian()` gives `2 X Xᵀ / n`.

    Inputs are flattened to `[tokens, in]` and added with one matmul per batch, so the cost
    is one `in × in` GEMM per forward call, not per token.
    """

    sum: torch.Tensor | None = None
    tokens: int = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if self.sum is None:
            self.sum = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
        self.sum.addmm_(x.T, x)
        self.tokens += x.shape[0]

    def hessian(self, consume: bool = False) -> torch.Tensor:
        """`2 X Xᵀ / n`; with `consume`, computed in the running sum's own memory, which the
        accumulator then gives up (one in × in buffer fewer at the solve: 1.4 GB for a 7B
        down_proj)."""
        if self.sum is None or self.tokens == 0:
            raise HessianError("no calibration tokens reached this Linear")
        if not consume:
            return self.sum * (2.0 / self.tokens)
        h, self.sum = self.sum.mul_(2.0 / self.tokens), None
        return h


# --------------------------------------------------------------------------- algorithm


@dataclass
class GptqResult:
    weight: QuantizedWeight
    damp: float  # absolute damping added to diag(H) in the end
    retries: int  # Cholesky failures before `damp` worked
    loss: float  # Σ (w − q)² / (2 U[j,j]²): GPTQ's own estimate of the added layer loss


def inverse_hessian_cholesky(
    h: torch.Tensor, damp_percent: float, max_retries: int = MAX_DAMP_RETRIES
) -> tuple[torch.Tensor, float, int]:
    """Upper Cholesky factor U of `(H + λI)⁻¹` (so `(H + λI)⁻¹ = Uᵀ U`), λ = damp_percent ·
    mean(diag H).

    Computed without forming the inverse: with J the index reversal and `J H J = L Lᵀ`,
    `U = J L⁻¹ J` — one Cholesky and one triangular solve (several times faster on CPU than
    cholesky_inverse + a second Cholesky, and nothing left to fail after the first).
    A factorization that fails (H numerically indefinite: few tokens, fp32 round-off) is
    retried with 10× more damping, up to `max_retries` times; returns (U, λ, retries).
    """
    mean_diag = torch.diagonal(h).mean().item()
    if not torch.isfinite(h).all() or mean_diag <= 0:
        raise HessianError(f"Hessian has non-finite entries or zero diagonal (mean diag {mean_diag})")
    # Damping is written into the diagonal of one flipped copy (from the saved undamped
    # diagonal, so every retry adds to the same values), and each buffer is dropped as soon as
    # the next exists: at most three in × in buffers besides `h` live at once.
    flipped = h.flip(0, 1)
    diagonal = torch.diagonal(flipped)
    undamped = diagonal.clone()
    for retry in range(max_retries + 1):
        damp = damp_percent * 10**retry * mean_diag
        diagonal.copy_(undamped + damp)
        lower, info = torch.linalg.cholesky_ex(flipped)
        if info.item() == 0:
            del flipped, diagonal
            eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
            u = torch.linalg.solve_triangular(lower, eye, upper=False)
            del lower, eye
            return u.flip(0, 1), damp, retry
        del lower
    raise HessianError(f"Cholesky failed even with damping {damp:.3g} ({max_retries} retries)")


def gptq_quantize(
    w: torch.Tensor,
    h: torch.Tensor,
    scheme: WeightScheme,
    *,
    damp_percent: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    static_groups: bool = False,
    mse_clip: bool = False,
    max_retries: int = MAX_DAMP_RETRIES,
    owns_h: bool = False,
) -> GptqResult:
    """Quantize `w [out, in]` against the input Hessian `h [in, in]`.

    act_order visits columns by descending diag(H) (most active inputs first, while most
    columns are still free to absorb their error). Groups are contiguous in the visiting
    order, so `g_idx` (reported in the original column order) is not `i // G` then —
    unless `static_groups`, where every group's qparams come from the unmodified weight up
    front and `g_idx` stays `i // G` (cheaper kernels, slightly worse error).
    `owns_h`: `h` is the caller's to give up (a consumed accumulator's): it is modified in place
    rather than copied.
    `mse_clip` chooses each group's range by a shrink search (`mse_qparams`) instead of its
    min/max: an outlier then costs its own rounding error, not every other weight's resolution.
    """
    if scheme.type != "int" or scheme.per_tensor:
        raise ValueError(f"gptq encodes integer per-group/per-channel weights, not {scheme.name}")
    out_f, in_f = w.shape
    bits, sym = scheme.bits, scheme.symmetric
    size = in_f if scheme.group_size is None else scheme.group_size
    # Work on Wᵀ: column j of W is row j here, so every update touches contiguous memory.
    wt = w.detach().float().T.contiguous()
    h = h.detach().float() if owns_h else h.detach().float().clone()

    dead = torch.diagonal(h) == 0  # inputs that were always zero: nothing to fit
    h[dead, dead] = 1.0
    wt[dead] = 0.0

    if static_groups:
        st, zt = _static_qparams(wt, size, bits, sym, mse_clip)
    else:
        st = torch.zeros(num_groups(in_f, scheme.group_size), out_f, device=w.device)
        zt = torch.zeros_like(st)

    perm = torch.argsort(torch.diagonal(h), descending=True) if act_order else None
    if perm is not None:
        wt, h = wt[perm], h[perm][:, perm]
    order = perm if perm is not None else torch.arange(in_f, device=w.device)
    # Group of the column visited at each position: static groups follow the original
    # column, dynamic groups are contiguous runs of the visiting order.
    visit_group = (order if static_groups else torch.arange(in_f, device=w.device)) // size

    u, damp, retries = inverse_hessian_cholesky(h, damp_percent, max_retries)
    sweep = _Sweep(wt, u, st, zt, visit_group.tolist(), size, bits, sym, dynamic=not static_groups,
                   mse_clip=mse_clip)
    with _single_threaded(wt.device):
        qt, loss = sweep.run(block_size)
    g_idx = visit_group
    if perm is not None:
        inverse = torch.argsort(perm)
        qt, g_idx = qt[inverse], visit_group[inverse]
    g_idx = g_idx.to(torch.int32)
    scales, zeros = st.T.contiguous(), zt.T.contiguous()
    codes = quantize(qt.T, scales, zeros, g_idx, bits)  # exact: q is (code − zero) · scale
    qw = QuantizedWeight(codes, scales, zeros.to(torch.uint8), g_idx, scheme)
    return GptqResult(qw, damp, retries, loss)


def _qparams(span: torch.Tensor, bits: int, sym: bool, mse_clip: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero per output for `span [..., columns of one group, out]`."""
    if mse_clip:
        return mse_qparams(span, bits, sym)
    return compute_qparams(span.amin(-2), span.amax(-2), bits, sym)


def _static_qparams(wt: torch.Tensor, size: int, bits: int, sym: bool,
                    mse_clip: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every group's qparams `[groups, out]` from the unmodified `wt [in, out]`. On a GPU all
    full groups go through one call (kernel launches are the cost there: the clipping search
    is a few dozen launches per call); on the CPU one group at a time stays in cache."""
    in_f, out_f = wt.shape
    full = in_f - in_f % size
    spans = [wt[start : start + size] for start in range(0, in_f, size)]
    if wt.device.type != "cpu" and full:
        spans = [wt[:full].view(-1, size, out_f), *spans[full // size:]]
    parts = [_qparams(span, bits, sym, mse_clip) for span in spans]
    return (torch.cat([s.view(-1, out_f) for s, _ in parts]), torch.cat([z.view(-1, out_f) for _, z in parts]))


@contextmanager
def _single_threaded(device: torch.device) -> Iterator[None]:
    """The sweep is thousands of tiny ops on one column each. On CPU, intra-op threads only
    add fork/join cost to those, and under load a worker that is not scheduled stalls every
    op (torch.round on 3k floats: 30 µs on one thread, 16 ms on two on a busy machine)."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


SUB_BLOCK = 16  # columns whose updates are applied one by one; larger spans go through GEMMs


@dataclass
class _Sweep:
    """The column sweep over `wt = Wᵀ [in, out]` in visiting order, in place.

    Lazy batch updates at two levels: inside a sub-block of ≤16 columns each quantized
    column updates the rest of its sub-block (rank-1); a finished sub-block updates the rest
    of its block, and a finished block everything after it, each with one GEMM. This is the
    same arithmetic as the one-level scheme, reordered, but it keeps the per-column work tiny
    (the one-level rank-1 update over a 128-column block dominated on CPU). Sub-blocks start
    at multiples of the group size's divisor `sub`, so every group starts a sub-block.
    """

    wt: torch.Tensor
    u: torch.Tensor
    st: torch.Tensor  # scales [groups, out], filled here for dynamic groups
    zt: torch.Tensor  # zeros  [groups, out]
    visit_group: list[int]
    size: int
    bits: int
    sym: bool
    dynamic: bool
    mse_clip: bool = False

    def run(self, block_size: int) -> tuple[torch.Tensor, float]:
        n = self.wt.shape[0]
        self.qt = torch.empty_like(self.wt)
        self.errt = torch.empty_like(self.wt)  # (w − q) / U[j,j] per visited column
        self.diag = torch.diagonal(self.u).tolist()
        sub = min(SUB_BLOCK, self.size)
        wt, u, errt = self.wt, self.u, self.errt
        for b1 in range(0, n, block_size):
            b2 = min(b1 + block_size, n)
            cuts = sorted({b1, b2, *range((b1 // sub + 1) * sub, b2, sub)})
            for s1, s2 in zip(cuts, cuts[1:]):
                for col in range(s1, s2):
                    self._column(col, s2, b1, b2)
                if s2 < b2:
                    wt[s2:b2].addmm_(u[s1:s2, s2:b2].T, errt[s1:s2], alpha=-1.0)
            if b2 < n:
                wt[b2:].addmm_(u[b1:b2, b2:].T, errt[b1:b2], alpha=-1.0)
        return self.qt, 0.5 * errt.pow(2).sum().item()

    def _column(self, col: int, s2: int, b1: int, b2: int) -> None:
        g = self.visit_group[col]
        if self.dynamic and col % self.size == 0:
            self._group_qparams(g, col, b1, b2)
        row = self.wt[col]
        q = quantize_column(row, self.st[g], self.zt[g], self.bits)
        self.qt[col] = q
        e = self.errt[col]
        torch.sub(row, q, out=e).div_(self.diag[col])
        if col + 1 < s2:
            self.wt[col + 1 : s2].addr_(self.u[col, col + 1 : s2], e, alpha=-1.0)

    def _group_qparams(self, g: int, col: int, b1: int, b2: int) -> None:
        """qparams of the group starting at `col` from its current (error-updated) values.
        `col` starts a sub-block, so the rest of the block is current; columns past the
        block still lack this block's pending update, applied here when the group reaches
        them (group larger than what is left of the block)."""
        end = min(col + self.size, self.wt.shape[0])
        span = self.wt[col : min(end, b2)]
        if end > b2:
            beyond = self.wt[b2:end] - self.u[b1:col, b2:end].T @ self.errt[b1:col]
            span = torch.cat([span, beyond])
        self.st[g], self.zt[g] = _qparams(span, self.bits, self.sym, self.mse_clip)


# --------------------------------------------------------------------------- engine adapter


class _Stop(Exception):
    """Raised from a hook once every observed input of a layer pass is recorded."""


@dataclass
class _Entry:
    """Where a pass over the layer starts: a module and its per-batch call arguments."""

    module: torch.nn.Module
    calls: list[tuple[tuple, dict]]


def _observe(
    ctx: LayerContext, names: list[str], watch: dict[str, HessianAccumulator],
    entry: _Entry | None = None, record: torch.nn.Module | None = None,
) -> _Entry | None:
    """Run the layer over every calibration batch, accumulating the input Hessian of each
    watched Linear. Each pass stops as soon as all of them have seen their input (the rest
    of the layer cannot change them), which skips most of the layer for early groups.

    `entry` starts the pass at a submodule with inputs recorded earlier instead of at the
    layer; `record` is the submodule to record inputs of for the next pass. A recording is
    only valid if the module was entered before any Linear in `names` ran (its inputs do
    not depend on the weights about to change), on every batch; otherwise None.
    """
    seen: set[str] = set()
    started = False
    recorded: _Entry | None = _Entry(record, []) if record is not None else None

    def on_linear(name: str):
        def hook(_module: torch.nn.Module, args: tuple) -> None:
            nonlocal started
            started = True
            if name in watch:
                watch[name].add(args[0])
                seen.add(name)
                if len(seen) == len(watch):
                    raise _Stop

        return hook

    def on_record(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        nonlocal recorded
        if recorded is not None and started:
            recorded = None
        if recorded is not None:
            recorded.calls.append((args, kwargs))

    handles = [ctx.linear(n).register_forward_pre_hook(on_linear(n)) for n in names]
    if record is not None:
        handles.append(record.register_forward_pre_hook(on_record, with_kwargs=True))
    module = entry.module if entry else ctx.layer
    calls = entry.calls if entry else [((b.hidden,), b.kwargs) for b in ctx.batches]
    try:
        with torch.no_grad():
            for args, kwargs in calls:
                seen.clear()
                started = False
                try:
                    module(*args, **kwargs)
                except _Stop:
                    pass
    finally:
        for handle in handles:
            handle.remove()
    return recorded if recorded is not None and len(recorded.calls) == len(calls) else None


def common_parent(names: list[str]) -> str:
    """Deepest module containing all `names` (`mlp` for gate/up/down); "" for the layer."""
    parts = [n.split(".")[:-1] for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)


def shared_inputs(ctx: LayerContext, names: list[str]) -> list[list[str]]:
    """Partition `names` into sets of Linears that read the same tensor (the ArchSpec's
    input sets: q/k/v after the input norm, gate/up of one MLP or one MoE expert)."""
    return [members for s in ctx.spec.input_sets if (members := [n for n in s if n in names])]


@dataclass
class GPTQ:
    # writes each Linear's rounding into its weight as it goes (later Linears of the layer see
    # it): the engine reads the weights GPTQ started from as the float weights before rounding
    rounds_in_place: ClassVar[bool] = True
    scheme: WeightScheme
    damp_percent: float = 0.01
    block_size: int = 128
    act_order: bool = False
    static_groups: bool = False
    true_sequential: bool = True
    mse_clip: bool = False
    ignore: list[str] = field(default_factory=list)
    # per full Linear name: damp, retries, loss, tokens (0: none reached it, RTN fallback)
    stats: dict[str, dict[str, float]] = field(default_factory=dict)

    def apply(self, ctx: LayerContext) -> dict[str, QuantizedWeight]:
        targets = [n for n in ctx.spec.linears if not is_ignored(ctx.full_name(n), self.ignore)]
        groups = ctx.spec.sequential if self.true_sequential else (ctx.spec.linears,)
        plan = [names for group in groups if (names := [n for n in group if n in targets])]
        result: dict[str, QuantizedWeight] = {}
        entry: _Entry | None = None
        for i, names in enumerate(plan):
            # A pass may record the inputs of the module holding the next group (the MLP
            # while observing gate/up) so the next pass starts there, not at the layer.
            parent = common_parent(plan[i + 1]) if i + 1 < len(plan) else ""
            sets = shared_inputs(ctx, names)
            watch = {s[0]: HessianAccumulator() for s in sets}
            entry = _observe(ctx, names, watch, entry, ctx.layer.get_submodule(parent) if parent else None)
            reduce_hessians(ctx, watch)
            result.update(self._quantize_group(ctx, sets, watch))
        return result

    def _quantize_group(self, ctx: LayerContext, sets: list[list[str]],
                        watch: dict[str, HessianAccumulator]) -> dict[str, QuantizedWeight]:
        """Quantize the input sets of one true-sequential group and write each back."""
        results = self._results(ctx, [members for members in sets if watch[members[0]].tokens], watch)
        out: dict[str, QuantizedWeight] = {}
        for members in sets:
            tokens = watch[members[0]].tokens
            if tokens == 0:  # a MoE expert the router never chose
                out.update(self._rtn_fallback(ctx, members))
            else:
                out.update(self._write_back(ctx, members, next(results), tokens))
        return out

    def _results(self, ctx: LayerContext, solved: list[list[str]],
                 watch: dict[str, HessianAccumulator]) -> Iterator[GptqResult]:
        """The GPTQ result of each set in `solved`, in order. A single process solves each as
        it is asked for. Under several processes the sets go round-robin (the i-th to rank
        i % size), each process solves its own first, then every result is broadcast from its
        solver, so every process writes the same weights back before the next group observes
        (the sets of a group are independent: each solve reads only its own Linears)."""
        world = distributed.current()
        if not world.active:
            for members in solved:
                yield self._solve(ctx, members, watch[members[0]])
            return
        mine = {i: self._solve(ctx, members, watch[members[0]])
                for i, members in enumerate(solved) if i % world.size == world.rank}
        yield from _spread(mine, len(solved), self.scheme, ctx.device)

    def _rtn_fallback(self, ctx: LayerContext, names: list[str]) -> dict[str, QuantizedWeight]:
        """Linears no calibration token reached have no Hessian: round them to nearest, and say so."""
        console.print(f"gptq: {_label(ctx, names)}: no calibration tokens reached it "
                      "(MoE expert never routed to); quantized with RTN")
        out = {}
        for name in names:
            lin = ctx.linear(name)
            out[name] = qw = quantize_weight(lin.weight.data, self.scheme)
            lin.weight.data.copy_(qw.dequantize().to(lin.weight.dtype))
            self.stats[ctx.full_name(name)] = {"tokens": 0}
        return out

    def _solve(self, ctx: LayerContext, names: list[str], acc: HessianAccumulator) -> GptqResult:
        """One GPTQ run over the row-concatenation of Linears sharing H (rows are
        independent given H, so this equals quantizing each alone, with one column loop). The
        accumulator is consumed: the solve works in its memory."""
        w = torch.cat([ctx.linear(n).weight.data for n in names], dim=0)
        label = _label(ctx, names)
        try:
            res = gptq_quantize(w, acc.hessian(consume=True), self.scheme, damp_percent=self.damp_percent,
                                block_size=self.block_size, act_order=self.act_order,
                                static_groups=self.static_groups, mse_clip=self.mse_clip, owns_h=True)
        except HessianError as exc:
            raise HessianError(f"gptq: {label}: {exc}") from None
        if res.retries:
            console.print(f"gptq: {label}: Cholesky failed; damping raised {10**res.retries}× to {res.damp:.3g}")
        return res

    def _write_back(self, ctx: LayerContext, names: list[str], res: GptqResult,
                    tokens: int) -> dict[str, QuantizedWeight]:
        """Split a set's result per Linear and write its fake-quantized weights back (the next
        groups observe the layer as it will be deployed)."""
        linears = [ctx.linear(n) for n in names]
        rows = [lin.weight.shape[0] for lin in linears]
        out = {}
        for name, lin, qw in zip(names, linears, _split_rows(res.weight, rows)):
            lin.weight.data.copy_(qw.dequantize().to(lin.weight.dtype))
            out[name] = qw
            self.stats[ctx.full_name(name)] = {"damp": res.damp, "retries": res.retries, "loss": res.loss,
                                                  "tokens": tokens}
        return out


def reduce_hessians(ctx: LayerContext, watch: dict[str, HessianAccumulator]) -> None:
    """Sum every process's Hessian sums and token counts; a Linear that no token of this
    process reached (a MoE expert) adds zeros of its input width."""
    if not distributed.current().active:
        return
    tokens = distributed.sum_(torch.tensor([acc.tokens for acc in watch.values()], dtype=torch.int64))
    for (name, acc), total in zip(watch.items(), tokens.tolist()):
        acc.tokens = total
        if total:
            width = ctx.linear(name).weight.shape[1]
            if acc.sum is None:
                acc.sum = torch.zeros(width, width, dtype=torch.float32, device=ctx.device)
            distributed.sum_(acc.sum)


def _spread(mine: dict[int, GptqResult], count: int, scheme: WeightScheme,
            device: torch.device) -> Iterator[GptqResult]:
    """All `count` results of a group, one at a time, on every process, the i-th solved by rank
    i % size (`mine`: this process's, given up as they go): shapes, dtypes and stats travel in
    one gather per group, the tensors by broadcast from their solver."""
    world = distributed.current()
    meta = {i: m for part in distributed.all_gather_object({i: _meta(r) for i, r in mine.items()})
            for i, m in part.items()}
    for i in range(count):
        res = mine.pop(i) if i in mine else _empty_result(meta[i], scheme, device)
        for t in _tensors(res.weight):
            distributed.broadcast_(t, src=i % world.size)
        yield res


def _tensors(qw: QuantizedWeight) -> tuple[torch.Tensor, ...]:
    return qw.codes, qw.scales, qw.zeros, qw.g_idx


def _meta(res: GptqResult) -> tuple[list[tuple[tuple[int, ...], torch.dtype]], float, int, float]:
    return [(tuple(t.shape), t.dtype) for t in _tensors(res.weight)], res.damp, res.retries, res.loss


def _empty_result(meta: tuple, scheme: WeightScheme, device: torch.device) -> GptqResult:
    """A result of the solver's shapes to receive its broadcast into."""
    shapes, damp, retries, loss = meta
    tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes]
    return GptqResult(QuantizedWeight(*tensors, scheme), damp, retries, loss)


def _label(ctx: LayerContext, names: list[str]) -> str:
    """`model.layers.3.mlp.experts.5.gate_proj+up_proj` for log lines."""
    parent = ".".join(filter(None, (ctx.prefix, common_parent(names))))
    return f"{parent}.{'+'.join(n.rsplit('.', 1)[-1] for n in names)}"


def _split_rows(qw: QuantizedWeight, rows: list[int]) -> list[QuantizedWeight]:
    parts = zip(qw.codes.split(rows), qw.scales.split(rows), qw.zeros.split(rows))
    return [QuantizedWeight(c.contiguous(), s.contiguous(), z.contiguous(), qw.g_idx.clone(), qw.scheme)
            for c, s, z in parts]
