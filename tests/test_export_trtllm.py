"""TensorRT-LLM export beyond W4A16_AWQ: W8A8 SmoothQuant (per-channel weights, per-token
activations, plugin layout), FP8 (static per-tensor), INT8 / FP8 KV-cache factors.

Round trip: the reader gives back the canonical codes, zeros, g_idx and scales exactly (fp32
where TensorRT-LLM stores fp32; fp16(s) for W4A16_AWQ; FP8 q/k/v requantized to their shared
scale as the format requires) and the activation / KV steps quantlab evaluates with. Every
validator rule is fed a deliberately broken export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quantlab.errors import UserError
from quantlab.export import api, trtllm
from quantlab.quant.activations import scale_from_absmax
from quantlab.quant.canonical import load_canonical, load_scales
from quantlab.quant.scheme import PRESETS, ActivationScheme, KVCacheScheme, WeightScheme
from test_export_helpers import (assert_same_weight, broken_copy, edit_config, edit_tensors, export_cases,
                                 make_act_canonical, rejected)

PER_TOKEN = ActivationScheme()
STATIC_FP8 = ActivationScheme(type="float", dynamic=False, granularity="tensor")
INT8_KV, FP8_KV = KVCacheScheme(type="int"), KVCacheScheme(type="float", granularity="tensor")
SYM4 = WeightScheme(bits=4, symmetric=True, group_size=64)
CASES = {  # name: (weights, activations, kv cache, quant_algo)
    "sq": (PRESETS["W8A16"], PER_TOKEN, INT8_KV, "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"),
    "fp8": (PRESETS["FP8_PER_TENSOR"], STATIC_FP8, FP8_KV, "FP8"),
    "awq": (SYM4, None, INT8_KV, "W4A16_AWQ"),
}
WEIGHTS = "rank0.safetensors"
L0 = "transformer.layers.0"


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tokenizer) -> dict[tuple[str, str], tuple[Path, Path]]:
    """(case, model_type) → (canonical dir, export dir)."""
    return export_cases(tmp_path_factory.mktemp("trt"), tokenizer, CASES, "trtllm")


def fused(names: list[str], ref) -> float:
    return max(float(ref[n].scales[0, 0]) for n in names)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_codes_and_scales(exported, case, model_type):
    canonical, out = exported[case, model_type]
    floats_ref, ref = load_canonical(canonical)
    floats, got = trtllm.read(out)
    assert set(got) == set(ref)
    for name, qw in ref.items():
        g = got[name]
        codes, scales = qw.codes, qw.scales
        if case == "fp8":  # q, k, v share one weight scale: the smaller ones are requantized to the max
            layer = name.rsplit(".", 1)[0]
            parts = [f"{layer}.{p}_proj" for p in "qkv"] if "self_attn" in name and "o_proj" not in name else [name]
            top = fused(parts, ref)
            ratio = float(scales[0, 0]) / top
            codes = codes if ratio == 1.0 else (codes.float() * ratio).to(torch.float8_e4m3fn)
            scales = torch.full_like(scales, top)
        elif case == "awq":
            scales = scales.half().float()
        assert_same_weight(g, codes, scales, qw, name)
    for name, t in floats_ref.items():
        assert torch.equal(floats[name].float(), t.half().float()), name


def test_fp8_requantized_parts_stay_within_e4m3_rounding(exported):
    canonical, out = exported["fp8", "llama"]
    _, ref = load_canonical(canonical)
    _, got = trtllm.read(out)
    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert len({float(ref[n].scales[0, 0]) for n in names}) > 1  # the case really requantizes
    for n in names:
        w, back = ref[n].dequantize(), got[n].dequantize()
        assert ((back - w).abs() <= w.abs() * 2**-4 + float(got[n].scales[0, 0]) * 2**-9).all(), n


@pytest.mark.parametrize("case", list(CASES))
def test_activation_and_kv_steps(exported, case):
    """The activation / KV steps TensorRT-LLM gets are the ones quantlab's evaluation used."""
    canonical, out = exported[case, "qwen2"]
    absmax = load_scales(canonical)
    weights, acts, kv, _ = CASES[case]
    kind = "int8" if kv.type == "int" else "fp8"
    steps = trtllm.read_scales(out)
    for i in range(2):
        a = f"model.layers.{i}.self_attn"
        amax = torch.maximum(absmax[f"{a}.k_absmax"].max(), absmax[f"{a}.v_absmax"].max())
        want = scale_from_absmax(amax, kind).reshape(1)
        assert torch.equal(steps[f"{a}.k_scale"], want) and torch.equal(steps[f"{a}.v_scale"], want)
        if case == "fp8":
            q = f"{a}.q_proj"
            assert torch.equal(steps[f"{q}.input_scale"], scale_from_absmax(absmax[f"{q}.input_absmax"], "fp8")
                               .reshape(1))
    assert not any(k.endswith("input_scale") for k in steps) or case == "fp8"
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == CASES[case][3]
    assert config["quantization"]["kv_cache_quant_algo"] == {"int": "INT8", "float": "FP8"}[kv.type]


def test_smoothquant_plugin_layout(exported):
    canonical, out = exported["sq", "qwen2"]
    t = load_file(out / WEIGHTS)
    _, ref = load_canonical(canonical)
    q, k, v = (ref[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv")
    qkv = t[f"{L0}.attention.qkv.weight"]
    assert qkv.dtype == torch.int8 and qkv.shape == (128, 64)  # (4 + 2·2 heads)·16, hidden: GQA rows
    assert torch.equal(qkv, torch.cat([x.codes.to(torch.int16) - 128 for x in (q, k, v)]).to(torch.int8))
    assert torch.equal(t[f"{L0}.attention.qkv.per_channel_scale"], torch.cat([x.scales for x in (q, k, v)]).T)
    # fc = gate_proj, gate = up_proj (TensorRT-LLM's naming)
    assert torch.equal(t[f"{L0}.mlp.fc.weight"], (ref["model.layers.0.mlp.gate_proj"].codes.to(torch.int16) - 128)
                       .to(torch.int8))
    assert torch.equal(t[f"{L0}.mlp.gate.weight"], (ref["model.layers.0.mlp.up_proj"].codes.to(torch.int16) - 128)
                       .to(torch.int8))
    for module, inputs in (("attention.dense", 64), ("mlp.proj", 128)):
        assert torch.equal(t[f"{L0}.{module}.smoother"], torch.ones(1, inputs))
    assert not any(k.endswith(("smoother", "act_scale")) for k in t if ".qkv." in k or ".fc." in k or ".gate." in k)
    for norm in ("input_layernorm", "post_layernorm"):
        assert torch.equal(t[f"{L0}.{norm}.scale_to_int"], torch.ones(1))
    assert t[f"{L0}.attention.kv_cache_scaling_factor"].dtype == torch.float32
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"quant_algo": "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
                                      "kv_cache_quant_algo": "INT8", "group_size": 128, "has_zero_point": False,
                                      "pre_quant_scale": False, "exclude_modules": ["lm_head"]}


def test_fp8_layout(exported):
    _, out = exported["fp8", "llama"]
    t = load_file(out / WEIGHTS)
    for module in trtllm.MODULES:
        assert t[f"{L0}.{module}.weight"].dtype == torch.float8_e4m3fn
        for factor in ("weights_scaling_factor", "activation_scaling_factor"):
            assert t[f"{L0}.{module}.{factor}"].shape == (1,) and t[f"{L0}.{module}.{factor}"].dtype == torch.float32
    assert not any("scale_to_int" in k or "smoother" in k or "per_channel_scale" in k for k in t)


@pytest.mark.parametrize("weights,acts,match", [
    (PRESETS["W8A16"], ActivationScheme(dynamic=False, granularity="tensor"), "per token at run time"),
    (PRESETS["FP8"], STATIC_FP8, "per-tensor FP8 weight scales; scheme FP8_c"),
    (PRESETS["FP8_PER_TENSOR"], ActivationScheme(type="float"), "static per-tensor scale"),
    (SYM4, PER_TOKEN, "W4A8 is not exported"),
], ids=["sq-static", "fp8-per-channel", "fp8-dynamic", "w4a8"])
def test_refused_with_the_reason(tmp_path, tokenizer, weights, acts, match):
    canonical = make_act_canonical(tmp_path, tokenizer, "llama", weights, acts)
    with pytest.raises(UserError, match=match):
        api.export(canonical, tmp_path / "out", "trtllm")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- broken exports


def _swap(a: str, b: str, suffixes: tuple[str, ...]):
    def fn(t):
        for s in suffixes:
            t[f"{L0}.{a}.{s}"], t[f"{L0}.{b}.{s}"] = t[f"{L0}.{b}.{s}"], t[f"{L0}.{a}.{s}"]
    return fn


def _set(name: str, fn):
    return lambda t: t.update({name: fn(t[name])})


def _rename(old: str, new: str):
    return lambda t: t.update({new: t.pop(old)})


# (case, what breaks, tensors edit or None, config edit or None, subject, rule)
BROKEN = [
    ("sq", "name", _rename(f"{L0}.mlp.proj.smoother", f"{L0}.mlp.proj.smooth"), None,
     f"{L0}.mlp.proj.smoother", "present"),
    ("sq", "unknown name", _rename(f"{L0}.mlp.proj.smoother", f"{L0}.mlp.proj.smooth"), None,
     f"{L0}.mlp.proj.smooth", "known tensor"),
    ("sq", "dtype", _set(f"{L0}.attention.qkv.per_channel_scale", lambda x: x.half()), None,
     f"{L0}.attention.qkv.per_channel_scale", "dtype"),
    ("sq", "shape", _set(f"{L0}.mlp.fc.per_channel_scale", lambda x: x.reshape(-1)), None,
     f"{L0}.mlp.fc.per_channel_scale", "shape"),
    ("sq", "weight dtype", _set(f"{L0}.mlp.gate.weight", lambda x: x.float()), None, f"{L0}.mlp.gate.weight", "dtype"),
    ("sq", "smoother not folded", _set(f"{L0}.attention.dense.smoother", lambda x: x * 2), None,
     f"{L0}.attention.dense.smoother", "smoother is ones (SmoothQuant scales folded)"),
    ("sq", "norm scale", _set(f"{L0}.post_layernorm.scale_to_int", lambda x: x * 127), None,
     f"{L0}.post_layernorm.scale_to_int", "scale_to_int is 1 (per-token activations)"),
    ("sq", "weight scale sign", _set(f"{L0}.mlp.proj.per_channel_scale", lambda x: -x), None,
     f"{L0}.mlp.proj.per_channel_scale", "scale is positive and finite"),
    ("sq", "weight scale semantics", _set(f"{L0}.mlp.proj.per_channel_scale", lambda x: x * 127), None,
     "model.layers.0.mlp.down_proj", "decoded scales"),
    ("sq", "fc/gate swap", _swap("mlp.fc", "mlp.gate", ("weight", "per_channel_scale")), None,
     "model.layers.0.mlp.gate_proj", "decoded codes"),
    ("sq", "KV factor semantics", _set(f"{L0}.attention.kv_cache_scaling_factor", lambda x: x * 127), None,
     "model.layers.0.self_attn.k_scale", "decoded scales"),
    ("sq", "KV factor sign", _set(f"{L0}.attention.kv_cache_scaling_factor", lambda x: -x), None,
     f"{L0}.attention.kv_cache_scaling_factor", "scale is positive and finite"),
    ("sq", "KV factor without kv algo", None, lambda c: c["quantization"].update(kv_cache_quant_algo=None),
     f"{L0}.attention.kv_cache_scaling_factor", "known tensor"),
    ("sq", "GQA head counts", None, lambda c: c.update(num_key_value_heads=3), "config.num_key_value_heads",
     "GQA head counts"),
    ("sq", "GQA rows", None, lambda c: c.update(num_key_value_heads=1), f"{L0}.attention.qkv.weight", "shape"),
    ("sq", "attn_bias", None, lambda c: c.update(attn_bias=False), f"{L0}.attention.qkv.bias", "known tensor"),
    ("sq", "quant_algo", None, lambda c: c["quantization"].update(quant_algo="W8A8_SQ_PER_TENSOR_PLUGIN"),
     "config.quantization.quant_algo", "config value"),
    ("fp8", "activation semantics", _set(f"{L0}.mlp.proj.activation_scaling_factor", lambda x: x * 448), None,
     "model.layers.0.mlp.down_proj.input_scale", "decoded scales"),
    ("fp8", "weight scale shape", _set(f"{L0}.mlp.fc.weights_scaling_factor", lambda x: x.expand(2).clone()), None,
     f"{L0}.mlp.fc.weights_scaling_factor", "shape"),
    ("fp8", "weight dtype", _set(f"{L0}.attention.qkv.weight", lambda x: x.view(torch.int8)), None,
     f"{L0}.attention.qkv.weight", "dtype"),
    ("fp8", "missing activation factor", lambda t: t.pop(f"{L0}.attention.dense.activation_scaling_factor"), None,
     f"{L0}.attention.dense.activation_scaling_factor", "present"),
    ("fp8", "fc/gate swap", _swap("mlp.fc", "mlp.gate", ("weight", "weights_scaling_factor")), None,
     "model.layers.0.mlp.up_proj", "decoded codes"),
    ("awq", "prequant scale", _set(f"{L0}.mlp.proj.prequant_scaling_factor", lambda x: x * 2), None,
     f"{L0}.mlp.proj.prequant_scaling_factor", "prequant scale is ones (AWQ scales folded)"),
    ("awq", "KV factor shape", _set(f"{L0}.attention.kv_cache_scaling_factor", lambda x: x.reshape(1, 1)), None,
     f"{L0}.attention.kv_cache_scaling_factor", "shape"),
]


@pytest.mark.parametrize("case,what,tensors,config,subject,rule", BROKEN, ids=[f"{c}-{w}" for c, w, *_ in BROKEN])
def test_broken_export_is_rejected(exported, case, what, tensors, config, subject, rule):
    _, good = exported[case, "qwen2"]
    assert api.inspect(good).ok
    bad = broken_copy(good, what.replace(" ", "_").replace("/", "_"))
    if tensors is not None:
        edit_tensors(bad, tensors, WEIGHTS)
    if config is not None:
        edit_config(bad, config)
    message = rejected(bad, subject, rule)
    assert subject in message or "more" in message


def test_good_exports_check_scales_and_heads(exported):
    report = api.inspect(exported["sq", "llama"][1])
    assert report.ok and "skipped" not in report.facts
    rules = report.rule_counts()
    for rule in ("decoded codes", "decoded scales", "GQA head counts", "smoother is ones (SmoothQuant scales folded)",
                 "scale_to_int is 1 (per-token activations)"):
        assert rules[rule][0] > 0 and rules[rule][1] == 0, rule
    assert report.facts["heads / KV heads"] == "4 / 2"
