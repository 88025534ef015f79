"""Unfuse mixture-of-experts blocks into per-expert Linears, so quantization sees Linears.

transformers (≥ 5) keeps a Mixtral / Qwen2-MoE / Qwen3-MoE layer's experts as two 3-D parameters
(`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`) and runs them through one fused kernel.
The engine, GPTQ, AWQ and the canonical form all work on `nn.Linear`s by name, and each
expert must be calibrated on the tokens the router sends it. `unfuse_experts` replaces each
fused experts module, in place, with `Experts`: one `ExpertMLP` per expert holding
`gate_proj`, `up_proj`, `down_proj` Linears (`mlp.experts.{e}.gate_proj`, …, the names of the
original per-expert checkpoints), whose forward is transformers' eager experts loop — the same
routing, the same per-expert arithmetic and accumulation order, so the model computes the
same function (bit for bit against the eager implementation, to float round-off against
grouped_mm). An expert that no token is routed to is not called, as in the original: hooks
on its Linears see exactly the tokens routed to it, or nothing.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
from torch import nn

from quantlab.engine import distributed
from quantlab.errors import UserError

# Fused experts classes with the layout unfused here: [gate; up] concatenated along the
# output dim, weights stored [out, in], no bias, act(gate) · up → down.
FUSED_EXPERTS = ("MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts")


class ExpertMLP(nn.Module):
    """One expert: `down(act(gate(x)) · up(x))`."""

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear, act_fn: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = gate_proj, up_proj, down_proj, act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.ModuleList):
    """Drop-in for a fused experts module: called as `experts(hidden [T, H], top_k_index [T, K],
    top_k_weights [T, K])`, returns the routing-weighted sum of each token's experts.

    `all_tokens` (calibration): every expert also runs on every token, so hooks on its Linears
    see all of them, while the output still takes only each token's routed experts (what
    llm-compressor calls calibrating all experts: no expert is left without statistics).
    `routed`, while set (`counting_routes`), accumulates the tokens routed to each expert."""

    all_tokens: bool = False
    routed: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.routed is not None:
            self.routed += torch.bincount(top_k_index.flatten().cpu(), minlength=len(self))
        return mix_experts(hidden_states, top_k_index, top_k_weights, self, self.all_tokens)


def mix_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                experts: Iterable[nn.Module], all_tokens: bool = False) -> torch.Tensor:
    """`Σ_k weight[t, k] · expert_{index[t, k]}(x[t])` for tokens `x [T, H]`: each expert runs
    once on the tokens routed to it (none: not called), accumulated in transformers' eager
    order (expert by expert, slot by slot within one). `all_tokens`: each expert runs on all
    of `x` and its routed rows are taken from that."""
    out = torch.zeros_like(x)
    routed = top_k_index.T  # [K, T]: (slot, token) pairs in the order the eager loop visits them
    for e, expert in enumerate(experts):
        slot, token = torch.where(routed == e)
        if all_tokens:
            y = expert(x)[token]
        elif token.numel() == 0:
            continue
        else:
            y = expert(x[token])
        out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
    return out


@contextmanager
def counting_routes(module: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Count the tokens routed to each expert of every `Experts` in `module` while inside; the
    yielded dict maps each experts module's name to its counts `[E]` on exit, summed over the
    calibration processes."""
    found = {name: m for name, m in module.named_modules() if isinstance(m, Experts)}
    counts: dict[str, torch.Tensor] = {}
    for m in found.values():
        m.routed = torch.zeros(len(m), dtype=torch.long)
    try:
        yield counts
    finally:
        for name, m in found.items():
            counts[name], m.routed = m.routed, None
    for c in counts.values():  # only once the block finished: every process reaches this
        distributed.sum_(c)


def calibrate_all_experts(model: nn.Module, on: bool) -> int:
    """Set `Experts.all_tokens` on every experts module; returns how many there are."""
    found = [m for m in model.modules() if isinstance(m, Experts)]
    for m in found:
        m.all_tokens = on
    return len(found)


def _linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free Linear owning a copy of `weight [out, in]` (a copy, not a view: the fused
    tensor is freed, and safetensors refuses tensors that share storage)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.detach().clone())
    return linear


def unfused(module: nn.Module) -> Experts:
    """The per-expert equivalent of one fused experts module."""
    layout = (getattr(module, "is_transposed", False), getattr(module, "is_concatenated", True),
              getattr(module, "has_bias", False), getattr(module, "has_gate", True))
    if layout != (False, True, False, True):
        raise UserError(f"model: {type(module).__name__} has an unexpected fused layout (transposed, concatenated, "
                        f"bias, gate) = {layout}; quantlab unfuses the transformers 5.x layout only")
    gate_up, down = module.gate_up_proj.detach(), module.down_proj.detach()
    inter = down.shape[-1]
    experts = Experts(ExpertMLP(_linear(gate_up[e, :inter]), _linear(gate_up[e, inter:]), _linear(down[e]),
                                module.act_fn) for e in range(gate_up.shape[0]))
    return experts.train(module.training)


def unfuse_experts(model: nn.Module) -> int:
    """Replace every fused experts module of `model` in place (one at a time, so peak memory
    grows by one layer's experts); returns how many were replaced (0 for dense models)."""
    fused = [name for name, module in model.named_modules() if type(module).__name__ in FUSED_EXPERTS]
    for name in fused:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, unfused(getattr(owner, child)))
    return len(fused)
