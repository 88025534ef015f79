"""GPTQ checkpoint (AutoGPTQ / GPTQModel / optimum layout; loaded by transformers + gptqmodel,
GPTQModel.load, vLLM (symmetric only), TensorRT-LLM's PyTorch backend as W4A16_GPTQ).

Per Linear: `qweight` int32 `[in·b/32, out]` (codes packed densely along the input dim),
`qzeros` int32 `[ceil(in/G), out·b/32]`, `scales` fp16 `[ceil(in/G), out]`, `g_idx` int32 `[in]`
(group of each input column in original order, so act-order and short tail groups are both
representable).

Symmetric schemes are written as v1 (`checkpoint_format: "gptq"`, stored zero `z − 1`), the
form every loader takes. Asymmetric ones are written as v2 (`"gptq_v2"`, stored zero `z`):
v1 cannot hold z = 0 per value, and GPTQModel refuses asymmetric v1 unless its own writer
(which subtracts word-wise) made it. The reader takes both; v1 is decoded word-wise, which
also reads GPTQModel's asymmetric v1 files. Scales round-trip within fp16 rounding; codes,
zeros and g_idx exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from quantlab.file_checks import read_json_object
from quantlab.errors import UserError
from quantlab.export.bits import _to_int32, pack_dense, packed_len, unpack_dense
from quantlab.export.checks import Report
from quantlab.export.hf_checkpoint import (start_validation, check_bias, check_layout, load_tensors, read_config,
                                           write_checkpoint)
from quantlab.export.source import Canonical, check_fingerprints
from quantlab.quant.primitives import QuantizedWeight, default_g_idx, num_groups
from quantlab.quant.scheme import WeightScheme

NAME = "gptq"
QUANTIZE_CONFIG = "quantize_config.json"


def encode_zeros_v1(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """`[groups, out]` zero points → int32 words holding `z − 1` (v1)."""
    if bits == 3:
        if bool((zeros == 0).any()):
            raise UserError(f"{NAME}: a 3-bit zero point of 0 cannot be stored in GPTQ v1 (which stores z − 1)")
        return pack_dense(zeros.to(torch.int64) - 1, bits, dim=-1)
    ones = torch.ones_like(zeros, dtype=torch.int64)
    words = pack_dense(zeros, bits, dim=-1).to(torch.int64) - pack_dense(ones, bits, dim=-1).to(torch.int64)
    return _to_int32(words)


def decode_zeros_v1(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    if bits == 3:
        return ((unpack_dense(words, bits, n).to(torch.int64) + 1) % 8).to(torch.uint8)
    ones = pack_dense(torch.ones(*words.shape[:-1], n, dtype=torch.int64), bits, dim=-1).to(torch.int64)
    return unpack_dense(_to_int32(words.to(torch.int64) + ones), bits, n)


def encode_zeros(zeros: torch.Tensor, bits: int, checkpoint_format: str) -> torch.Tensor:
    if checkpoint_format == "gptq_v2":
        return pack_dense(zeros, bits, dim=-1)
    return encode_zeros_v1(zeros, bits)


def decode_zeros(words: torch.Tensor, bits: int, n: int, checkpoint_format: str) -> torch.Tensor:
    if checkpoint_format == "gptq_v2":
        return unpack_dense(words, bits, n)
    return decode_zeros_v1(words, bits, n)


def checkpoint_format_for(scheme: WeightScheme) -> str:
    return "gptq" if scheme.symmetric else "gptq_v2"


def check_exportable(src: Canonical) -> None:
    bits = src.scheme.bits
    for name, qw in src.quantized.items():
        out_f, in_f = qw.codes.shape
        if (in_f * bits) % 32 or (out_f * bits) % 32:
            raise UserError(f"{NAME}: {name} is [{out_f}, {in_f}]; GPTQ packs {bits}-bit codes into whole int32 "
                            f"words, so in·{bits} and out·{bits} must be multiples of 32")


def quant_tensors(bits: int, checkpoint_format: str):
    def fn(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        return {"qweight": pack_dense(qw.codes.t(), bits, dim=0),
                "qzeros": encode_zeros(qw.zeros.t(), bits, checkpoint_format),
                "scales": qw.scales.t().to(torch.float16), "g_idx": qw.g_idx.to(torch.int32)}
    return fn


def quantization_config(src: Canonical) -> dict[str, Any]:
    scheme = src.scheme
    damp = next((s.get("gptq", {}).get("damp_percent") for s in src.quant_config.get("stages", [])
                 if "gptq" in s), None)
    qcfg: dict[str, Any] = {
        "bits": scheme.bits, "group_size": scheme.group_size or -1, "desc_act": src.act_order,
        "sym": scheme.symmetric, "damp_percent": damp if damp is not None else 0.01, "static_groups": False,
        "true_sequential": True, "lm_head": src.head_quantized, "quant_method": "gptq",
        "checkpoint_format": checkpoint_format_for(scheme),
        "pack_dtype": "int32", "meta": {"quantizer": ["quantlab:0.1.0"]},
    }
    skipped = src.unquantized_linears()
    if skipped:  # GPTQModel's per-module override: "-:" excludes a module from quantization
        qcfg["dynamic"] = {"-:^" + n.replace(".", r"\.") + "$": {} for n in skipped}
    return qcfg


def write(src: Canonical, tmp: Path, final: Path, max_shard_bytes: int | None = None) -> None:
    check_exportable(src)
    qcfg = quantization_config(src)
    kwargs = {"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {}
    write_checkpoint(src, tmp, final, NAME, quant_tensors(src.scheme.bits, qcfg["checkpoint_format"]), qcfg,
                     torch.float16, **kwargs)
    (tmp / QUANTIZE_CONFIG).write_text(json.dumps(qcfg, indent=2) + "\n")


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    qcfg = read_config(path)["quantization_config"]
    bits, group, sym = int(qcfg["bits"]), int(qcfg["group_size"]), bool(qcfg["sym"])
    fmt = qcfg.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise UserError(f"{path}: checkpoint_format {fmt!r}; only 'gptq' (v1) and 'gptq_v2' are read")
    tensors = load_tensors(path)
    quantized = {}
    for key in [k for k in tensors if k.endswith(".qweight")]:
        name = key.removesuffix(".qweight")
        qweight, qzeros, scales, g_idx = (tensors.pop(f"{name}.{s}") for s in ("qweight", "qzeros", "scales", "g_idx"))
        in_f, out_f = g_idx.shape[0], scales.shape[1]
        scheme = WeightScheme(bits=bits, symmetric=sym, group_size=None if group == -1 else group)
        quantized[name] = QuantizedWeight(
            codes=unpack_dense(qweight, bits, in_f, dim=0).t().contiguous(), scales=scales.float().t().contiguous(),
            zeros=decode_zeros(qzeros, bits, out_f, fmt).t().contiguous(), g_idx=g_idx.to(torch.int32),
            scheme=scheme)
    return tensors, quantized


def validate(path: Path) -> Report:
    report, config, qcfg = start_validation(path, NAME, "gptq")
    if not qcfg:
        return report
    where = "quantization_config"
    bits = report.key(qcfg, "bits", where, allowed=(2, 3, 4, 8))
    group = report.key(qcfg, "group_size", where)
    desc_act = report.key(qcfg, "desc_act", where, allowed=(True, False))
    sym = report.key(qcfg, "sym", where, allowed=(True, False))
    fmt = report.key(qcfg, "checkpoint_format", where, allowed=("gptq", "gptq_v2"))
    for key in ("damp_percent", "static_groups", "true_sequential"):
        report.key(qcfg, key, where)
    side = path / QUANTIZE_CONFIG
    if report.check("file", QUANTIZE_CONFIG, side.is_file(), "missing (older loaders read it)"):
        other = read_json_object(side)
        for key in ("bits", "group_size", "sym", "desc_act", "checkpoint_format"):
            report.check("config agrees", f"{QUANTIZE_CONFIG}.{key}", other.get(key) == qcfg.get(key),
                         f"{other.get(key)!r} here, {qcfg.get(key)!r} in config.json")
    if bits not in (2, 3, 4, 8) or not isinstance(group, int) or group == 0 or group < -1:
        report.check("config value", f"{where}.group_size", isinstance(group, int) and group != 0,
                     f"expected a positive int or -1, got {group!r}")
        return report
    tensors = load_tensors(path)
    skip = {k[3:].strip("^$").replace("\\.", ".") for k in (qcfg.get("dynamic") or {}) if k.startswith("-:")}

    def per_linear(name: str, out_f: int, in_f: int) -> None:
        g = in_f if group == -1 else group
        ng = num_groups(in_f, g)
        report.tensor(tensors, f"{name}.qweight", torch.int32, (packed_len(in_f, bits), out_f))
        qzeros = report.tensor(tensors, f"{name}.qzeros", torch.int32, (ng, packed_len(out_f, bits)))
        report.tensor(tensors, f"{name}.scales", torch.float16, (ng, out_f))
        g_idx = report.tensor(tensors, f"{name}.g_idx", torch.int32, (in_f,))
        if g_idx is not None and g_idx.shape == (in_f,):
            report.check("g_idx range", f"{name}.g_idx", bool(((g_idx >= 0) & (g_idx < ng)).all()),
                         f"values outside 0..{ng - 1}")
            if not desc_act:
                report.check("g_idx is i // group_size without desc_act", f"{name}.g_idx",
                             torch.equal(g_idx, default_g_idx(in_f, None if group == -1 else group)),
                             "columns are reordered but desc_act is false")
        if sym and qzeros is not None and qzeros.shape == (ng, packed_len(out_f, bits)):
            zeros = decode_zeros(qzeros, bits, out_f, fmt or "gptq")
            report.check("symmetric zero point", f"{name}.qzeros", bool((zeros == 2 ** (bits - 1)).all()),
                         f"sym is true but zero points do not decode to {2 ** (bits - 1)} ({fmt})")
        check_bias(report, tensors, config, name, out_f)

    check_layout(report, path, config, tensors, skip, per_linear, head_quantized=bool(qcfg.get("lm_head")))
    report.facts.update({"bits": bits, "group_size": group, "sym": sym, "desc_act": desc_act,
                         "checkpoint_format": qcfg.get("checkpoint_format")})
    if report.ok:
        _, quantized = read(path)
        check_fingerprints(report, path, quantized)
    return report


def matches(path: Path) -> bool:
    try:
        return (read_config(path).get("quantization_config") or {}).get("quant_method") == "gptq"
    except (UserError, ValueError):
        return False
