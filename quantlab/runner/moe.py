"""Routed experts in the runner: a mixture-of-experts MLP over per-expert gated MLPs.

The router stays in float (as quantization leaves it); each expert is an `MLP` whose Linears
are whatever backend its canonical weights call for. Tokens are grouped by expert and each
expert runs once on its tokens — the same routing and accumulation order as transformers'
eager experts loop, so the runner computes what the fake-quantized model computes.
"""

from __future__ import annotations

import torch
from torch import nn

from quantlab.models.moe import mix_experts
from quantlab.runner.config import MoEArgs
from quantlab.runner.model import MLP


class MoE(nn.Module):
    """`x [B, L, H]` → the routing-weighted sum of each token's top-k experts (plus Qwen2-MoE's
    gated shared expert)."""

    def __init__(self, args: MoEArgs, router: torch.Tensor, experts: list[MLP],
                 shared_expert: MLP | None = None, shared_expert_gate: nn.Module | None = None):
        super().__init__()
        self.args = args
        self.router = nn.Parameter(router, requires_grad=False)  # [experts, hidden]
        self.experts = nn.ModuleList(experts)
        self.shared_expert, self.shared_expert_gate = shared_expert, shared_expert_gate

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert indices and weights `[T, K]` of tokens `x [T, H]`: softmax in float32
        over the router logits, renormalized over the chosen experts when the family does."""
        probs = torch.softmax(nn.functional.linear(x, self.router), dim=-1, dtype=torch.float)
        weights, index = torch.topk(probs, self.args.top_k, dim=-1)
        if self.args.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return index, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        index, weights = self.route(x)
        out = mix_experts(x, index, weights, self.experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)
