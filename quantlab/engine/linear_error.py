"""How much each quantized Linear's output moved, measured by the engine as it quantizes.

For every Linear of a block the engine records, on a sample of the block's calibration tokens
(the first `tokens` of its first batch, so memory stays bounded on any model size):

* `rtn`: the relative output error ‖x·(RTN(W)−W)ᵀ‖ / ‖x·Wᵀ‖ of plain round-to-nearest of the
  float weight in the same scheme, on the float block's inputs: what quantizing without the
  algorithm would cost;
* `quantized`: the relative error of the Linear's output in the quantized block (its own codes,
  and what the Linears before it in the block pass on) against the float block's output. Where
  AWQ or SmoothQuant folded a per-channel scale into a Linear's outputs (v_proj / up_proj: the
  next Linear takes it back; `LayerContext.output_scales`), the scale is undone first: it is
  not error.

`quantized` is null for a MoE expert whose routed tokens changed between the two passes.
The gap between the two is what the stage's search or error compensation bought (GPTQ, AWQ),
or how far in-block propagation adds to the rounding (RTN).

Under several calibration processes nothing is reduced: each process's first batch starts its
contiguous share, so rank 0's (the one written) is the single-process first batch, and its
errors are the single-process ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from quantlab.quant.primitives import QuantizedWeight, fake_quantize_weight


@dataclass
class _Float:
    x: torch.Tensor  # [tokens, in] input sample of the float block
    y: torch.Tensor  # [tokens, out] its float output
    weight: torch.Tensor
    bias: torch.Tensor | None


@dataclass
class LinearErrors:
    """`observe_float(layer)` before the algorithms, `observe_quantized(layer)` around the
    engine's forward of the quantized block, then `finish(...)` per block."""

    tokens: int = 1024
    results: dict[str, dict[str, float]] = field(default_factory=dict)
    _float: dict[str, _Float] = field(default_factory=dict)
    _quantized: dict[str, torch.Tensor] = field(default_factory=dict)

    def _hooks(self, layer: nn.Module, record: Any) -> list[Any]:
        seen: set[str] = set()

        def hook_for(name: str, module: nn.Linear):
            def hook(_m: nn.Module, args: tuple, out: torch.Tensor) -> None:
                if name not in seen:  # the first batch only
                    seen.add(name)
                    record(name, module, args[0].reshape(-1, args[0].shape[-1])[: self.tokens],
                           out.reshape(-1, out.shape[-1])[: self.tokens])
            return hook

        return [m.register_forward_hook(hook_for(n, m)) for n, m in layer.named_modules() if isinstance(m, nn.Linear)]

    def float_hooks(self, layer: nn.Module) -> list[Any]:
        def record(name: str, m: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> None:
            # the float weight waits on the CPU in its own dtype (exact): an fp32 copy of every
            # Linear of a layer on the device was 0.9 GB of a Qwen2-7B layer's GPTQ peak
            self._float[name] = _Float(x.detach().float().clone(), y.detach().float().clone(),
                                       m.weight.detach().to("cpu", copy=True),
                                       None if m.bias is None else m.bias.detach().float().clone())
        return self._hooks(layer, record)

    def quantized_hooks(self, layer: nn.Module) -> list[Any]:
        def record(name: str, _m: nn.Linear, _x: torch.Tensor, y: torch.Tensor) -> None:
            self._quantized[name] = y.detach().float().clone()
        return self._hooks(layer, record)

    def finish(self, prefix: str, quantized: dict[str, QuantizedWeight],
               output_scales: dict[str, torch.Tensor] | None = None) -> None:
        """Errors of the block's quantized Linears under their full names; the samples are dropped."""
        output_scales = output_scales or {}
        for name, qw in quantized.items():
            ref, y = self._float.get(name), self._quantized.get(name)
            if ref is None or y is None:
                continue
            weight = ref.weight.to(ref.x.device).float()
            rtn = nn.functional.linear(ref.x, fake_quantize_weight(weight, qw.scheme).float(), ref.bias)
            norm = ref.y.norm().clamp_min(1e-30)
            gain = output_scales[name].to(y.device) if name in output_scales else 1.0
            full = f"{prefix}.{name}" if prefix else name
            # a MoE expert can be routed other tokens once the router's inputs moved: no pairing
            paired = y.shape == ref.y.shape
            self.results[full] = {"rtn": round(float((rtn - ref.y).norm() / norm), 6),
                                  "quantized": round(float((y * gain - ref.y).norm() / norm), 6) if paired else None}
        self._float.clear()
        self._quantized.clear()


def remove(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
