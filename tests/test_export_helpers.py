"""Builders shared by the export tests: tiny canonical directories of each family and scheme."""

from __future__ import annotations

from pathlib import Path

import torch

from conftest import tiny_model
from quantlab.models.arch import ARCH_SPECS
from quantlab.quant.canonical import save_canonical
from quantlab.quant.primitives import QuantizedWeight, quantize_weight
from quantlab.quant.scheme import WeightScheme

# Dimensions every format can hold: multiples of 64 (TensorRT-LLM pads to max(64, G)).
EXPORT_DIMS = dict(hidden_size=64, intermediate_size=128)


def act_order_quantize(w: torch.Tensor, scheme: WeightScheme, seed: int) -> QuantizedWeight:
    """Quantize with groups over a random column permutation, as GPTQ act-order does: codes
    stay in the original column order and g_idx maps each column to its (permuted) group."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(w.shape[1], generator=gen)
    inv = torch.argsort(perm)
    qp = quantize_weight(w[:, perm], scheme)
    return QuantizedWeight(qp.codes[:, inv].contiguous(), qp.scales, qp.zeros, qp.g_idx[inv].contiguous(), scheme)


def make_canonical(root: Path, tokenizer, model_type: str = "llama", scheme: WeightScheme | None = None,
                   act_order: bool = False, skip: tuple[str, ...] = (), seed: int = 0, **dims) -> Path:
    scheme = scheme or WeightScheme(bits=4, symmetric=False, group_size=32)
    model = tiny_model(model_type, seed=seed, **{**EXPORT_DIMS, **dims})
    spec = ARCH_SPECS[model_type]
    quantized = {}
    for i, layer in enumerate(spec.decoder_layers(model)):
        for j, lin in enumerate(spec.linears):
            name = f"{spec.layers}.{i}.{lin}"
            if lin in skip:
                continue
            w = layer.get_submodule(lin).weight.detach()
            quantized[name] = act_order_quantize(w, scheme, seed * 100 + i * 10 + j) if act_order \
                else quantize_weight(w, scheme)
    target = root / "quantized"
    save_canonical(target, model, quantized, tokenizer, {"source_model": f"tiny-{model_type}"})
    return target
