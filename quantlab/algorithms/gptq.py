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
fake-quantized weights back group by group (`true_sequential`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantlab.engine.sequential import LayerContext, is_ignored
from quantlab.progress import console
from quantlab.quant.primitives import (
    QuantizedWeight,
    compute_qparams,
    group_ranges,
    num_groups,
    quantize,
    quantize_column,
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

    def hessian(self) -> torch.Tensor:
        if self.sum is None or self.tokens == 0:
            raise HessianError("no calibration tokens reached this Linear")
        return self.sum * (2.0 / self.tokens)


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
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    flipped = h.flip(0, 1)
    for retry in range(max_retries + 1):
        damp = damp_percent * 10**retry * mean_diag
        lower, info = torch.linalg.cholesky_ex(flipped + damp * eye)
        if info.item() == 0:
            return torch.linalg.solve_triangular(lower, eye, upper=False).flip(0, 1), damp, retry
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
    max_retries: int = MAX_DAMP_RETRIES,
) -> GptqResult:
    """Quantize `w [out, in]` against the input Hessian `h [in, in]`.

    act_order visits columns by descending diag(H) (most active inputs first, while most
    columns are still free to absorb their error). Groups are contiguous in the visiting
    order, so `g_idx` (reported in the original column order) is not `i // G` then —
    unless `static_groups`, where every group's qparams come from the unmodified weight up
    front and `g_idx` stays `i // G` (cheaper kernels, slightly worse error).
    """
    if scheme.type != "int" or scheme.per_tensor:
        raise ValueError(f"gptq encodes integer per-group/per-channel weights, not {scheme.name}")
    out_f, in_f = w.shape
    bits, sym = scheme.bits, scheme.symmetric
    size = in_f if scheme.group_size is None else scheme.group_size
    w = w.detach().float().clone()
    h = h.detach().float().clone()

    dead = torch.diagonal(h) == 0  # inputs that were always zero: nothing to fit
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    if static_groups:
        scales, zeros = compute_qparams(*group_ranges(w, scheme.group_size), bits, sym)
    else:
        scales = torch.zeros(out_f, num_groups(in_f, scheme.group_size), device=w.device)
        zeros = torch.zeros_like(scales)

    perm = torch.argsort(torch.diagonal(h), descending=True) if act_order else None
    if perm is not None:
        w, h = w[:, perm], h[perm][:, perm]
    order = perm if perm is not None else torch.arange(in_f, device=w.device)
    # Group of the column visited at each position: static groups follow the original
    # column, dynamic groups are contiguous runs of the visiting order.
    visit_group = (order if static_groups else torch.arange(in_f, device=w.device)) // size

    u, damp, retries = inverse_hessian_cholesky(h, damp_percent, max_retries)
    q, loss = _gptq_blocks(w, u, scales, zeros, visit_group.tolist(), size, bits, sym, block_size,
                           dynamic=not static_groups)
    g_idx = visit_group
    if perm is not None:
        inverse = torch.argsort(perm)
        q, g_idx = q[:, inverse], visit_group[inverse]
    g_idx = g_idx.to(torch.int32)
    codes = quantize(q, scales, zeros, g_idx, bits)  # exact: q is (code − zero) · scale
    qw = QuantizedWeight(codes, scales, zeros.to(torch.uint8), g_idx, scheme)
    return GptqResult(qw, damp, retries, loss)


def _gptq_blocks(
    w: torch.Tensor, u: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    visit_group: list[int], size: int, bits: int, sym: bool, block_size: int, dynamic: bool,
) -> tuple[torch.Tensor, float]:
    """The column sweep (in visiting order). Fills `scales`/`zeros` in place for dynamic
    groups; returns the fake-quantized weight and the loss estimate."""
    in_f = w.shape[1]
    q = torch.empty_like(w)
    loss = 0.0
    for b1 in range(0, in_f, block_size):
        b2 = min(b1 + block_size, in_f)
        w1 = w[:, b1:b2].clone()
        err = torch.empty_like(w1)
        u1 = u[b1:b2, b1:b2]
        for i in range(b2 - b1):
            col = b1 + i
            g = visit_group[col]
            if dynamic and col % size == 0:
                # qparams from the group's current (error-updated) values: the rest of this
                # block from w1; columns past the block still lack this block's pending
                # update, so apply it to them here (only when a group straddles blocks).
                span = w1[:, i : i + size]
                if col + size > b2:
                    beyond = w[:, b2 : col + size] - err[:, :i] @ u[b1:col, b2 : col + size]
                    span = torch.cat([span, beyond], dim=1)
                scales[:, g], zeros[:, g] = compute_qparams(span.amin(1), span.amax(1), bits, sym)
            column = w1[:, i]
            qcol = quantize_column(column, scales[:, g], zeros[:, g], bits)
            q[:, col] = qcol
            e = (column - qcol) / u1[i, i]
            err[:, i] = e
            w1[:, i + 1 :].addr_(e, u1[i, i + 1 :], alpha=-1.0)
        w[:, b2:].addmm_(err, u[b1:b2, b2:], alpha=-1.0)
        loss += 0.5 * err.pow(2).sum().item()
    return q, loss


# --------------------------------------------------------------------------- engine adapter


class _Stop(Exception):
    """Raised from a hook once every observed input of a layer pass is recorded."""


def _observe(ctx: LayerContext, watch: dict[str, HessianAccumulator]) -> None:
    """Run the layer over every calibration batch, accumulating the input Hessian of each
    watched Linear; each pass stops as soon as all of them have seen their input (the rest
    of the layer cannot change them), which skips most of the MLP for early groups."""
    seen: set[str] = set()

    def hook_for(name: str):
        def hook(_module: torch.nn.Module, args: tuple) -> None:
            watch[name].add(args[0])
            seen.add(name)
            if len(seen) == len(watch):
                raise _Stop

        return hook

    handles = [ctx.linear(n).register_forward_pre_hook(hook_for(n)) for n in watch]
    try:
        with torch.no_grad():
            for b in ctx.batches:
                seen.clear()
                try:
                    ctx.layer(b.hidden, **b.kwargs)
                except _Stop:
                    pass
    finally:
        for handle in handles:
            handle.remove()


def shared_inputs(ctx: LayerContext, names: list[str]) -> list[list[str]]:
    """Partition `names` into sets of Linears that read the same tensor (the ArchSpec's
    scaling groups: q/k/v after the input norm, gate/up after the post-attention norm)."""
    sets: list[list[str]] = []
    for group in ctx.spec.scaling:
        members = [n for n in group.linears if n in names]
        if members:
            sets.append(members)
    covered = {n for s in sets for n in s}
    return sets + [[n] for n in names if n not in covered]


@dataclass
class GPTQ:
    scheme: WeightScheme
    damp_percent: float = 0.01
    block_size: int = 128
    act_order: bool = False
    static_groups: bool = False
    true_sequential: bool = True
    ignore: list[str] = field(default_factory=list)
    stats: dict[str, dict[str, float]] = field(default_factory=dict)  # per full Linear name

    def apply(self, ctx: LayerContext) -> dict[str, QuantizedWeight]:
        targets = [n for n in ctx.spec.linears if not is_ignored(f"{ctx.prefix}.{n}", self.ignore)]
        groups = ctx.spec.sequential if self.true_sequential else (ctx.spec.linears,)
        result: dict[str, QuantizedWeight] = {}
        for group in groups:
            names = [n for n in group if n in targets]
            if not names:
                continue
            sets = shared_inputs(ctx, names)
            watch = {s[0]: HessianAccumulator() for s in sets}
            _observe(ctx, watch)
            for members in sets:
                result.update(self._quantize_set(ctx, members, watch[members[0]].hessian()))
        return result

    def _quantize_set(self, ctx: LayerContext, names: list[str], h: torch.Tensor) -> dict[str, QuantizedWeight]:
        """One GPTQ run over the row-concatenation of Linears sharing H (rows are
        independent given H, so this equals quantizing each alone, with one column loop)."""
        linears = [ctx.linear(n) for n in names]
        rows = [lin.weight.shape[0] for lin in linears]
        w = torch.cat([lin.weight.data for lin in linears], dim=0)
        label = f"{ctx.prefix}.{'+'.join(n.rsplit('.', 1)[-1] for n in names)}"
        try:
            res = gptq_quantize(w, h, self.scheme, damp_percent=self.damp_percent, block_size=self.block_size,
                                act_order=self.act_order, static_groups=self.static_groups)
        except HessianError as exc:
            raise HessianError(f"gptq: {label}: {exc}") from None
        if res.retries:
            console.print(f"gptq: {label}: Cholesky failed; damping raised {10**res.retries}× to {res.damp:.3g}")
        out = {}
        for name, lin, qw in zip(names, linears, _split_rows(res.weight, rows)):
            lin.weight.data.copy_(qw.dequantize().to(lin.weight.dtype))  # later groups see it
            out[name] = qw
            self.stats[f"{ctx.prefix}.{name}"] = {"damp": res.damp, "retries": res.retries, "loss": res.loss}
        return out


def _split_rows(qw: QuantizedWeight, rows: list[int]) -> list[QuantizedWeight]:
    parts = zip(qw.codes.split(rows), qw.scales.split(rows), qw.zeros.split(rows))
    return [QuantizedWeight(c.contiguous(), s.contiguous(), z.contiguous(), qw.g_idx.clone(), qw.scheme)
            for c, s, z in parts]
