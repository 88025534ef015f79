"""compressed-tensors checkpoints (llm-compressor's output; loaded by transformers + compressed-tensors
and by vLLM).

The compression format follows the canonical scheme the way compressed-tensors' own
`infer_module_format` picks it:
  * `pack-quantized` — integer weight-only (W4A16, W8A16, ...). Per Linear: `weight_packed`
    int32 `[out, ceil(in·b/32)]`: codes stored as `q_signed + 2^(b−1)` (which is the canonical
    unsigned code) packed densely along the input dim (compressed-tensors' `pack_to_int32`);
    `weight_shape` int64 `[2]`; asymmetric schemes add `weight_zero_point` int32
    `[ceil(out·b/32), groups]` packed along dim 0 (the output dim): the layout
    compressed-tensors' own PackedQuantizationCompressor writes and unpacks, and the one vLLM's
    compressed-tensors WNA16 scheme allocates (`out // pack_factor` rows, `packed_dim=0`).
    Symmetric codes have their zero at 2^(b−1) implicitly.
    transformers (5.23, with compressed-tensors 0.20) builds the model it loads such a
    checkpoint into by compressing placeholder Linears on the meta device, and that path leaves
    `weight_zero_point` unpacked, `[out, groups]`: the packed tensors do not fit, and an unpacked
    one would fit but decompress wrongly on the first forward. So asymmetric pack-quantized
    checkpoints carry `"dequantize": true` in their quantization_config: transformers then
    loads dense Linears and runs compressed-tensors' decompressor on each module's tensors as
    stored, which reads the packed zero point. vLLM and SGLang ignore the key. The validator
    checks each export against what the installed transformers + compressed-tensors build
    (`quantlab.export.ct_load_layout`).
  * `int-quantized` — W8A8: symmetric int8 weights with int8 input activations. `weight` int8
    `[out, in]` holds the signed code `q − 128`.
  * `float-quantized` — FP8 e4m3 weights with FP8 input activations; `weight` float8_e4m3fn.
  * `naive-quantized` — FP8 weights without activation quantization (compressed-tensors'
    fallback format for a weight-only float scheme).
Every format has `weight_scale` in the model's float dtype (so scales round-trip exactly for a
float32 canonical form): `[out, groups]` (strategy group), `[out, 1]` (channel) or `[1]`
(tensor: the canonical `per_tensor` schemes; pack-quantized repeats that scale per channel,
because its packed zero point has no per-tensor layout). No g_idx; a group must divide the
input dim.

Activations (`input_activations`, symmetric 8-bit): per-token dynamic (strategy token),
per-tensor dynamic (strategy tensor), or static per-tensor, which adds `input_scale` `[1]` =
absmax/127 (int8) or absmax/448 (FP8): the step quantlab's own evaluation quantizes with.

KV cache (`kv_cache_scheme`): FP8 only, because vLLM, the format's main reader, loads nothing
else (INT8 KV scales go to trtllm or paddlenlp). `model.layers.N.self_attn.k_scale` /
`v_scale` = absmax/448, `[1]` per tensor (strategy tensor: the max over KV heads, as quantlab's
per-tensor C8 evaluates it) or `[num_key_value_heads, 1, 1]` per head (strategy attn_head: the
shape compressed-tensors initialises for it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from quantlab.errors import UserError
from quantlab.export import ct_load_layout
from quantlab.export.bits import pack_dense, packed_len, unpack_dense
from quantlab.export.checks import Report
from quantlab.models.arch import spec_for_config
from quantlab.export.hf_checkpoint import (start_validation, check_bias, check_layout, load_tensors, read_config,
                                           write_checkpoint)
from quantlab.export.source import Canonical, check_fingerprints, fingerprint, scale_fingerprints
from quantlab.quant.activations import scale_from_absmax
from quantlab.quant.primitives import QuantizedWeight, default_g_idx
from quantlab.quant.scheme import ActivationScheme, KVCacheScheme, WeightScheme

NAME = "compressed-tensors"
FORMAT = "pack-quantized"
FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
CT_VERSION = "0.20.0"  # the compressed-tensors release this layout was checked against
CARRIES_ACTIVATIONS = True
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_ARGS_DEFAULTS = {"actorder": None, "block_structure": None, "observer_kwargs": {}}


def ct_format(src: Canonical) -> str:
    if src.scheme.type == "float":
        return "float-quantized" if src.activations else "naive-quantized"
    return "int-quantized" if src.activations else "pack-quantized"


def _per_tensor(scheme: WeightScheme, fmt: str) -> bool:
    """One `[1]` scale (strategy tensor). pack-quantized keeps a per-tensor scheme as per-channel
    with the scale repeated: its packed zero point has no per-tensor layout."""
    return scheme.per_tensor and fmt != "pack-quantized"


def weights_args(scheme: WeightScheme, fmt: str = FORMAT) -> dict[str, Any]:
    strategy = "tensor" if _per_tensor(scheme, fmt) else "channel" if scheme.group_size is None else "group"
    return {"num_bits": scheme.bits, "type": scheme.type, "symmetric": scheme.symmetric,
            "group_size": scheme.group_size, "strategy": strategy, "dynamic": False,
            "observer": "minmax", **_ARGS_DEFAULTS}


def input_args(acts: ActivationScheme) -> dict[str, Any]:
    return {"num_bits": 8, "type": acts.type, "symmetric": True, "group_size": None,
            "strategy": acts.granularity, "dynamic": acts.dynamic,
            "observer": None if acts.dynamic else "minmax", **_ARGS_DEFAULTS}


def kv_args(kv: KVCacheScheme) -> dict[str, Any]:
    return {"num_bits": 8, "type": kv.type, "symmetric": True, "group_size": None,
            "strategy": "attn_head" if kv.granularity == "head" else "tensor", "dynamic": False,
            "observer": "minmax", **_ARGS_DEFAULTS}


def quantization_config(src: Canonical) -> dict[str, Any]:
    fmt = ct_format(src)
    acts = input_args(src.activations) if src.activations else None
    return {
        "quant_method": "compressed-tensors", "format": fmt,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights_args(src.scheme, fmt),
                                      "input_activations": acts, "output_activations": None, "format": fmt}},
        "kv_cache_scheme": kv_args(src.kv_cache) if src.kv_cache else None,
        "ignore": [src.spec.to_checkpoint(name) for name in (*([] if src.head_quantized else ["lm_head"]),
                                                             *src.unquantized_linears(), *src.router_linears())],
        "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
        "global_compression_ratio": None, "version": CT_VERSION,
        **({"dequantize": True} if loads_dense(fmt, src.scheme.symmetric) else {}),
    }


def loads_dense(fmt: str, symmetric: bool) -> bool:
    """Whether transformers must take its dequantize-at-load route (module docstring)."""
    return fmt == "pack-quantized" and not symmetric


def check_exportable(src: Canonical) -> None:
    scheme, acts, kv = src.scheme, src.activations, src.kv_cache
    src.require_default_g_idx(NAME)
    if acts is not None:
        src.require_activations_on_quantized(NAME)
        if acts.type != scheme.type:
            raise UserError(f"{NAME}: {scheme.type} weights with {acts.type} activations have no compressed-tensors "
                            "format (int-quantized is int8/int8, float-quantized FP8/FP8)")
        if scheme.type == "int" and (scheme.bits != 8 or not scheme.symmetric):
            raise UserError(f"{NAME}: int-quantized (W8A8) takes symmetric 8-bit weights; scheme {scheme.name} "
                            "does not fit (use W8A16 weights with the act_ranges stage)")
    if kv is not None and kv.type != "float":
        raise UserError(f"{NAME}: kv_cache type int: vLLM reads only FP8 KV-cache scales from compressed-tensors "
                        "(use kv_cache type float, or export INT8 KV scales as trtllm or paddlenlp)")
    src.require_kv_on_every_layer(NAME)  # kv_cache_scheme applies to every attention module
    for name, qw in src.quantized.items():
        in_f = qw.codes.shape[1]
        if scheme.group_size is not None and in_f % scheme.group_size:
            raise UserError(f"{NAME}: {name} has {in_f} inputs, not a multiple of group_size {scheme.group_size}; "
                            "compressed-tensors groups must divide the input dim (use a group size that "
                            f"divides {in_f}, or export as gptq or gguf)")


def _weight_scale(qw: QuantizedWeight, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    scale = qw.scales[:1, 0] if _per_tensor(qw.scheme, fmt) else qw.scales
    return scale.to(dtype)


def quant_tensors(src: Canonical, fmt: str, dtype: torch.dtype):
    scheme, acts = src.scheme, src.activations

    def fn(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        out = {"weight_scale": _weight_scale(qw, fmt, dtype)}
        if fmt == "pack-quantized":
            out["weight_packed"] = pack_dense(qw.codes, scheme.bits, dim=1)
            out["weight_shape"] = torch.tensor(list(qw.codes.shape))
            if not scheme.symmetric:
                out["weight_zero_point"] = pack_dense(qw.zeros, scheme.bits, dim=0)
            return out
        out["weight"] = qw.codes if scheme.type == "float" else (qw.codes.to(torch.int16) - 128).to(torch.int8)
        if acts is not None and not acts.dynamic:
            out["input_scale"] = scale_from_absmax(src.input_absmax(name), acts.kind).reshape(1).to(dtype)
        return out
    return fn


def kv_tensors(src: Canonical, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    kv = src.kv_cache
    if kv is None:
        return {}
    out = {}
    for attn in src.kv_modules:
        for part, absmax in zip("kv", src.kv_absmax(attn)):
            if kv.granularity == "head":
                scale = scale_from_absmax(absmax, kv.kind).reshape(-1, 1, 1)
            else:
                scale = scale_from_absmax(absmax.max(), kv.kind).reshape(1)
            out[f"{attn}.{part}_scale"] = scale.to(dtype)
    return out


def expected_scales(src: Canonical, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What `read_scales` must give back: the canonical steps, in the stored dtype."""
    acts = src.activations
    out = {f"{n}.input_scale": scale_from_absmax(src.input_absmax(n), acts.kind).reshape(1).to(dtype)
           for n in src.act_modules} if acts is not None and not acts.dynamic else {}
    out.update(kv_tensors(src, dtype))
    return {k: v.float().reshape(-1) for k, v in out.items()}


def write(src: Canonical, tmp: Path, final: Path, max_shard_bytes: int | None = None) -> None:
    check_exportable(src)
    dtype, fmt = src.float_dtype, ct_format(src)
    kwargs = {"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {}
    exact = {n: QuantizedWeight(q.codes, q.scales.to(dtype).float(), q.zeros, q.g_idx, q.scheme)
             for n, q in src.quantized.items()}  # scales as stored
    sidecar = {"modules": {n: fingerprint(q, scales=True) for n, q in exact.items()},
               "extra": {"scales": scale_fingerprints(expected_scales(src, dtype))}}
    write_checkpoint(src, tmp, final, NAME, quant_tensors(src, fmt, dtype), quantization_config(src), dtype,
                     extra=kv_tensors(src, dtype), sidecar=sidecar, family_names=True, **kwargs)


# ----------------------------------------------------------------------------- reading


def _scheme(w: dict[str, Any]) -> WeightScheme:
    return WeightScheme(bits=w["num_bits"], symmetric=w["symmetric"], group_size=w.get("group_size"),
                        type=w.get("type", "int"), per_tensor=w.get("strategy") == "tensor")


def _decode(tensors: dict[str, torch.Tensor], name: str, scheme: WeightScheme,
            fmt: str) -> QuantizedWeight:
    """One Linear's canonical form; pops the tensors it reads."""
    scales = tensors.pop(f"{name}.weight_scale").float()
    if fmt == "pack-quantized":
        out_f, in_f = (int(v) for v in tensors.pop(f"{name}.weight_shape"))
        codes = unpack_dense(tensors.pop(f"{name}.weight_packed"), scheme.bits, in_f, dim=1)
    else:
        weight = tensors.pop(f"{name}.weight")
        out_f, in_f = weight.shape
        codes = weight if scheme.type == "float" else (weight.to(torch.int16) + 128).to(torch.uint8)
    scales = scales.reshape(-1, 1).expand(out_f, 1).contiguous() if scheme.per_tensor else scales
    if scheme.type == "float":
        zeros = torch.zeros(out_f, 1, dtype=torch.uint8)
    elif scheme.symmetric:
        zeros = torch.full(scales.shape, 2 ** (scheme.bits - 1), dtype=torch.uint8)
    else:
        zeros = unpack_dense(tensors.pop(f"{name}.weight_zero_point"), scheme.bits, out_f, dim=0)
    g_idx = default_g_idx(in_f, scheme.group_size)
    return QuantizedWeight(codes=codes, scales=scales, zeros=zeros, g_idx=g_idx, scheme=scheme)


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """Float tensors (KV and input scales included, under their own names) and the Linears."""
    qcfg = read_config(path)["quantization_config"]
    fmt = qcfg.get("format", FORMAT)
    scheme = _scheme(qcfg["config_groups"]["group_0"]["weights"])
    tensors = load_tensors(path)
    marker = ".weight_packed" if fmt == "pack-quantized" else ".weight_scale"
    names = [k.removesuffix(marker) for k in tensors if k.endswith(marker)]
    quantized = {name: _decode(tensors, name, scheme, fmt) for name in names}
    for key in [k for k in tensors if k.endswith(("input_scale", ".k_scale", ".v_scale"))]:
        tensors.pop(key)
    return tensors, quantized


def read_scales(path: Path) -> dict[str, torch.Tensor]:
    """Deploy-time steps (x ≈ q·s), fp32: `N.input_scale` `[1]`, `A.k_scale` / `A.v_scale`
    `[1]` or `[kv_heads]`."""
    tensors = load_tensors(path)
    return {k: v.float().reshape(-1) for k, v in tensors.items()
            if k.endswith((".input_scale", ".k_scale", ".v_scale"))}


# ----------------------------------------------------------------------------- validation


def _check_args(report: Report, args: dict[str, Any], where: str, strategies: tuple[str, ...],
                types: tuple[str, ...] = ("int", "float")) -> dict[str, Any]:
    report.key(args, "num_bits", where, 8)
    report.key(args, "type", where, allowed=types)
    report.key(args, "symmetric", where, True)
    strategy = report.key(args, "strategy", where, allowed=strategies)
    dynamic = report.key(args, "dynamic", where, allowed=(True, False))
    report.check("static scales are per tensor (or per head)", f"{where}.strategy", dynamic or strategy != "token",
                 "strategy token needs dynamic true")
    return args


def _check_positive(report: Report, t: torch.Tensor | None, name: str) -> None:
    if t is not None:
        f = t.float()
        report.check("scale is positive and finite", name, bool(torch.isfinite(f).all() and (f > 0).all()),
                     "a step size must be > 0 and finite")


def validate(path: Path) -> Report:
    report, config, qcfg = start_validation(path, NAME, "compressed-tensors")
    if not qcfg:
        return report
    where = "quantization_config"
    fmt = report.key(qcfg, "format", where, allowed=FORMATS)
    report.key(qcfg, "quantization_status", where, "compressed")
    report.key(qcfg, "ignore", where)
    groups = report.key(qcfg, "config_groups", where) or {}
    if not report.check("config value", f"{where}.config_groups", len(groups) == 1,
                        f"expected one group, got {len(groups)}"):
        return report
    gname, group = next(iter(groups.items()))
    gwhere = f"{where}.config_groups.{gname}"
    report.key(group, "targets", gwhere, ["Linear"])
    report.key(group, "format", gwhere, fmt)
    w = report.key(group, "weights", gwhere) or {}
    wwhere = f"{gwhere}.weights"
    wtype = report.key(w, "type", wwhere, allowed=("int", "float"))
    bits = report.key(w, "num_bits", wwhere, allowed=(8,) if fmt != "pack-quantized" else (2, 3, 4, 8))
    sym = report.key(w, "symmetric", wwhere, allowed=(True, False) if fmt == "pack-quantized" else (True,))
    gs = report.key(w, "group_size", wwhere)
    strategy = report.key(w, "strategy", wwhere, allowed=("group", "channel", "tensor"))
    report.check("config value", f"{wwhere}.strategy", (strategy == "group") == (gs is not None),
                 f"strategy {strategy!r} with group_size {gs!r}")
    want_type = "float" if fmt in ("float-quantized", "naive-quantized") else "int"
    report.check("format matches the weights", f"{wwhere}.type", wtype == want_type,
                 f"format {fmt} stores {want_type} weights, got type {wtype!r}")
    if loads_dense(fmt, sym is not False):
        report.check("transformers load route", f"{where}.dequantize", qcfg.get("dequantize") is True,
                     "asymmetric pack-quantized needs \"dequantize\": true: transformers' compressed route builds "
                     "weight_zero_point unpacked and cannot take the packed layout vLLM reads")
    acts = group.get("input_activations")
    wants_acts = fmt in ("int-quantized", "float-quantized")
    report.check("format matches the activations", f"{gwhere}.input_activations", (acts is not None) == wants_acts,
                 f"format {fmt} {'needs' if wants_acts else 'has no'} input_activations")
    static_acts = False
    if acts is not None:
        _check_args(report, acts, f"{gwhere}.input_activations", ("token", "tensor"), types=(wtype,))
        static_acts = acts.get("dynamic") is False
    kv = qcfg.get("kv_cache_scheme")
    if kv is not None:
        _check_args(report, kv, f"{where}.kv_cache_scheme", ("tensor", "attn_head"), types=("float",))
        report.check("static scales are per tensor (or per head)", f"{where}.kv_cache_scheme.dynamic",
                     kv.get("dynamic") is False, "the KV cache takes static k_scale / v_scale")
    if not report.ok:
        return report
    tensors = load_tensors(path)
    spec = spec_for_config(config)
    skip = {spec.from_checkpoint(n) if spec else n for n in qcfg.get("ignore", []) if n != "lm_head"}

    def scale_shape(out_f: int, in_f: int) -> tuple[int, ...]:
        return (1,) if strategy == "tensor" else (out_f, 1) if strategy == "channel" else (out_f, in_f // gs)

    def per_linear(name: str, out_f: int, in_f: int) -> None:
        if gs is not None:
            report.check("group divides inputs", name, in_f % gs == 0, f"{in_f} inputs, group_size {gs}")
        scale = report.tensor(tensors, f"{name}.weight_scale", _FLOATS, scale_shape(out_f, in_f))
        _check_positive(report, scale, f"{name}.weight_scale")
        if fmt == "pack-quantized":
            report.tensor(tensors, f"{name}.weight_packed", torch.int32, (out_f, packed_len(in_f, bits)))
            shape = report.tensor(tensors, f"{name}.weight_shape", (torch.int64, torch.int32), (2,))
            if shape is not None and shape.shape == (2,):
                report.check("weight_shape value", f"{name}.weight_shape", shape.tolist() == [out_f, in_f],
                             f"expected {[out_f, in_f]}, got {shape.tolist()}")
        else:
            report.tensor(tensors, f"{name}.weight", torch.float8_e4m3fn if wtype == "float" else torch.int8,
                          (out_f, in_f))
        if sym:
            report.check("no zero point when symmetric", f"{name}.weight_zero_point",
                         f"{name}.weight_zero_point" not in tensors, "present but the scheme is symmetric")
        else:
            report.tensor(tensors, f"{name}.weight_zero_point", torch.int32,
                          (packed_len(out_f, bits), scale_shape(out_f, in_f)[-1]))
        if static_acts:
            _check_positive(report, report.tensor(tensors, f"{name}.input_scale", _FLOATS, (1,)),
                            f"{name}.input_scale")
        else:
            report.check("no input_scale when dynamic or weight-only", f"{name}.input_scale",
                         f"{name}.input_scale" not in tensors, "present but activations are not static")
        check_bias(report, tensors, config, name, out_f)

    expected = check_layout(report, path, config, tensors, skip, per_linear,
                            weight_is_quantized=fmt != "pack-quantized",
                            head_quantized="lm_head" not in qcfg.get("ignore", []))
    if kv is not None:
        _validate_kv(report, tensors, config, kv)
    report.facts.update({"format": fmt, "bits": bits, "group_size": gs, "symmetric": sym, "strategy": strategy,
                         "activations": _describe_args(acts), "kv cache": _describe_args(kv)})
    if report.ok and expected:
        _, quantized = read(path)
        check_fingerprints(report, path, quantized, read_scales(path))
        ct_load_layout.check(report, path, qcfg, tensors, quantized)
    return report


def _validate_kv(report: Report, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                 kv: dict[str, Any]) -> None:
    """k_scale / v_scale on every attention module, `[1]` or one per KV head (GQA: kv heads, not
    query heads)."""
    spec = spec_for_config(config)
    kv_heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    shape = (kv_heads, 1, 1) if kv["strategy"] == "attn_head" else (1,)
    for i in range(int(config["num_hidden_layers"])):
        for part in ("k", "v"):
            name = f"{spec.layers}.{i}.self_attn.{part}_scale"
            _check_positive(report, report.tensor(tensors, name, _FLOATS, shape), name)
    report.facts["KV heads"] = kv_heads


def _describe_args(args: dict[str, Any] | None) -> str:
    if not args:
        return "none"
    how = "dynamic" if args.get("dynamic") else "static"
    return f"{args.get('type')}{args.get('num_bits')} {args.get('strategy')} {how}"


def matches(path: Path) -> bool:
    try:
        return (read_config(path).get("quantization_config") or {}).get("quant_method") == "compressed-tensors"
    except (UserError, ValueError):
        return False
