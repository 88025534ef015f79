"""Builders shared by the export tests: tiny canonical directories of each family and scheme."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

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
                   act_order: bool = False, skip: tuple[str, ...] = (), seed: int = 0, folded: bool = False,
                   head: bool = False, **dims) -> Path:
    """A canonical directory of a tiny model, RTN (or act-order) codes; `folded` also keeps the
    float weights before rounding, as the quantize stage does for K-quant exports; `head` also
    quantizes lm_head (untied from the embedding, as a stage's `lm_head: true` does)."""
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
    if head:
        from quantlab.engine.sequential import untie_lm_head

        untie_lm_head(model)
        quantized["lm_head"] = quantize_weight(model.lm_head.weight.detach(), scheme)
    target = root / "quantized"
    floats = {name: model.get_submodule(name).weight.detach() for name in quantized} if folded else None
    save_canonical(target, model, quantized, tokenizer, {"source_model": f"tiny-{model_type}"}, folded=floats)
    return target


def make_act_canonical(root: Path, tokenizer, model_type: str = "llama", weights: WeightScheme | None = None,
                       activations=None, kv_cache=None, seed: int = 0, **dims) -> Path:
    """A canonical directory with calibrated activation / KV ranges (RTN weights, then the
    act_ranges stage on a few random token batches), as an A8W8 / FP8 / C8 run writes it."""
    from quantlab.algorithms.act_ranges import ActRanges, canonical_entries
    from quantlab.algorithms.rtn import RTN
    from quantlab.engine.sequential import run_sequential

    weights = weights or WeightScheme(bits=8, symmetric=True, group_size=None)
    model = tiny_model(model_type, seed=seed, **{**EXPORT_DIMS, **dims})
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(seed))
    stage = ActRanges(activations, kv_cache)
    scales: dict[str, torch.Tensor] = {}
    quantized = run_sequential(model, ARCH_SPECS[model_type], ids, [RTN(weights), stage], torch.device("cpu"),
                               scales=scales)
    target = root / "quantized"
    save_canonical(target, model, quantized, tokenizer,
                   {"source_model": f"tiny-{model_type}", **canonical_entries(stage, scales)}, scales=scales)
    return target


# ----------------------------------------------------------------------------- broken exports


def broken_copy(src: Path, tag: str) -> Path:
    """A copy next to the original (so the sidecar's relative canonical path still resolves)."""
    dst = src.parent / f"{src.name}-broken-{tag}"
    shutil.copytree(src, dst)
    return dst


def edit_tensors(path: Path, fn, fname="model.safetensors") -> None:
    tensors = load_file(path / fname)
    fn(tensors)
    save_file(tensors, path / fname, metadata={"format": "pt"})


def edit_json(path: Path, fn, fname="config.json") -> None:
    data = json.loads((path / fname).read_text())
    fn(data)
    (path / fname).write_text(json.dumps(data))


def edit_config(path: Path, fn) -> None:
    edit_json(path, fn, "config.json")


def rejected(path: Path, subject: str, rule: str) -> str:
    """The export is rejected, with a failure on exactly this subject and rule; the message."""
    from quantlab.export import api
    from quantlab.export.checks import ExportInvalid

    report = api.inspect(path)
    with pytest.raises(ExportInvalid) as err:
        report.raise_if_invalid()
    assert any(c.subject == subject and c.rule == rule for c in report.failures), \
        [c.line() for c in report.failures][:5]
    return str(err.value)


def export_cases(root: Path, tokenizer, cases: dict, fmt: str,
                 model_types: tuple[str, ...] = ("llama", "qwen2")) -> dict[tuple[str, str], tuple[Path, Path]]:
    """(case, model_type) → (canonical dir, export dir) for `cases` of (weights, acts, kv, …)."""
    from quantlab.export import api

    out = {}
    for case, (weights, acts, kv, *_) in cases.items():
        for model_type in model_types:
            canonical = make_act_canonical(root / case / model_type, tokenizer, model_type, weights, acts, kv)
            target = canonical.parent / "export" / fmt
            api.export(canonical, target, fmt)
            out[case, model_type] = canonical, target
    return out


def assert_same_weight(got: QuantizedWeight, codes: torch.Tensor, scales: torch.Tensor,
                       ref: QuantizedWeight, name: str) -> None:
    """Bit-exact codes (FP8 compared as bytes), zeros, g_idx, scales and scheme."""
    if codes.is_floating_point():
        assert torch.equal(got.codes.view(torch.uint8), codes.view(torch.uint8)), name
    else:
        assert torch.equal(got.codes, codes), name
    assert torch.equal(got.zeros, ref.zeros) and torch.equal(got.g_idx, ref.g_idx), name
    assert torch.equal(got.scales, scales), name
    assert got.scheme == ref.scheme, name
