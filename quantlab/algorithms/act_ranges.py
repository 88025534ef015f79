"""The activation / KV-cache range stage: calibrate what A8W8, FP8 and C8 need at run time.

Runs on each decoder layer after the weight stages, with the layer's encoded weights in
place (so o_proj's input range is the one the quantized q,k,v produce), and records:
  * per quantized Linear, the per-tensor range of its input chosen by the scheme's observer
    (`absmax`, or a clipped threshold: percentile, mse, histogram/KL, fitted to the scheme's
    int8 or FP8 grid) — static schemes quantize with it; dynamic ones still store it because
    static-scale exporters (PaddleNLP a8w8) need it;
  * per Linear of the ArchSpec (ignored ones included), the plain per-channel absmax of its
    input and of its output (k_proj / v_proj outputs: K before RoPE and V, per channel);
  * per attention module, the per-KV-head absmax of K (after RoPE) and V as they enter
    attention (before the GQA repeat).
Names follow `quantlab.quant.canonical` (`N.input_absmax`, `N.input_channel_absmax`,
`N.output_channel_absmax`, `A.k_absmax`, `A.v_absmax`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from quantlab.engine import distributed
from quantlab.engine.observers import RangeObserver, observe_linears, require_reducible
from quantlab.engine.sequential import LayerContext, is_ignored
from quantlab.quant import kv_cache
from quantlab.quant.canonical import channel_absmax_keys, input_absmax_key, kv_absmax_keys
from quantlab.quant.primitives import QuantizedWeight
from quantlab.quant.scheme import ActivationScheme, KVCacheScheme


@dataclass
class ActRanges:
    activations: ActivationScheme | None = field(default_factory=ActivationScheme)
    kv_cache: KVCacheScheme | None = None
    ignore: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if distributed.current().active and self.activations is not None:  # refused before any forward
            require_reducible(self.activations.observer, "act_ranges.activations.observer")

    def targets(self, ctx: LayerContext) -> list[str]:
        if self.activations is None:
            return []
        return [n for n in ctx.spec.linears if not is_ignored(ctx.full_name(n), self.ignore)]

    def apply(self, ctx: LayerContext) -> dict[str, QuantizedWeight]:
        ctx.spec.require_dense("act_ranges")
        for name, qw in ctx.quantized.items():  # observe the layer as it will be deployed
            lin = ctx.linear(name)
            lin.weight.data.copy_(qw.dequantize().to(lin.weight.dtype))
        names = self.targets(ctx)
        attns = kv_cache.attention_modules(ctx.layer) if self.kv_cache is not None else []
        scheme = self.activations or ActivationScheme()
        per_channel = lambda: RangeObserver("absmax", per_channel=True)  # noqa: E731
        with contextlib.ExitStack() as stack:
            obs = stack.enter_context(observe_linears(ctx.layer, names, lambda: RangeObserver.for_scheme(scheme)))
            channels = stack.enter_context(observe_linears(ctx.layer, list(ctx.spec.linears), per_channel, True))
            if attns:
                stack.enter_context(kv_cache.routed(ctx.layer))
            ranges = [stack.enter_context(kv_cache.observe_kv(a)) for a in attns]
            ctx.forward()
        for observer in [*obs.inputs.values(), *channels.inputs.values(), *channels.outputs.values()]:
            observer.reduce()  # every calibration process's tokens
        for rng in ranges:
            distributed.max_(rng.k)
            distributed.max_(rng.v)
        for name in names:
            ctx.scales[input_absmax_key(name)] = obs.inputs[name].result().reshape(())
        for name in ctx.spec.linears:
            in_key, out_key = channel_absmax_keys(name)
            ctx.scales[in_key], ctx.scales[out_key] = channels.inputs[name].result(), channels.outputs[name].result()
        for attn, rng in zip(attns, ranges):
            rel = _relative_name(ctx.layer, attn)
            k_key, v_key = kv_absmax_keys(rel)
            ctx.scales[k_key], ctx.scales[v_key] = rng.k.cpu(), rng.v.cpu()
        return {}


def _relative_name(layer: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(name for name, m in layer.named_modules() if m is module)


def canonical_entries(stage: ActRanges | None, scales: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The `activations` / `kv_cache` entries of quant_config.json for the ranges recorded."""
    if stage is None:
        return {}
    out: dict[str, Any] = {}
    if stage.activations is not None:
        mods = [k.removesuffix(".input_absmax") for k in scales if k.endswith(".input_absmax")]
        out["activations"] = {**stage.activations.model_dump(), "modules": mods}
    if stage.kv_cache is not None:
        mods = [k.removesuffix(".k_absmax") for k in scales if k.endswith(".k_absmax")]
        out["kv_cache"] = {**stage.kv_cache.model_dump(), "modules": mods}
    return out
