"""Make a dequantized model compute with deployed activation and KV-cache numerics.

Weights are already fake-quantized by `load_fake_quant_model`; this adds the rest of A8W8 /
FP8 / C8 from the canonical form: a forward pre-hook on every Linear listed under
`activations` quantizes its input (per token on the fly, or per tensor with the calibrated
absmax or an on-the-fly one), and K/V are quantized with their static per-head (or
per-tensor) scales where they enter attention (`kv_cache.enable` routes attention through a
hook point after RoPE). Perplexity measured this way reflects what the int8/fp8 kernels compute
(up to accumulation order), not just the weight rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantlab.quant import kv_cache
from quantlab.quant.activations import fake_quant_activation
from quantlab.quant.canonical import input_absmax_key, kv_absmax_keys, load_quant_config, load_scales
from quantlab.quant.scheme import ActivationScheme, KVCacheScheme, scheme_from_entry


@dataclass
class FakeQuantHandles:
    """What `apply_fake_quant` attached; `remove()` restores float activations and K/V."""

    hooks: list[Any] = field(default_factory=list)
    attentions: list[nn.Module] = field(default_factory=list)

    @property
    def linears(self) -> int:
        return len(self.hooks)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        for attn in self.attentions:
            del attn.quantlab_kv_hook
        self.hooks, self.attentions = [], []


def quantize_inputs(linear: nn.Module, scheme: ActivationScheme, absmax: torch.Tensor | None) -> Any:
    """Attach input fake quantization to one Linear; returns the hook handle."""

    def hook(_m: nn.Module, args: tuple) -> tuple:
        x = args[0]
        amax = None if absmax is None else absmax.to(x.device)
        return (fake_quant_activation(x, scheme, amax), *args[1:])

    return linear.register_forward_pre_hook(hook)


def apply_fake_quant(model: nn.Module, config: dict[str, Any], scales: dict[str, torch.Tensor]) -> FakeQuantHandles:
    """Attach the activation and KV fake quantization that `config` (quant_config.json) asks for."""
    handles = FakeQuantHandles()
    acts = config.get("activations")
    if acts:
        scheme = scheme_from_entry(acts, ActivationScheme)
        for name in acts["modules"]:
            absmax = scales.get(input_absmax_key(name))
            if absmax is None and not scheme.dynamic:
                raise ValueError(f"{name}: static activation scheme but no {input_absmax_key(name)} in the scales")
            handles.hooks.append(quantize_inputs(model.get_submodule(name), scheme, absmax))
    kv = config.get("kv_cache")
    if kv:
        scheme_kv = scheme_from_entry(kv, KVCacheScheme)
        kv_cache.enable(model)
        for name in kv["modules"]:
            k_key, v_key = kv_absmax_keys(name)
            attn = model.get_submodule(name)
            attn.quantlab_kv_hook = kv_cache.kv_fake_quant_hook(
                scales[k_key], scales[v_key], scheme_kv.kind, per_head=scheme_kv.granularity == "head")
            handles.attentions.append(attn)
    return handles


def apply_from_canonical(model: nn.Module, source: Path) -> FakeQuantHandles:
    return apply_fake_quant(model, load_quant_config(source), load_scales(source))


def describe(config: dict[str, Any]) -> str:
    """One line for logs: `A8_token_dynamic + C8_int_head`."""
    parts: list[str] = []
    acts, kv = config.get("activations"), config.get("kv_cache")
    if acts:
        parts.append(scheme_from_entry(acts, ActivationScheme).name)
    if kv:
        parts.append(f"C8_{kv.get('type', 'int')}_{kv.get('granularity', 'head')}")
    return " + ".join(parts) if parts else "weights only"
