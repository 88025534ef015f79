"""PaddleNLP high-performance inference checkpoint (read by
`paddlenlp/experimental/transformers/{llama,qwen2}/modeling.py` `set_state_dict` /
`set_quant_scale` and the scale loaders of `paddlenlp/experimental/model_utils.py`).

Layout: `model.safetensors` (sharded with an index past the size limit, the names PaddleNLP's
safetensors loader reads) holding the Paddle state dict — names under the model prefix
(`llama.`, `qwen2.`: `{p}.embed_tokens.weight`, `{p}.layers.N.self_attn.q_proj.weight`,
`{p}.norm.weight`, ...), Linear weights in Paddle's `[in, out]` layout, `lm_head.weight`
`[hidden, vocab]` unless the embedding is tied; `config.json` (the model config, `dtype`, and
`quantization_config` with `quant_type`, `shift`, `smooth`, `shift_smooth_all_linears`); the
PTQ scale tables `weight_scales.json`, `act_scales.json`, `cachekv_scales.json` built by
`quantlab.quant.scale_tables` (absmax values; keys and GQA rules there).

quant_type follows the canonical scheme:
  * `weight_only_int8` / `weight_only_int4` (symmetric per-channel 8- or 4-bit weights, no
    activation or KV quantization): PaddleNLP quantizes **float** weights itself when it loads
    them (`weight_quantize(w, algo)`, per output channel, absmax/127 or absmax/7), so the
    weights are stored dequantized, `(q − z)·s`, in the model's float dtype. `weight_scales.json`
    still lists each channel's `qmax·s` (qmax 127 or 7), which is what quantlab's reader uses
    to recover the codes exactly; Paddle's own requantization reproduces them where a row's
    codes reach ±qmax (a row whose largest code is −2^(b−1) gets a slightly larger step).
  * `a8w8` / `a8w8c8` (symmetric per-channel int8 weights, int8 activations, and for c8 an
    int8 KV cache): Linear weights int8 = the signed code `q − 128` (`round(127·w/absmax)`
    with absmax = 127·s); the loader casts them to int8 and rescales by
    `weight_scales / (127·127·(1/act_scale))`. The validator also accepts the codes held in a
    float tensor, as PaddleSlim's converted checkpoints store them. PaddleNLP's a8w8 kernels take
    static per-tensor activation scales: a canonical form evaluated with dynamic ones is
    exported with its calibrated per-tensor ranges (the act_ranges stage stores them for this).
  * `a8w8_fp8` (per-tensor FP8 weights, FP8 activations): the e4m3 codes held in the model's
    float dtype (PaddleNLP reads safetensors through numpy, which has no float8; every e4m3
    value is exact in fp16, bf16 and fp32); per-tensor absmax in `weight_scales.json`; the
    loader rescales q, k and v to their max itself (`PerTensorWeightScalesLoader`).
Our SmoothQuant folds its scales into norms and Linears, so `shift`, `smooth` and
`shift_smooth_all_linears` are false and no `.layer.` keys, shift biases or smooth weights
exist (the reading of formats.md's shift/smooth rule that PaddleNLP implements: the loader
picks `ptq_scales_map.json` when `shift_smooth_all_linears` is false).
FP8 KV caches are refused: the a8w8c8 loader (`CacheScaleLoader`) computes int8 steps
(127/absmax) only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from quantlab.file_checks import read_json_object
from quantlab.errors import UserError
from quantlab.export.checks import Report
from quantlab.export.shards import DEFAULT_MAX_SHARD, check_index, load_sharded, save_sharded
from quantlab.export.source import (Canonical, check_fingerprints, copy_side_files, fingerprint, linear_shapes,
                                    scale_fingerprints, write_sidecar)
from quantlab.models.arch import ARCH_SPECS
from quantlab.quant.activations import FP8_MAX, scale_from_absmax
from quantlab.quant.primitives import QuantizedWeight, default_g_idx
from quantlab.quant.scale_tables import FILES, PADDLE_PREFIX, paddle_name, scale_tables, signed_qmax, write_scale_tables
from quantlab.quant.scheme import WeightScheme

NAME = "paddlenlp"
CARRIES_ACTIVATIONS = True
QUANT_TYPES = ("weight_only_int8", "weight_only_int4", "a8w8", "a8w8c8", "a8w8_fp8")
MODEL_TYPES = ("llama", "qwen2")
WEIGHT_SCALES, ACT_SCALES, CACHEKV_SCALES = FILES
# the act_scales keys PaddleNLP's ptq_scales_map.json reads (k, v and up share their input)
ACT_KEYS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def quant_type(src: Canonical) -> str:
    scheme, acts, kv = src.scheme, src.activations, src.kv_cache
    if acts is None:
        return f"weight_only_int{scheme.bits}"
    if scheme.type == "float":
        return "a8w8_fp8"
    return "a8w8c8" if kv is not None else "a8w8"


def check_exportable(src: Canonical) -> str:
    """Refuse what no PaddleNLP quant_type holds; returns the quant_type."""
    if src.model_type not in MODEL_TYPES:
        raise UserError(f"{NAME}: model_type {src.model_type!r} is not mapped; supported: {', '.join(MODEL_TYPES)}")
    scheme, acts, kv = src.scheme, src.activations, src.kv_cache
    qt = quant_type(src)
    if qt.startswith("weight_only"):
        if scheme.type != "int" or scheme.bits not in (4, 8) or not scheme.symmetric or scheme.group_size is not None:
            raise UserError(f"{NAME}: weight-only PaddleNLP inference quantizes per output channel, symmetric, to "
                            f"int8 or int4; scheme {scheme.name} does not fit (use W8A16, or bits 4 with "
                            "symmetric true and group_size null)")
        if kv is not None:
            raise UserError(f"{NAME}: a KV cache quantized without activations has no PaddleNLP quant_type "
                            "(a8w8c8 quantizes both)")
    elif qt == "a8w8_fp8":
        if not scheme.per_tensor or acts.type != "float":
            raise UserError(f"{NAME}: a8w8_fp8 takes per-tensor FP8 weights and FP8 activations; got weights "
                            f"{scheme.name}, activations {acts.name} (use FP8_PER_TENSOR with float activations)")
        if kv is not None:
            raise UserError(f"{NAME}: a8w8_fp8 has no KV-cache scales in PaddleNLP's loaders (a8w8c8 takes an int8 "
                            "KV cache)")
    else:
        if scheme.type != "int" or scheme.bits != 8 or not scheme.symmetric or scheme.group_size is not None:
            raise UserError(f"{NAME}: {qt} takes symmetric per-channel int8 weights; scheme {scheme.name} does not "
                            "fit (use W8A16 weights with the act_ranges stage)")
        if acts.type != "int":
            raise UserError(f"{NAME}: int8 weights with FP8 activations have no PaddleNLP quant_type")
        if kv is not None and kv.type != "int":
            raise UserError(f"{NAME}: a8w8c8 takes an int8 KV cache (CacheScaleLoader computes 127/absmax); "
                            "use kv_cache type int")
    if src.unquantized_linears():
        raise UserError(f"{NAME}: Linears left in float ({src.unquantized_linears()[0]}, ...) are not skipped by "
                        f"PaddleNLP's fused {qt} layers")
    if acts is not None:
        src.require_activations_on_quantized(NAME)
    src.require_kv_on_every_layer(NAME)
    src.require_default_g_idx(NAME)
    return qt


def stored_weight(qw: QuantizedWeight, qt: str, dtype: torch.dtype) -> torch.Tensor:
    """One Linear's `[in, out]` Paddle weight."""
    if qt.startswith("weight_only"):
        w = qw.dequantize().to(dtype)
    elif qt == "a8w8_fp8":
        w = qw.codes.float().to(dtype)
    else:
        w = (qw.codes.to(torch.int16) - 128).to(torch.int8)
    return w.t().contiguous()


def paddle_config(src: Canonical, qt: str) -> dict[str, Any]:
    config = dict(src.config)
    config.pop("torch_dtype", None)
    config["dtype"] = str(src.float_dtype).removeprefix("torch.")
    config["quantization_config"] = {"quant_type": qt, "shift": False, "smooth": False,
                                     "shift_smooth_all_linears": False}
    return config


def expected_scales(src: Canonical) -> dict[str, torch.Tensor]:
    """What `read_scales` must give back: the canonical steps (absmax/127 or /448)."""
    out: dict[str, torch.Tensor] = {}
    acts, kv = src.activations, src.kv_cache
    if acts is not None:
        out.update({f"{n}.input_scale": scale_from_absmax(src.input_absmax(n), acts.kind).reshape(1)
                    for n in src.act_modules})
    if kv is not None:
        for attn in src.kv_modules:
            for part, absmax in zip("kv", src.kv_absmax(attn)):
                amax = absmax if kv.granularity == "head" else absmax.max().expand_as(absmax)
                out[f"{attn}.{part}_scale"] = scale_from_absmax(amax, kv.kind)
    return out


def write(src: Canonical, tmp: Path, final: Path, max_shard_bytes: int | None = None) -> None:
    qt = check_exportable(src)
    dtype, model_type = src.float_dtype, src.model_type
    tensors: dict[str, torch.Tensor] = {}
    for name, t in src.tensors.items():
        if name == "lm_head.weight":
            tensors[name] = t.to(dtype).t().contiguous()  # Paddle's LM head is [hidden, vocab]
        else:
            tensors[paddle_name(name, model_type)] = t.to(dtype) if t.is_floating_point() else t
    for name, qw in src.quantized.items():
        tensors[f"{paddle_name(name, model_type)}.weight"] = stored_weight(qw, qt, dtype)
    tmp.mkdir(parents=True)
    save_sharded(dict(sorted(tensors.items())), tmp, max_shard_bytes or DEFAULT_MAX_SHARD)
    (tmp / "config.json").write_text(json.dumps(paddle_config(src, qt), indent=2) + "\n")
    write_scale_tables(tmp, scale_tables(src.config, src.quant_config, src.quantized, src.scales))
    copy_side_files(src.path, tmp)
    write_sidecar(src, final, tmp, NAME, {"quant_type": qt},
                  modules={n: fingerprint(q, scales=True) for n, q in src.quantized.items()},
                  extra={"scales": scale_fingerprints(expected_scales(src))})


# ----------------------------------------------------------------------------- reading


def _read_json(path: Path, name: str) -> dict[str, Any]:
    f = path / name
    return read_json_object(f) if f.is_file() else {}


def _hf_name(paddle: str, prefix: str) -> str:
    return paddle if paddle == "lm_head.weight" else f"model.{paddle.removeprefix(prefix + '.')}"


def _decode(weight: torch.Tensor, absmax: Any, qt: str) -> QuantizedWeight:
    """One Linear from its `[in, out]` Paddle weight and its weight_scales.json entry."""
    w = weight.t().contiguous()
    out_f, in_f = w.shape
    if qt == "a8w8_fp8":
        scheme = WeightScheme(type="float", bits=8, symmetric=True, group_size=None, per_tensor=True)
        step = torch.tensor(float(absmax) / FP8_MAX, dtype=torch.float64).float()
        return QuantizedWeight(w.float().to(torch.float8_e4m3fn), step.expand(out_f, 1).contiguous(),
                               torch.zeros(out_f, 1, dtype=torch.uint8), torch.zeros(in_f, dtype=torch.int32), scheme)
    bits = 4 if qt == "weight_only_int4" else 8
    step = (torch.tensor(absmax, dtype=torch.float64) / signed_qmax(bits)).float().reshape(out_f, 1)
    zero = 2 ** (bits - 1)
    if qt.startswith("weight_only"):
        signed = torch.round(w.double() / step.double())
    else:
        signed = w.to(torch.int16)
    codes = (signed.to(torch.int16) + zero).to(torch.uint8)
    scheme = WeightScheme(bits=bits, symmetric=True, group_size=None)
    return QuantizedWeight(codes, step, torch.full((out_f, 1), zero, dtype=torch.uint8),
                           default_g_idx(in_f, None), scheme)


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """Back to Hugging Face names and `[out, in]` layout; codes from the weights and the tables."""
    config = read_json_object(path / "config.json")
    qt = config["quantization_config"]["quant_type"]
    prefix = PADDLE_PREFIX.get(config["model_type"], config["model_type"])
    weight_scales = _read_json(path, WEIGHT_SCALES)
    floats: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    for name, t in load_sharded(path).items():
        key = name.removesuffix(".weight") + ".weight_quanter"
        if key in weight_scales:
            quantized[_hf_name(name, prefix).removesuffix(".weight")] = _decode(t, weight_scales[key], qt)
        else:
            floats[_hf_name(name, prefix)] = t.t().contiguous() if name == "lm_head.weight" else t
    return floats, quantized


def read_scales(path: Path) -> dict[str, torch.Tensor]:
    """Deploy-time steps under Hugging Face names: `N.input_scale` from act_scales.json (absmax/127
    or /448 by quant_type), `A.k_scale` / `A.v_scale` `[kv_heads]` from cachekv_scales.json,
    read with PaddleNLP's stride (entry j·heads/kv_heads for KV head j)."""
    config = read_json_object(path / "config.json")
    qt = config["quantization_config"]["quant_type"]
    prefix = PADDLE_PREFIX.get(config["model_type"], config["model_type"])
    kind = "fp8" if qt == "a8w8_fp8" else "int8"
    out = {}
    for key, absmax in _read_json(path, ACT_SCALES).items():
        name = _hf_name(key.removesuffix(".activation_quanter"), prefix)
        out[f"{name}.input_scale"] = scale_from_absmax(torch.tensor([absmax], dtype=torch.float32), kind)
    heads, kv_heads = _head_counts(config)
    for key, values in _read_json(path, CACHEKV_SCALES).items():
        attn, _, which = key.removesuffix(".activation_quanter").rpartition(".")
        part = {"cachek_matmul": "k", "cachev_matmul": "v"}.get(which)
        if part is not None:
            per_kv = torch.tensor(values, dtype=torch.float32)[:: heads // kv_heads]
            out[f"{_hf_name(attn, prefix)}.{part}_scale"] = scale_from_absmax(per_kv, "int8")
    return out


def _head_counts(config: dict[str, Any]) -> tuple[int, int]:
    heads = int(config["num_attention_heads"])
    return heads, int(config.get("num_key_value_heads") or heads)


# ----------------------------------------------------------------------------- validation


def validate(path: Path) -> Report:
    report = Report(NAME, str(path))
    if not report.check("file", "config.json", (path / "config.json").is_file(), "missing"):
        return report
    config = read_json_object(path / "config.json")
    qcfg = report.key(config, "quantization_config", "config.json") or {}
    where = "quantization_config"
    qt = report.key(qcfg, "quant_type", where, allowed=QUANT_TYPES)
    for key in ("shift", "smooth", "shift_smooth_all_linears"):
        report.key(qcfg, key, where, False)
    model_type = report.key(config, "model_type", "config.json", allowed=MODEL_TYPES)
    report.key(config, "dtype", "config.json", allowed=("float32", "float16", "bfloat16"))
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        report.key(config, key, "config.json")
    heads, kv_heads = _head_counts(config) if "num_attention_heads" in config else (0, 0)
    report.check("GQA head counts", "config.json.num_key_value_heads", 0 < kv_heads <= heads and heads % kv_heads == 0,
                 f"{kv_heads} KV heads do not divide {heads} attention heads")
    needs = [WEIGHT_SCALES] + ([ACT_SCALES] if qt and qt.startswith("a8w8") else []) + \
        ([CACHEKV_SCALES] if qt == "a8w8c8" else [])
    for fname in needs:
        report.check("file", fname, (path / fname).is_file(), f"missing (quant_type {qt} reads it)")
    if qt != "a8w8c8" and _read_json(path, CACHEKV_SCALES):
        report.check("file", CACHEKV_SCALES, False, f"KV-cache scales, but quant_type {qt} has no int8 KV cache")
    if not report.ok:
        return report
    try:
        tensors = load_sharded(path)
    except FileNotFoundError as exc:
        report.check("weights file", str(path / "model.safetensors"), False, str(exc))
        return report
    check_index(report, path)
    prefix = PADDLE_PREFIX[model_type]
    spec = ARCH_SPECS[model_type]
    _check_tensors(report, config, tensors, qt, prefix, spec)
    _check_tables(report, path, config, qt, prefix, spec)
    report.facts.update({"quant_type": qt, "model prefix": prefix, "heads / KV heads": f"{heads} / {kv_heads}",
                         "tables": ", ".join(f for f in FILES if (path / f).is_file())})
    if report.ok:
        _, quantized = read(path)
        check_fingerprints(report, path, quantized, read_scales(path))
    return report


def _check_tensors(report: Report, config: dict[str, Any], tensors: dict[str, torch.Tensor], qt: str, prefix: str,
                   spec) -> None:
    """Names, dtypes and `[in, out]` shapes of the Paddle state dict."""
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    known: set[str] = set()

    def expect(name: str, dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        known.add(name)
        return report.tensor(tensors, name, dtype, shape)

    int8 = qt in ("a8w8", "a8w8c8")
    linear_dtype = (torch.int8, *_FLOATS) if int8 else _FLOATS
    for i in range(int(config["num_hidden_layers"])):
        layer = f"{prefix}.layers.{i}"
        for lin, (out_f, in_f) in linear_shapes(config, spec).items():
            w = expect(f"{layer}.{lin}.weight", linear_dtype, (in_f, out_f))
            if w is not None and w.is_floating_point():
                _check_float_codes(report, w, f"{layer}.{lin}.weight", qt)
            if spec.qkv_bias and lin in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                expect(f"{layer}.{lin}.bias", _FLOATS, (out_f,))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            expect(f"{layer}.{norm}.weight", _FLOATS, (hidden,))
    expect(f"{prefix}.embed_tokens.weight", _FLOATS, (vocab, hidden))
    expect(f"{prefix}.norm.weight", _FLOATS, (hidden,))
    if not config.get("tie_word_embeddings", False):
        expect("lm_head.weight", _FLOATS, (hidden, vocab))
    for name in tensors:
        report.check("known tensor", name, name in known, f"not a {prefix} tensor PaddleNLP's inference model reads")


def _check_float_codes(report: Report, w: torch.Tensor, name: str, qt: str) -> None:
    """a8w8 weights may also come as floats (PaddleSlim's converted checkpoints): then they must
    hold the int8 codes; a8w8_fp8 weights must hold e4m3 codes."""
    f = w.float()
    if qt == "a8w8_fp8":
        report.check("FP8 codes in a float tensor", name, bool(torch.equal(f.to(torch.float8_e4m3fn).float(), f)),
                     "values that e4m3 cannot represent (dequantized weights instead of FP8 codes?)")
    elif qt in ("a8w8", "a8w8c8"):
        report.check("int8 codes in a float tensor", name,
                     bool(torch.equal(f.round(), f) and ((f >= -128) & (f <= 127)).all()),
                     "values that are not int8 codes (dequantized weights instead of round(127·w/absmax)?)")


def _positive(values: Any) -> bool:
    t = torch.tensor(values, dtype=torch.float64)
    return bool(torch.isfinite(t).all() and (t > 0).all())


def _check_tables(report: Report, path: Path, config: dict[str, Any], qt: str, prefix: str, spec) -> None:
    """Keys and value shapes of the scale tables; GQA: cachekv lists hold num_attention_heads
    entries, each KV head's absmax repeated for the query heads sharing it."""
    weights, acts, cache = (_read_json(path, f) for f in FILES)
    heads, kv_heads = _head_counts(config)
    group = heads // kv_heads
    shapes = linear_shapes(config, spec)
    for i in range(int(config["num_hidden_layers"])):
        layer = f"{prefix}.layers.{i}"
        for lin, (out_f, _) in shapes.items():
            key = f"{layer}.{lin}.weight_quanter"
            value = weights.get(key)
            if not report.check("scale table key", f"{WEIGHT_SCALES}:{key}", value is not None, "missing"):
                continue
            if qt == "a8w8_fp8":
                ok = isinstance(value, (int, float))
                report.check("per-tensor FP8 weight absmax", f"{WEIGHT_SCALES}:{key}", ok,
                             f"expected one float, got {type(value).__name__}")
            else:
                ok = isinstance(value, list) and len(value) == out_f
                report.check("per-channel weight absmax", f"{WEIGHT_SCALES}:{key}", ok,
                             f"expected a list of {out_f} (one per output channel), got "
                             f"{len(value) if isinstance(value, list) else type(value).__name__}")
            if ok:
                report.check("absmax is positive and finite", f"{WEIGHT_SCALES}:{key}", _positive(value),
                             "an absmax must be > 0 and finite")
        if qt.startswith("a8w8"):
            for lin in ACT_KEYS:
                key = f"{layer}.{lin}.activation_quanter"
                value = acts.get(key)
                if report.check("scale table key", f"{ACT_SCALES}:{key}", value is not None, "missing"):
                    report.check("per-tensor activation absmax", f"{ACT_SCALES}:{key}",
                                 isinstance(value, (int, float)) and _positive([value]),
                                 f"expected one positive float, got {value!r}")
        if qt == "a8w8c8":
            for which in ("cachek_matmul", "cachev_matmul"):
                key = f"{layer}.self_attn.{which}.activation_quanter"
                value = cache.get(key)
                if not report.check("scale table key", f"{CACHEKV_SCALES}:{key}", value is not None, "missing"):
                    continue
                ok = isinstance(value, list) and len(value) == heads
                report.check("GQA head counts", f"{CACHEKV_SCALES}:{key}", ok,
                             f"expected {heads} entries (num_attention_heads, even under GQA), got "
                             f"{len(value) if isinstance(value, list) else type(value).__name__}")
                if ok:
                    t = torch.tensor(value, dtype=torch.float64).reshape(kv_heads, group)
                    report.check("GQA heads share their KV head's absmax", f"{CACHEKV_SCALES}:{key}",
                                 bool((t == t[:, :1]).all()),
                                 f"entries of one KV head differ; PaddleNLP reads only every {group}th")
                    report.check("absmax is positive and finite", f"{CACHEKV_SCALES}:{key}", _positive(value),
                                 "an absmax must be > 0 and finite")


def matches(path: Path) -> bool:
    f = path / "config.json"
    if not f.is_file():
        return False
    try:
        qcfg = json.loads(f.read_text()).get("quantization_config") or {}
    except ValueError:
        return False
    return "quant_method" not in qcfg and "quant_type" in qcfg  # the validator checks the value
