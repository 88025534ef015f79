"""PaddleNLP export: Paddle-layout weights, the three absmax scale tables and
config.json.quantization_config for weight_only_int8/int4, a8w8, a8w8c8 and a8w8_fp8.

Round trip: quantlab's reader gives back the canonical codes, zeros, g_idx and scales exactly
(the tables hold `qmax·s` in float64, so `absmax/qmax` is the float32 step bit for bit) and
the activation / KV steps quantlab evaluates with. Every validator rule is fed a deliberately
broken export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from quantlab.cli import app
from quantlab.errors import UserError
from quantlab.export import api, paddlenlp
from quantlab.quant.activations import scale_from_absmax
from quantlab.quant.canonical import load_canonical, load_scales
from quantlab.quant.scheme import PRESETS, ActivationScheme, KVCacheScheme, WeightScheme
from quantlab.recipe import validate_recipe
from test_export_helpers import (assert_same_weight, broken_copy, edit_json, edit_tensors, export_cases,
                                 make_act_canonical, rejected)

STATIC = ActivationScheme(dynamic=False, granularity="tensor")
STATIC_FP8 = ActivationScheme(type="float", dynamic=False, granularity="tensor")
W8, W4C = PRESETS["W8A16"], WeightScheme(bits=4, symmetric=True, group_size=None)
CASES = {  # name: (weights, activations, kv cache, quant_type)
    "wo8": (W8, None, None, "weight_only_int8"),
    "wo4": (W4C, None, None, "weight_only_int4"),
    "a8w8": (W8, ActivationScheme(), None, "a8w8"),
    "a8w8c8": (W8, STATIC, KVCacheScheme(type="int", granularity="head"), "a8w8c8"),
    "a8w8c8_t": (W8, STATIC, KVCacheScheme(type="int", granularity="tensor"), "a8w8c8"),
    "fp8": (PRESETS["FP8_PER_TENSOR"], STATIC_FP8, None, "a8w8_fp8"),
}
L0 = "qwen2.layers.0"


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tokenizer) -> dict[tuple[str, str], tuple[Path, Path]]:
    return export_cases(tmp_path_factory.mktemp("paddle"), tokenizer, CASES, "paddlenlp")


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_exact(exported, case, model_type):
    canonical, out = exported[case, model_type]
    floats_ref, ref = load_canonical(canonical)
    floats, got = paddlenlp.read(out)
    assert set(got) == set(ref)
    for name, qw in ref.items():
        assert_same_weight(got[name], qw.codes, qw.scales, qw, name)
    assert set(floats) == set(floats_ref)
    for name, t in floats_ref.items():
        assert torch.equal(floats[name], t), name
    assert json.loads((out / "config.json").read_text())["quantization_config"] == {
        "quant_type": CASES[case][3], "shift": False, "smooth": False, "shift_smooth_all_linears": False}


@pytest.mark.parametrize("case", ["a8w8", "a8w8c8", "a8w8c8_t", "fp8"])
def test_activation_and_kv_steps(exported, case):
    """Tables hold the canonical absmax; read back they give the steps quantlab evaluated with
    (KV: per KV head, from PaddleNLP's stride over num_attention_heads entries)."""
    canonical, out = exported[case, "qwen2"]
    absmax = load_scales(canonical)
    _, acts, kv, _ = CASES[case]
    steps = paddlenlp.read_scales(out)
    acts_json = json.loads((out / "act_scales.json").read_text())
    for name in [k.removesuffix(".input_absmax") for k in absmax if k.endswith(".input_absmax")]:
        assert acts_json[f"qwen2.{name.removeprefix('model.')}.activation_quanter"] == float(
            absmax[f"{name}.input_absmax"])
        assert torch.equal(steps[f"{name}.input_scale"], scale_from_absmax(absmax[f"{name}.input_absmax"], acts.kind)
                           .reshape(1))
    if kv is None:
        assert not (out / "cachekv_scales.json").exists() and not any(k.endswith("k_scale") for k in steps)
        return
    cache = json.loads((out / "cachekv_scales.json").read_text())
    for i in range(2):
        a = f"model.layers.{i}.self_attn"
        k = absmax[f"{a}.k_absmax"]
        k = k if kv.granularity == "head" else k.max().expand_as(k)
        assert cache[f"qwen2.layers.{i}.self_attn.cachek_matmul.activation_quanter"] == k.repeat_interleave(2).tolist()
        assert torch.equal(steps[f"{a}.k_scale"], scale_from_absmax(k, "int8"))


def test_paddle_layout(exported):
    canonical, out = exported["a8w8c8", "qwen2"]
    t = load_file(out / "model.safetensors")
    floats, ref = load_canonical(canonical)
    k = ref["model.layers.0.self_attn.k_proj"]
    assert t[f"{L0}.self_attn.k_proj.weight"].dtype == torch.int8
    assert torch.equal(t[f"{L0}.self_attn.k_proj.weight"], (k.codes.to(torch.int16) - 128).to(torch.int8).T)
    assert t[f"{L0}.self_attn.k_proj.weight"].shape == (64, 32)  # [in, out]: 2 KV heads of 16
    assert t["lm_head.weight"].shape == (64, 512) and torch.equal(t["lm_head.weight"], floats["lm_head.weight"].T)
    assert torch.equal(t[f"{L0}.self_attn.q_proj.bias"], floats["model.layers.0.self_attn.q_proj.bias"])
    assert {"qwen2.embed_tokens.weight", "qwen2.norm.weight", f"{L0}.input_layernorm.weight"} <= set(t)
    weights = json.loads((out / "weight_scales.json").read_text())
    # absmax = 127·s, exact in float64: dividing by 127 gives the float32 step back
    assert weights[f"{L0}.self_attn.k_proj.weight_quanter"] == (k.scales[:, 0].double() * 127).tolist()
    acts = json.loads((out / "act_scales.json").read_text())
    assert {f"{L0}.{n}.activation_quanter" for n in paddlenlp.ACT_KEYS} <= set(acts)
    assert not any(".layer." in key for key in (*weights, *acts))  # no shift/smooth wrappers


def test_weight_only_stores_float_weights_paddle_requantizes(exported):
    """PaddleNLP quantizes weight-only checkpoints itself at load: weights are the dequantized
    floats, and where a row's codes reach ±qmax its per-channel absmax/qmax gives our step back."""
    for case, qmax in (("wo8", 127), ("wo4", 7)):
        canonical, out = exported[case, "llama"]
        _, ref = load_canonical(canonical)
        t = load_file(out / "model.safetensors")
        qw = ref["model.layers.1.mlp.down_proj"]
        w = t["llama.layers.1.mlp.down_proj.weight"]
        assert w.dtype == torch.float32 and torch.equal(w, qw.dequantize().T)
        signed = qw.codes.to(torch.int16) - qw.zeros.to(torch.int16)
        rows = signed.abs().amax(dim=1) == qmax
        assert rows.any()
        paddle_step = w.T.abs().amax(dim=1) / qmax  # weight_quantize's per-channel scale
        torch.testing.assert_close(paddle_step[rows], qw.scales[rows, 0], rtol=1e-6, atol=0)


def test_fp8_weights_hold_e4m3_codes_per_tensor(exported):
    canonical, out = exported["fp8", "qwen2"]
    _, ref = load_canonical(canonical)
    t = load_file(out / "model.safetensors")
    weights = json.loads((out / "weight_scales.json").read_text())
    q = ref["model.layers.0.self_attn.q_proj"]
    w = t[f"{L0}.self_attn.q_proj.weight"]
    assert w.dtype == torch.float32 and torch.equal(w.T.to(torch.float8_e4m3fn).view(torch.uint8),
                                                    q.codes.view(torch.uint8))
    assert weights[f"{L0}.self_attn.q_proj.weight_quanter"] == float(q.scales[0, 0].double() * 448)


@pytest.mark.parametrize("weights,acts,kv,match", [
    (PRESETS["W4A16"], None, None, "per output channel, symmetric"),
    (W8, STATIC, KVCacheScheme(type="float"), "a8w8c8 takes an int8 KV cache"),
    (PRESETS["FP8"], STATIC_FP8, None, "a8w8_fp8 takes per-tensor FP8 weights"),
    (W8, None, KVCacheScheme(type="int"), "KV cache quantized without activations"),
    (PRESETS["W4A16"], STATIC, None, "symmetric per-channel int8 weights"),
], ids=["grouped-int4", "fp8-kv", "fp8-per-channel", "kv-without-acts", "w4a8"])
def test_refused_with_the_reason(tmp_path, tokenizer, weights, acts, kv, match):
    canonical = make_act_canonical(tmp_path, tokenizer, "llama", weights, acts, kv)
    with pytest.raises(UserError, match=match):
        api.export(canonical, tmp_path / "out", "paddlenlp")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- broken exports


def _tensors(fn):
    return ("model.safetensors", fn)


def _table(fname, fn):
    return (fname, fn)


def _set(name, fn):
    return lambda t: t.update({name: fn(t[name])})


def _rename(old, new):
    return lambda t: t.update({new: t.pop(old)})


def _swap(a, b):
    def fn(t):
        t[a], t[b] = t[b], t[a]
    return fn


W = "weight_scales.json"
ACTS = "act_scales.json"
CACHE = "cachekv_scales.json"
KEY_K = f"{L0}.self_attn.cachek_matmul.activation_quanter"
# (case, what, file, edit, subject, rule)
BROKEN = [
    ("a8w8c8", "name", *_tensors(_rename(f"{L0}.mlp.up_proj.weight", f"{L0}.mlp.up.weight")),
     f"{L0}.mlp.up_proj.weight", "present"),
    ("a8w8c8", "unknown name", *_tensors(_rename(f"{L0}.mlp.up_proj.weight", f"{L0}.mlp.up.weight")),
     f"{L0}.mlp.up.weight", "known tensor"),
    ("a8w8c8", "dtype", *_tensors(_set(f"{L0}.mlp.down_proj.weight", lambda x: x.to(torch.int32))),
     f"{L0}.mlp.down_proj.weight", "dtype"),
    ("a8w8c8", "float non-codes", *_tensors(_set(f"{L0}.mlp.down_proj.weight", lambda x: x.float() / 127)),
     f"{L0}.mlp.down_proj.weight", "int8 codes in a float tensor"),
    ("a8w8c8", "torch layout", *_tensors(_set(f"{L0}.self_attn.k_proj.weight", lambda x: x.T.contiguous())),
     f"{L0}.self_attn.k_proj.weight", "shape"),
    ("a8w8c8", "lm_head layout", *_tensors(_set("lm_head.weight", lambda x: x.T.contiguous())),
     "lm_head.weight", "shape"),
    ("a8w8c8", "gate/up swap", *_tensors(_swap(f"{L0}.mlp.gate_proj.weight", f"{L0}.mlp.up_proj.weight")),
     "model.layers.0.mlp.gate_proj", "decoded codes"),
    ("a8w8c8", "weight step not absmax", *_table(W, _set(f"{L0}.mlp.up_proj.weight_quanter",
                                                         lambda v: [x / 127 for x in v])),
     "model.layers.0.mlp.up_proj", "decoded scales"),
    ("a8w8c8", "per-tensor weight scale", *_table(W, _set(f"{L0}.mlp.up_proj.weight_quanter", max)),
     f"{W}:{L0}.mlp.up_proj.weight_quanter", "per-channel weight absmax"),
    ("a8w8c8", "negative weight absmax", *_table(W, _set(f"{L0}.mlp.up_proj.weight_quanter",
                                                         lambda v: [-x for x in v])),
     f"{W}:{L0}.mlp.up_proj.weight_quanter", "absmax is positive and finite"),
    ("a8w8c8", "missing weight key", *_table(W, lambda d: d.pop(f"{L0}.mlp.up_proj.weight_quanter")),
     f"{W}:{L0}.mlp.up_proj.weight_quanter", "scale table key"),
    ("a8w8c8", "act step not absmax", *_table(ACTS, _set(f"{L0}.self_attn.o_proj.activation_quanter",
                                                         lambda v: v / 127)),
     "model.layers.0.self_attn.o_proj.input_scale", "decoded scales"),
    ("a8w8c8", "missing act key", *_table(ACTS, lambda d: d.pop(f"{L0}.mlp.down_proj.activation_quanter")),
     f"{ACTS}:{L0}.mlp.down_proj.activation_quanter", "scale table key"),
    ("a8w8c8", "act list", *_table(ACTS, _set(f"{L0}.mlp.gate_proj.activation_quanter", lambda v: [v, v])),
     f"{ACTS}:{L0}.mlp.gate_proj.activation_quanter", "per-tensor activation absmax"),
    ("a8w8c8", "cachekv kv_heads entries", *_table(CACHE, _set(KEY_K, lambda v: v[::2])),
     f"{CACHE}:{KEY_K}", "GQA head counts"),
    ("a8w8c8", "cachekv GQA repeat", *_table(CACHE, _set(KEY_K, lambda v: [v[0] * 2, *v[1:]])),
     f"{CACHE}:{KEY_K}", "GQA heads share their KV head's absmax"),
    ("a8w8c8", "cachekv step not absmax", *_table(CACHE, _set(KEY_K, lambda v: [x / 127 for x in v])),
     "model.layers.0.self_attn.k_scale", "decoded scales"),
    ("a8w8c8", "GQA config", *_table("config.json", lambda c: c.update(num_key_value_heads=3)),
     "config.json.num_key_value_heads", "GQA head counts"),
    ("a8w8c8", "shift", *_table("config.json", lambda c: c["quantization_config"].update(shift=True)),
     "quantization_config.shift", "config value"),
    ("a8w8c8", "quant_type", *_table("config.json", lambda c: c["quantization_config"].update(quant_type="a8w4")),
     "quantization_config.quant_type", "config value"),
    ("a8w8", "cachekv without c8", *_table(CACHE, lambda d: d.update({KEY_K: [1.0] * 4})), CACHE, "file"),
    ("fp8", "dequantized weights", *_tensors(_set(f"{L0}.mlp.up_proj.weight", lambda x: x * 1.001)),
     f"{L0}.mlp.up_proj.weight", "FP8 codes in a float tensor"),
    ("fp8", "per-channel FP8 absmax", *_table(W, _set(f"{L0}.mlp.up_proj.weight_quanter", lambda v: [v] * 128)),
     f"{W}:{L0}.mlp.up_proj.weight_quanter", "per-tensor FP8 weight absmax"),
    ("wo8", "weights as codes", *_tensors(_set(f"{L0}.mlp.up_proj.weight", lambda x: x * 2)),
     "model.layers.0.mlp.up_proj", "decoded codes"),
]


@pytest.mark.parametrize("case,what,fname,edit,subject,rule", BROKEN, ids=[f"{c}-{w}" for c, w, *_ in BROKEN])
def test_broken_export_is_rejected(exported, case, what, fname, edit, subject, rule):
    _, good = exported[case, "qwen2"]
    assert api.inspect(good).ok
    bad = broken_copy(good, what.replace(" ", "_").replace("/", "_"))
    if fname.endswith(".safetensors"):
        edit_tensors(bad, edit, fname)
    elif (bad / fname).is_file():
        edit_json(bad, edit, fname)
    else:
        data: dict = {}
        edit(data)
        (bad / fname).write_text(json.dumps(data))
    rejected(bad, subject, rule)


def test_missing_table_is_rejected(exported):
    bad = broken_copy(exported["a8w8c8", "llama"][1], "no-acts")
    (bad / "act_scales.json").unlink()
    assert "act_scales.json: file: missing (quant_type a8w8c8 reads it)" in rejected(bad, "act_scales.json", "file")


def test_good_export_checks_every_rule(exported):
    report = api.inspect(exported["a8w8c8", "qwen2"][1])
    assert report.ok and report.format == "paddlenlp" and "skipped" not in report.facts
    rules = report.rule_counts()
    for rule in ("decoded codes", "decoded scales", "GQA head counts", "GQA heads share their KV head's absmax",
                 "per-channel weight absmax", "per-tensor activation absmax", "known tensor"):
        assert rules[rule][0] > 0 and rules[rule][1] == 0, rule


def test_cli_and_recipe_pick_up_paddlenlp(exported, tmp_path):
    canonical, _ = exported["a8w8", "llama"]
    runner = CliRunner()
    result = runner.invoke(app, ["export", str(canonical), "--format", "paddlenlp", "--out", str(tmp_path / "x")])
    assert result.exit_code == 0, result.output
    shown = runner.invoke(app, ["inspect", str(tmp_path / "x" / "paddlenlp")])
    assert shown.exit_code == 0 and "paddlenlp" in shown.output and "quant_type: a8w8" in shown.output
    recipe = validate_recipe({"name": "t", "seed": 0, "model": {"id": "m"}, "stages": [{"rtn": {"weights": "W8A16"}}],
                              "export": ["paddlenlp", "trtllm"]})
    assert recipe.export == ["paddlenlp", "trtllm"]
