"""compressed-tensors beyond pack-quantized: int-quantized (W8A8, static `input_scale` or
dynamic per token), float-quantized (FP8), naive-quantized (FP8 weight-only) and the FP8
`kv_cache_scheme` with `k_scale` / `v_scale` (per tensor or per KV head).

Checked three ways: quantlab's reader gives the canonical codes and scales back exactly;
transformers + compressed-tensors load each export on CPU and compute what quantlab's
fake-quant model (weights, activations and KV cache) computes; the validator rejects
deliberately broken exports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantlab.errors import UserError
from quantlab.eval.fake_quant import apply_from_canonical
from quantlab.export import api, compressed_tensors as ct
from quantlab.quant.activations import scale_from_absmax
from quantlab.quant.canonical import load_canonical, load_fake_quant_model, load_scales
from quantlab.quant.scheme import PRESETS, ActivationScheme, KVCacheScheme, WeightScheme
from test_export_helpers import assert_same_weight, broken_copy, edit_config, edit_tensors, make_act_canonical, rejected

STATIC = ActivationScheme(dynamic=False, granularity="tensor")
STATIC_FP8 = ActivationScheme(type="float", dynamic=False, granularity="tensor")
FP8_KV, FP8_KV_HEAD = KVCacheScheme(type="float", granularity="tensor"), KVCacheScheme(type="float", granularity="head")
CASES = {  # name: (model_type, weights, activations, kv cache, format)
    "w8a8-static-kv": ("llama", PRESETS["W8A16"], STATIC, FP8_KV, "int-quantized"),
    "w8a8-dynamic": ("qwen2", PRESETS["W8A16"], ActivationScheme(), None, "int-quantized"),
    "fp8-static-kv-head": ("qwen2", PRESETS["FP8_PER_TENSOR"], STATIC_FP8, FP8_KV_HEAD, "float-quantized"),
    "fp8-channel-dynamic": ("llama", PRESETS["FP8"], ActivationScheme(type="float"), None, "float-quantized"),
    "fp8-weight-only": ("llama", PRESETS["FP8"], None, None, "naive-quantized"),
}
Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tokenizer) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("ct")
    out = {}
    for case, (model_type, weights, acts, kv, _) in CASES.items():
        canonical = make_act_canonical(root / case, tokenizer, model_type, weights, acts, kv)
        target = canonical.parent / "export" / "ct"
        api.export(canonical, target, "compressed-tensors")
        out[case] = canonical, target
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_exact(exported, case):
    canonical, out = exported[case]
    floats_ref, ref = load_canonical(canonical)
    floats, got = ct.read(out)
    assert set(got) == set(ref)
    for name, qw in ref.items():
        assert_same_weight(got[name], qw.codes, qw.scales, qw, name)
    assert set(floats) == set(floats_ref)
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == CASES[case][4] == qcfg["config_groups"]["group_0"]["format"]


@pytest.mark.parametrize("case", ["w8a8-static-kv", "fp8-static-kv-head", "w8a8-dynamic"])
def test_activation_and_kv_steps(exported, case):
    canonical, out = exported[case]
    absmax = load_scales(canonical)
    _, _, acts, kv, _ = CASES[case]
    steps = ct.read_scales(out)
    names = [k.removesuffix(".input_absmax") for k in absmax if k.endswith(".input_absmax")]
    for name in names:
        if acts.dynamic:
            assert f"{name}.input_scale" not in steps
        else:
            assert torch.equal(steps[f"{name}.input_scale"],
                               scale_from_absmax(absmax[f"{name}.input_absmax"], acts.kind).reshape(1))
    for i in range(2 if kv else 0):
        a = f"model.layers.{i}.self_attn"
        for part in "kv":
            amax = absmax[f"{a}.{part}_absmax"]
            want = scale_from_absmax(amax if kv.granularity == "head" else amax.max().reshape(1), "fp8")
            assert torch.equal(steps[f"{a}.{part}_scale"], want)
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    if kv:
        assert qcfg["kv_cache_scheme"]["strategy"] == {"head": "attn_head", "tensor": "tensor"}[kv.granularity]


@pytest.mark.parametrize("case", list(CASES))
def test_loads_in_transformers_like_the_fake_quant_model(exported, case):
    """FP8 matches exactly; int8 static differs only where an input falls below the calibrated
    range (compressed-tensors clamps to −128, quantlab to −127); compressed-tensors' reference
    per-token int8 uses absmax/127.5 (vLLM's kernel and quantlab use /127), so dynamic W8A8
    agrees within activation-rounding noise."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    canonical, out = exported[case]
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    weights_only = load_fake_quant_model(canonical)
    full = load_fake_quant_model(canonical)
    apply_from_canonical(full, canonical)
    with torch.no_grad():
        got, ref, wo = loaded(ids).logits, full(ids).logits, weights_only(ids).logits
    scale = float(ref.abs().max())
    _, _, acts, kv, _ = CASES[case]
    if acts is not None or kv is not None:
        assert float((ref - wo).abs().max()) > 1e-3 * scale  # the case really quantizes activations / KV
    tol = {"int-quantized": 2e-2 if acts and acts.dynamic else 1e-2}.get(CASES[case][4], 1e-5)
    assert float((got - ref).abs().max()) <= tol * scale


@pytest.mark.parametrize("weights,acts,kv,match", [
    (PRESETS["W8A16"], STATIC, KVCacheScheme(type="int"), "vLLM reads only FP8 KV-cache scales"),
    (WeightScheme(bits=4, symmetric=True, group_size=32), STATIC, None, "int-quantized .W8A8. takes symmetric 8-bit"),
    (PRESETS["W8A16"], STATIC_FP8, None, "int weights with float activations"),
], ids=["int8-kv", "w4a8", "int-weights-fp8-acts"])
def test_refused_with_the_reason(tmp_path, tokenizer, weights, acts, kv, match):
    canonical = make_act_canonical(tmp_path, tokenizer, "llama", weights, acts, kv)
    with pytest.raises(UserError, match=match):
        api.export(canonical, tmp_path / "out", "compressed-tensors")


def _set(name, fn):
    return lambda t: t.update({name: fn(t[name])})


K = "model.layers.1.self_attn.k_scale"
GROUP = "quantization_config.config_groups.group_0"
# (case, what, tensors edit, config edit, subject, rule)
BROKEN = [
    ("w8a8-static-kv", "missing input_scale", lambda t: t.pop(f"{Q}.input_scale"), None, f"{Q}.input_scale", "present"),
    ("w8a8-static-kv", "input_scale absmax", _set(f"{Q}.input_scale", lambda x: x * 127), None,
     f"{Q}.input_scale", "decoded scales"),
    ("w8a8-static-kv", "k_scale absmax", _set(K, lambda x: x * 448), None, K, "decoded scales"),
    ("w8a8-static-kv", "k_scale shape", _set(K, lambda x: x.expand(2).clone()), None, K, "shape"),
    ("w8a8-static-kv", "v_scale sign", _set(K.replace("k_", "v_"), lambda x: -x), None, K.replace("k_", "v_"),
     "scale is positive and finite"),
    ("w8a8-static-kv", "weight dtype", _set(f"{Q}.weight", lambda x: x.float()), None, f"{Q}.weight", "dtype"),
    ("w8a8-static-kv", "weight scale step", _set(f"{Q}.weight_scale", lambda x: x * 127), None, Q, "decoded scales"),
    ("w8a8-static-kv", "int KV scheme", None,
     lambda c: c["quantization_config"]["kv_cache_scheme"].update(type="int"),
     "quantization_config.kv_cache_scheme.type", "config value"),
    ("w8a8-static-kv", "format", None, lambda c: c["quantization_config"].update(format="pack-quantized"),
     f"{GROUP}.format", "config value"),
    ("w8a8-dynamic", "input_scale when dynamic", lambda t: t.update({f"{Q}.input_scale": torch.ones(1)}), None,
     f"{Q}.input_scale", "no input_scale when dynamic or weight-only"),
    ("w8a8-dynamic", "static token", None,
     lambda c: c["quantization_config"]["config_groups"]["group_0"]["input_activations"].update(dynamic=False),
     f"{GROUP}.input_activations.strategy", "static scales are per tensor (or per head)"),
    ("fp8-static-kv-head", "per-head shape", _set(K, lambda x: x.reshape(-1)), None, K, "shape"),
    ("fp8-static-kv-head", "weight type", None,
     lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(type="int"),
     f"{GROUP}.weights.type", "format matches the weights"),
    ("fp8-weight-only", "activations in naive", None,
     lambda c: c["quantization_config"]["config_groups"]["group_0"].update(
         input_activations=ct.input_args(STATIC_FP8)),
     f"{GROUP}.input_activations", "format matches the activations"),
]


@pytest.mark.parametrize("case,what,tensors,config,subject,rule", BROKEN, ids=[f"{c}-{w}" for c, w, *_ in BROKEN])
def test_broken_export_is_rejected(exported, case, what, tensors, config, subject, rule):
    _, good = exported[case]
    assert api.inspect(good).ok
    bad = broken_copy(good, what.replace(" ", "_"))
    if tensors is not None:
        edit_tensors(bad, tensors)
    if config is not None:
        edit_config(bad, config)
    rejected(bad, subject, rule)
