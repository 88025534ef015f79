"""Round-to-nearest weight quantization: no calibration data, min/max ranges per group."""

from __future__ import annotations

from dataclasses import dataclass, field

from quantlab.engine.sequential import LayerContext, is_ignored
from quantlab.quant.primitives import QuantizedWeight, quantize_weight
from quantlab.quant.scheme import WeightScheme


@dataclass
class RTN:
    scheme: WeightScheme
    ignore: list[str] = field(default_factory=list)
    data_free = True  # the engine skips calibration forwards when every stage is data-free

    def apply(self, ctx: LayerContext) -> dict[str, QuantizedWeight]:
        return {
            name: quantize_weight(ctx.linear(name).weight.data, self.scheme)
            for name in ctx.spec.linears
            if not is_ignored(ctx.full_name(name), self.ignore)
        }
