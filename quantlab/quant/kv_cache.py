"""Seeing and quantizing K and V where they enter attention (after RoPE, before GQA repeat).

We register one attention function with transformers' AttentionInterface: it calls an
optional per-module hook `quantlab_kv_hook(key, value) -> (key, value)` and then the stock
SDPA attention. Calibration hooks record per-head absmax; evaluation hooks fake-quantize with
the C8 scales, so perplexity reflects a deployed int8/fp8 KV cache.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from quantlab.quant.activations import fake_quant, scale_from_absmax

ATTN_IMPL = "quantlab_kv"
KVHook = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    hook = getattr(module, "quantlab_kv_hook", None)
    if hook is not None:
        key, value = hook(key, value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def enable(model: nn.Module) -> None:
    """Route the model's attention through `_attention` (SDPA numerics, plus our hook)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_IMPL, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPL, sdpa_mask)
    model.config._attn_implementation = ATTN_IMPL


def attention_modules(model_or_layer: nn.Module) -> list[nn.Module]:
    return [m for m in model_or_layer.modules() if hasattr(m, "k_proj") and hasattr(m, "v_proj")]


@dataclass
class KVRange:
    """Running per-KV-head absmax of K and V (shape `[kv_heads]`)."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    def update(self, key: torch.Tensor, value: torch.Tensor) -> None:
        k = key.detach().abs().float().amax(dim=(0, 2, 3))  # [b, kv_heads, L, d] → [kv_heads]
        v = value.detach().abs().float().amax(dim=(0, 2, 3))
        self.k = k if self.k is None else torch.maximum(self.k, k)
        self.v = v if self.v is None else torch.maximum(self.v, v)


@contextlib.contextmanager
def observe_kv(attn: nn.Module) -> Iterator[KVRange]:
    rng = KVRange()

    def hook(key: torch.Tensor, value: torch.Tensor):
        rng.update(key, value)
        return key, value

    attn.quantlab_kv_hook = hook
    try:
        yield rng
    finally:
        del attn.quantlab_kv_hook


def kv_fake_quant_hook(k_absmax: torch.Tensor, v_absmax: torch.Tensor, kind: str, per_head: bool) -> KVHook:
    """Fake-quantize K and V with static scales: per KV head, or the max over heads."""

    def scales(absmax: torch.Tensor) -> torch.Tensor:
        amax = absmax if per_head else absmax.max().expand_as(absmax)
        return scale_from_absmax(amax, kind).view(1, -1, 1, 1)

    k_scale, v_scale = scales(k_absmax), scales(v_absmax)

    def hook(key: torch.Tensor, value: torch.Tensor):
        return (fake_quant(key, k_scale.to(key.device), kind), fake_quant(value, v_scale.to(value.device), kind))

    return hook


@contextlib.contextmanager
def routed(module: nn.Module) -> Iterator[None]:
    """Route attention through `_attention` for the duration of the block, for a decoder layer
    run on its own (the engine calls layers directly, so no model-level mask is rebuilt)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPL, _attention)
    configs = {id(m.config): m.config for m in attention_modules(module)}
    previous = {key: cfg._attn_implementation for key, cfg in configs.items()}
    for cfg in configs.values():
        cfg._attn_implementation = ATTN_IMPL
    try:
        yield
    finally:
        for key, cfg in configs.items():
            cfg._attn_implementation = previous[key]
