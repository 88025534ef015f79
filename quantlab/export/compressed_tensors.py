"""compressed-tensors `pack-quantized` checkpoint (llm-compressor's W4A16 / WNA16 output; loaded
by transformers + compressed-tensors and by vLLM).

Per Linear: `weight_packed` int32 `[out, ceil(in·b/32)]`: codes stored as `q_signed + 2^(b−1)`
(which is the canonical unsigned code) packed densely along the input dim (compressed-tensors'
`pack_to_int32`); `weight_scale` `[out, groups]` in the model's float dtype (so scales
round-trip exactly for a float32 canonical form); `weight_shape` int64 `[2]`; asymmetric
schemes add `weight_zero_point` int32 `[ceil(out·b/32), groups]` packed along dim 0.
Symmetric codes have their zero at 2^(b−1) implicitly. No g_idx; the group must divide the
input dim (`strategy: group`) or be the whole row (`strategy: channel`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from quantlab.errors import UserError
from quantlab.export.bits import pack_dense, packed_len, unpack_dense
from quantlab.export.checks import Report
from quantlab.export.hf_checkpoint import (start_validation, check_bias, check_layout, load_tensors, read_config,
                                           write_checkpoint)
from quantlab.export.source import Canonical, check_fingerprints
from quantlab.quant.primitives import QuantizedWeight, default_g_idx
from quantlab.quant.scheme import WeightScheme

NAME = "compressed-tensors"
FORMAT = "pack-quantized"
CT_VERSION = "0.20.0"  # the compressed-tensors release this layout was checked against


def weights_args(scheme: WeightScheme) -> dict[str, Any]:
    return {"num_bits": scheme.bits, "type": "int", "symmetric": scheme.symmetric,
            "group_size": scheme.group_size, "strategy": "channel" if scheme.group_size is None else "group",
            "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
            "observer_kwargs": {}}


def quantization_config(src: Canonical) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors", "format": FORMAT,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights_args(src.scheme),
                                      "input_activations": None, "output_activations": None, "format": FORMAT}},
        "kv_cache_scheme": None, "ignore": ["lm_head", *src.unquantized_linears()],
        "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
        "global_compression_ratio": None, "version": CT_VERSION,
    }


def check_exportable(src: Canonical) -> None:
    scheme = src.scheme
    src.require_default_g_idx(NAME)
    for name, qw in src.quantized.items():
        in_f = qw.codes.shape[1]
        if scheme.group_size is not None and in_f % scheme.group_size:
            raise UserError(f"{NAME}: {name} has {in_f} inputs, not a multiple of group_size {scheme.group_size}; "
                            "compressed-tensors groups must divide the input dim (use a group size that "
                            f"divides {in_f}, or export as gptq or gguf)")


def quant_tensors(scheme: WeightScheme, dtype: torch.dtype):
    def fn(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        out = {"weight_packed": pack_dense(qw.codes, scheme.bits, dim=1),
               "weight_scale": qw.scales.to(dtype), "weight_shape": torch.tensor(list(qw.codes.shape))}
        if not scheme.symmetric:
            out["weight_zero_point"] = pack_dense(qw.zeros, scheme.bits, dim=0)
        return out
    return fn


def write(src: Canonical, tmp: Path, final: Path, max_shard_bytes: int | None = None) -> None:
    check_exportable(src)
    dtype = src.float_dtype
    kwargs = {"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {}
    write_checkpoint(src, tmp, final, NAME, quant_tensors(src.scheme, dtype), quantization_config(src), dtype,
                     **kwargs)


def _scheme(qcfg: dict[str, Any]) -> WeightScheme:
    w = qcfg["config_groups"]["group_0"]["weights"]
    return WeightScheme(bits=w["num_bits"], symmetric=w["symmetric"], group_size=w.get("group_size"))


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    scheme = _scheme(read_config(path)["quantization_config"])
    tensors = load_tensors(path)
    quantized = {}
    for key in [k for k in tensors if k.endswith(".weight_packed")]:
        name = key.removesuffix(".weight_packed")
        out_f, in_f = (int(v) for v in tensors.pop(f"{name}.weight_shape"))
        scales = tensors.pop(f"{name}.weight_scale").float()
        if scheme.symmetric:
            zeros = torch.full(scales.shape, 2 ** (scheme.bits - 1), dtype=torch.uint8)
        else:
            zeros = unpack_dense(tensors.pop(f"{name}.weight_zero_point"), scheme.bits, out_f, dim=0)
        quantized[name] = QuantizedWeight(codes=unpack_dense(tensors.pop(key), scheme.bits, in_f, dim=1),
                                          scales=scales, zeros=zeros,
                                          g_idx=default_g_idx(in_f, scheme.group_size), scheme=scheme)
    return tensors, quantized


def validate(path: Path) -> Report:
    report, config, qcfg = start_validation(path, NAME, "compressed-tensors")
    if not qcfg:
        return report
    where = "quantization_config"
    report.key(qcfg, "format", where, FORMAT)
    report.key(qcfg, "quantization_status", where, "compressed")
    report.key(qcfg, "ignore", where)
    groups = report.key(qcfg, "config_groups", where) or {}
    if not report.check("config value", f"{where}.config_groups", len(groups) == 1,
                        f"expected one group, got {len(groups)}"):
        return report
    gname, group = next(iter(groups.items()))
    gwhere = f"{where}.config_groups.{gname}"
    report.key(group, "targets", gwhere, ["Linear"])
    w = report.key(group, "weights", gwhere) or {}
    wwhere = f"{gwhere}.weights"
    bits = report.key(w, "num_bits", wwhere, allowed=(2, 3, 4, 8))
    report.key(w, "type", wwhere, "int")
    sym = report.key(w, "symmetric", wwhere, allowed=(True, False))
    gs = report.key(w, "group_size", wwhere)
    strategy = report.key(w, "strategy", wwhere, allowed=("group", "channel"))
    report.check("config value", f"{wwhere}.strategy", (strategy == "channel") == (gs is None),
                 f"strategy {strategy!r} with group_size {gs!r}")
    if group.get("input_activations") is not None:
        report.check("weight-only", f"{gwhere}.input_activations", False, "activation quantization is not W4A16")
    if not report.ok:
        return report
    tensors = load_tensors(path)
    skip = {n for n in qcfg.get("ignore", []) if n != "lm_head"}
    fdtypes = (torch.float16, torch.bfloat16, torch.float32)

    def per_linear(name: str, out_f: int, in_f: int) -> None:
        g = in_f if gs is None else gs
        report.check("group divides inputs", name, in_f % g == 0, f"{in_f} inputs, group_size {g}")
        ng = in_f // g
        report.tensor(tensors, f"{name}.weight_packed", torch.int32, (out_f, packed_len(in_f, bits)))
        report.tensor(tensors, f"{name}.weight_scale", fdtypes, (out_f, ng))
        shape = report.tensor(tensors, f"{name}.weight_shape", (torch.int64, torch.int32), (2,))
        if shape is not None and shape.shape == (2,):
            report.check("weight_shape value", f"{name}.weight_shape", shape.tolist() == [out_f, in_f],
                         f"expected {[out_f, in_f]}, got {shape.tolist()}")
        if sym:
            report.check("no zero point when symmetric", f"{name}.weight_zero_point",
                         f"{name}.weight_zero_point" not in tensors, "present but the scheme is symmetric")
        else:
            report.tensor(tensors, f"{name}.weight_zero_point", torch.int32, (packed_len(out_f, bits), ng))
        check_bias(report, tensors, config, name, out_f)

    check_layout(report, path, config, tensors, skip, per_linear)
    report.facts.update({"bits": bits, "group_size": gs, "symmetric": sym, "strategy": strategy})
    if report.ok:
        _, quantized = read(path)
        check_fingerprints(report, path, quantized)
    return report


def matches(path: Path) -> bool:
    try:
        return (read_config(path).get("quantization_config") or {}).get("quant_method") == "compressed-tensors"
    except (UserError, ValueError):
        return False
