"""AutoAWQ "GEMM" checkpoint (what transformers + gptqmodel and vLLM `awq` load).

Per Linear: `qweight` int32 `[in, out/8]` and `qzeros` int32 `[in/G, out/8]`, both packed
along the output dim in AutoAWQ's interleaved nibble order; `scales` fp16 `[in/G, out]`.
Dequant is `(q − z)·s`, the canonical rule, so symmetric codes fit exactly by storing their
zero point 8. AWQ GEMM has no g_idx and requires `G | in_features`: a short tail group (576
inputs at G=128) cannot be represented. Scales are stored fp16, so they round-trip within fp16
rounding; codes and zeros round-trip exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from quantlab.errors import UserError
from quantlab.export.bits import pack_awq, unpack_awq
from quantlab.export.checks import Report
from quantlab.export.hf_checkpoint import (start_validation, check_bias, check_layout, load_tensors, read_config,
                                           write_checkpoint)
from quantlab.export.source import Canonical, check_fingerprints
from quantlab.quant.primitives import QuantizedWeight, default_g_idx
from quantlab.quant.scheme import WeightScheme

NAME = "awq"


def check_exportable(src: Canonical) -> None:
    scheme = src.scheme
    if scheme.bits != 4:
        raise UserError(f"{NAME}: AWQ GEMM stores 4-bit codes only; scheme {scheme.name} has {scheme.bits} bits "
                        "(export as gptq or compressed-tensors)")
    src.require_default_g_idx(NAME)
    for name, qw in src.quantized.items():
        out_f, in_f = qw.codes.shape
        if scheme.group_size is not None and in_f % scheme.group_size:
            raise UserError(f"{NAME}: {name} has {in_f} inputs, not a multiple of group_size {scheme.group_size}: "
                            "AWQ GEMM cannot represent a short tail group (use a group size that divides "
                            f"{in_f}, or export as gptq or gguf)")
        if out_f % 8:
            raise UserError(f"{NAME}: {name} has {out_f} outputs; AWQ packs 8 outputs per int32")


def quant_tensors(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    return {"qweight": pack_awq(qw.codes.t()), "qzeros": pack_awq(qw.zeros.t()),
            "scales": qw.scales.t().to(torch.float16)}


def write(src: Canonical, tmp: Path, final: Path, max_shard_bytes: int | None = None) -> None:
    check_exportable(src)
    scheme = src.scheme
    qcfg = {"quant_method": "awq", "zero_point": True, "group_size": scheme.group_size or -1, "bits": 4,
            "version": "gemm", "modules_to_not_convert": [*src.unquantized_linears(), *src.router_linears()] or None}
    kwargs = {"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {}
    write_checkpoint(src, tmp, final, NAME, quant_tensors, qcfg, torch.float16,
                     options={"symmetric_zero_point": 8 if scheme.symmetric else None}, **kwargs)


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    config = read_config(path)
    group = int(config["quantization_config"]["group_size"])
    tensors = load_tensors(path)
    quantized = {}
    for key in [k for k in tensors if k.endswith(".qweight")]:
        name = key.removesuffix(".qweight")
        qweight, qzeros, scales = (tensors.pop(f"{name}.{s}") for s in ("qweight", "qzeros", "scales"))
        in_f, out_f = qweight.shape[0], scales.shape[1]
        zeros = unpack_awq(qzeros).t().contiguous()
        scheme = WeightScheme(bits=4, symmetric=bool((zeros == 8).all()), group_size=None if group == -1 else group)
        quantized[name] = QuantizedWeight(codes=unpack_awq(qweight).t().contiguous(),
                                          scales=scales.float().t().contiguous(), zeros=zeros,
                                          g_idx=default_g_idx(in_f, scheme.group_size), scheme=scheme)
        assert quantized[name].codes.shape == (out_f, in_f)
    return tensors, quantized


def validate(path: Path) -> Report:
    report, config, qcfg = start_validation(path, NAME, "awq")
    if not qcfg:
        return report
    where = "quantization_config"
    report.key(qcfg, "bits", where, 4)
    report.key(qcfg, "version", where, allowed=("gemm", "GEMM"))
    report.key(qcfg, "zero_point", where, True)
    group = report.key(qcfg, "group_size", where)
    if not isinstance(group, int) or group == 0 or group < -1:
        report.check("config value", f"{where}.group_size", False, f"expected a positive int or -1, got {group!r}")
        return report
    tensors = load_tensors(path)
    skip = set(qcfg.get("modules_to_not_convert") or [])

    def per_linear(name: str, out_f: int, in_f: int) -> None:
        g = in_f if group == -1 else group
        report.check("group divides inputs", name, in_f % g == 0, f"{in_f} inputs, group_size {g}")
        ng = in_f // g
        report.tensor(tensors, f"{name}.qweight", torch.int32, (in_f, out_f // 8))
        report.tensor(tensors, f"{name}.qzeros", torch.int32, (ng, out_f // 8))
        report.tensor(tensors, f"{name}.scales", torch.float16, (ng, out_f))
        check_bias(report, tensors, config, name, out_f)

    check_layout(report, path, config, tensors, skip, per_linear)
    report.facts.update({"bits": 4, "group_size": group, "zero_point": qcfg.get("zero_point")})
    if report.ok:
        _, quantized = read(path)
        check_fingerprints(report, path, quantized)
    return report


def matches(path: Path) -> bool:
    qcfg = _qcfg(path)
    return qcfg.get("quant_method") == "awq"


def _qcfg(path: Path) -> dict[str, Any]:
    try:
        return read_config(path).get("quantization_config") or {}
    except (UserError, ValueError):
        return {}
