"""Activation, KV and FP8 fake quantization: error bounds, hooks that really change the model,
FP8 weights through the canonical form, recipe rules, and a tiny end-to-end A8W8C8 run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantlab.eval.fake_quant import apply_fake_quant, apply_from_canonical
from quantlab.quant.activations import FP8_MAX, fake_quant_activation
from quantlab.quant.canonical import load_canonical, load_fake_quant_model, save_canonical
from quantlab.quant.primitives import quantize_weight
from quantlab.quant.scheme import PRESETS, ActivationScheme, WeightScheme
from quantlab.recipe import validate_recipe
from quantlab.errors import UserError
from conftest import WIKI_TEST, WIKI_TRAIN, tiny_model

PER_TOKEN = ActivationScheme()
STATIC = ActivationScheme(dynamic=False, granularity="tensor")


def activations(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 40, 64, generator=g)
    x[..., 5] *= 30  # an outlier channel
    return x


def test_per_token_int8_error_is_at_most_half_a_step():
    x = activations()
    y = fake_quant_activation(x, PER_TOKEN)
    step = x.abs().amax(dim=-1, keepdim=True) / 127
    assert ((y - x).abs() <= step / 2 * (1 + 1e-5)).all()
    assert not torch.equal(x, y)
    levels = torch.round(y / step)  # each token lands on its own int8 grid
    torch.testing.assert_close(y, levels * step)
    assert levels.abs().max() <= 127


def test_static_per_tensor_int8_clips_beyond_the_calibrated_range():
    x = activations(1)
    absmax = torch.tensor(2.0)
    y = fake_quant_activation(x, STATIC, absmax)
    step = absmax / 127
    inside = x.abs() <= absmax
    assert ((y - x).abs()[inside] <= step / 2 * (1 + 1e-5)).all()
    above, below = x > absmax, x < -127.5 * step  # beyond half a step past −absmax: code −128
    assert above.any() and below.any()
    # saturating int8: +127 steps above the range, −128 steps below it (as the engines cast)
    assert torch.allclose(y[above], absmax.expand_as(y[above]))
    assert torch.allclose(y[below], (-128 * step).expand_as(y[below]))
    with pytest.raises(ValueError):
        fake_quant_activation(x, STATIC, None)


def test_per_tensor_dynamic_uses_the_tensor_absmax():
    x = activations(2)
    scheme = ActivationScheme(dynamic=True, granularity="tensor")
    torch.testing.assert_close(fake_quant_activation(x, scheme), fake_quant_activation(x, STATIC, x.abs().max()))


def test_fp8_per_token_relative_error():
    x = activations(3)
    y = fake_quant_activation(x, ActivationScheme(type="float"))
    scale = x.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    normal = x.abs() / scale >= 2**-6  # e4m3 normal range: 3 mantissa bits
    rel = ((y - x).abs() / x.abs())[normal]
    assert rel.max() <= 2**-4 * (1 + 1e-5)
    assert not torch.equal(x, y)


@pytest.mark.parametrize("preset", ["FP8", "FP8_PER_TENSOR"])
def test_fp8_weights_round_trip_through_canonical(preset: str, tmp_path, tokenizer):
    model = tiny_model("llama")
    scheme = PRESETS[preset]
    name = "model.layers.0.mlp.up_proj"
    w = model.get_submodule(name).weight.data.clone()
    qw = quantize_weight(w, scheme)
    assert qw.codes.dtype == torch.float8_e4m3fn and int(qw.zeros.max()) == 0
    rel = ((qw.dequantize() - w).abs() / w.abs().clamp(min=1e-3)).max()
    assert 0 < rel <= 0.07
    if scheme.per_tensor:
        assert torch.unique(qw.scales).numel() == 1
    save_canonical(tmp_path / "q", model, {name: qw}, tokenizer)
    _, loaded = load_canonical(tmp_path / "q")
    assert loaded[name].scheme == scheme
    assert torch.equal(loaded[name].codes.float(), qw.codes.float())
    torch.testing.assert_close(loaded[name].dequantize(), qw.dequantize())
    restored = load_fake_quant_model(tmp_path / "q")
    torch.testing.assert_close(restored.get_submodule(name).weight, qw.dequantize())


def test_fp8_scheme_rules():
    with pytest.raises(ValueError):
        WeightScheme(type="float", bits=4, group_size=None)
    with pytest.raises(ValueError):
        WeightScheme(type="float", bits=8, group_size=128)
    with pytest.raises(ValueError):
        WeightScheme(bits=8, group_size=64, per_tensor=True)
    assert PRESETS["FP8"].name == "FP8_c" and PRESETS["W8A16"].name == "W8A16_c"


def model_config(model, acts: ActivationScheme | None, kv: dict | None) -> tuple[dict, dict]:
    layers = range(model.config.num_hidden_layers)
    names = [f"model.layers.{i}.{n}" for i in layers for n in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")]
    config: dict = {}
    scales: dict[str, torch.Tensor] = {}
    if acts is not None:
        config["activations"] = {**acts.model_dump(), "modules": names}
        scales.update({f"{n}.input_absmax": torch.tensor(1.0) for n in names})
    if kv is not None:
        attns = [f"model.layers.{i}.self_attn" for i in layers]
        config["kv_cache"] = {**kv, "modules": attns}
        heads = model.config.num_key_value_heads
        for a in attns:
            scales[f"{a}.k_absmax"] = torch.full((heads,), 3.0)
            scales[f"{a}.v_absmax"] = torch.full((heads,), 3.0)
    return config, scales


@pytest.mark.parametrize("acts,kv", [
    (PER_TOKEN, None), (STATIC, None), (ActivationScheme(type="float"), None),
    (None, {"type": "int", "granularity": "head"}), (None, {"type": "float", "granularity": "tensor"}),
])
def test_fake_quant_hooks_change_outputs_and_come_off(acts, kv):
    model = tiny_model("llama")
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(ids).logits
    config, scales = model_config(model, acts, kv)
    handles = apply_fake_quant(model, config, scales)
    assert handles.linears == (6 if acts else 0) and len(handles.attentions) == (2 if kv else 0)
    with torch.no_grad():
        out = model(ids).logits
    diff = (out - ref).abs().max().item()
    assert 0 < diff < 0.5 * ref.abs().max().item()
    handles.remove()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref)


def test_kv_fake_quant_sees_the_cache_quantized():
    """Scales from the observed per-head ranges barely move the outputs; 100× coarser ones
    (most of K and V rounds to 0) move them far more: the hook is on the real K/V path."""
    from quantlab.quant import kv_cache

    model = tiny_model("llama")
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = model(ids).logits
    kv_cache.enable(model)
    attns = kv_cache.attention_modules(model)
    ranges = []
    for attn in attns:
        with kv_cache.observe_kv(attn) as rng, torch.no_grad():
            model(ids)
        ranges.append(rng)
    config, _ = model_config(model, None, {"type": "int", "granularity": "head"})
    errors = []
    for factor in (1.0, 100.0):
        scales = {}
        for i, rng in enumerate(ranges):
            scales[f"model.layers.{i}.self_attn.k_absmax"] = rng.k * factor
            scales[f"model.layers.{i}.self_attn.v_absmax"] = rng.v * factor
        handles = apply_fake_quant(model, config, scales)
        with torch.no_grad():
            errors.append((model(ids).logits - ref).abs().mean().item())
        handles.remove()
    assert errors[1] > 10 * errors[0] > 0


def base_recipe(model_dir: Path, tmp_path: Path, stages: list) -> dict:
    return {"name": "t", "seed": 0, "device": "cpu", "model": {"id": str(model_dir)},
            "calibration": {"dataset": {"source": str(WIKI_TRAIN)}, "num_samples": 4, "seq_len": 32},
            "stages": stages, "output": {"dir": str(tmp_path / "run")}}


def test_recipe_rules(tmp_path):
    def check(stages: list, **extra) -> None:
        validate_recipe({**base_recipe(Path("m"), tmp_path, stages), **extra})

    with pytest.raises(UserError, match="stages\\[0\\].gptq.weights: FP8"):
        check([{"gptq": {"weights": "FP8"}}])
    with pytest.raises(UserError, match="smoothquant: must come before"):
        check([{"rtn": {"weights": "W8A16"}}, {"smoothquant": {}}])
    with pytest.raises(UserError, match="activations or kv_cache"):
        check([{"act_ranges": {"activations": None}}])
    with pytest.raises(UserError, match="calibration"):
        check([{"act_ranges": {}}], calibration=None)
    with pytest.raises(UserError, match="per tensor"):
        check([{"act_ranges": {"activations": {"dynamic": False}}}])
    recipe = validate_recipe(base_recipe(Path("m"), tmp_path, [
        {"smoothquant": {"search": True}}, {"rtn": {"weights": "FP8"}},
        {"act_ranges": {"activations": {"type": "float", "dynamic": False, "granularity": "tensor"}}}]))
    assert recipe.stages[0].smoothquant.activations == recipe.stages[2].act_ranges.activations


def test_pipeline_a8w8c8_end_to_end(tiny_model_dir, tmp_path):
    """smoothquant(search) → rtn W8 → act_ranges(static + int8 KV): the canonical form has the
    scales, the PaddleNLP tables, and evaluation really runs with quantized activations."""
    from quantlab.eval.perplexity import perplexity
    from quantlab.pipeline import run_recipe

    raw = base_recipe(tiny_model_dir, tmp_path, [
        {"smoothquant": {"search": True, "grid": 4}}, {"rtn": {"weights": "W8A16"}},
        {"act_ranges": {"activations": {"dynamic": False, "granularity": "tensor", "observer": "percentile"},
                        "kv_cache": {"type": "int", "granularity": "head"}}}])
    raw["evaluate"] = {"perplexity": {"dataset": {"source": str(WIKI_TEST)}, "seq_len": 32, "max_windows": 2}}
    run = run_recipe(validate_recipe(raw))
    q = run.path / "quantized"
    config = json.loads((q / "quant_config.json").read_text())
    assert config["activations"]["observer"] == "percentile" and len(config["activations"]["modules"]) == 14
    assert config["kv_cache"]["modules"] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert set(config["smoothquant_summary"]) >= {"model.layers.0.input_layernorm"}
    for name in ("scales.safetensors", "weight_scales.json", "act_scales.json", "cachekv_scales.json"):
        assert (q / name).is_file(), name
    reported = json.loads((run.path / "reports" / "perplexity_quantized.json").read_text())["perplexity"]
    from quantlab.data.sampling import tokenize_joined
    from quantlab.data.sources import load_documents
    from quantlab.recipe import DatasetSpec
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    stream = tokenize_joined(load_documents(DatasetSpec(source=str(WIKI_TEST)), "x", tok), tok)
    weights_only = perplexity(load_fake_quant_model(q), stream, 32, 2).perplexity
    model = load_fake_quant_model(q)
    apply_from_canonical(model, q)
    assert perplexity(model, stream, 32, 2).perplexity == pytest.approx(reported, rel=1e-6)
    assert reported != pytest.approx(weights_only, rel=1e-7)


def test_static_fp8_weights_activations_and_kv():
    """FP8 per-tensor weights + static per-tensor FP8 activations (mse observer, fitted to
    the e4m3 grid) + FP8 K/V with one scale per tensor: every Linear input at evaluation is
    on the FP8 grid of its calibrated scale, and the scale tables carry the absmax values."""
    from quantlab.algorithms.act_ranges import ActRanges, canonical_entries
    from quantlab.algorithms.rtn import RTN
    from quantlab.engine.sequential import run_sequential
    from quantlab.models.arch import arch_spec_for
    from quantlab.quant.activations import fake_quant
    from quantlab.quant.scale_tables import scale_tables
    from quantlab.quant.scheme import KVCacheScheme

    model = tiny_model("qwen2")
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = model(ids).logits
    acts = ActivationScheme(type="float", dynamic=False, granularity="tensor", observer="mse")
    stage = ActRanges(acts, KVCacheScheme(type="float", granularity="tensor"))
    scales: dict[str, torch.Tensor] = {}
    quantized = run_sequential(model, arch_spec_for(model), ids, [RTN(PRESETS["FP8_PER_TENSOR"]), stage],
                               torch.device("cpu"), scales=scales)
    config = canonical_entries(stage, scales)
    assert config["activations"]["type"] == "float" and config["kv_cache"]["granularity"] == "tensor"
    name = "model.layers.1.mlp.down_proj"
    assert scales[f"{name}.input_absmax"] <= scales[f"{name}.input_channel_absmax"].max()
    handles = apply_fake_quant(model, config, scales)
    seen: list[torch.Tensor] = []
    grab = model.get_submodule(name).register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
    with torch.no_grad():
        out = model(ids).logits
    grab.remove()
    scale = scales[f"{name}.input_absmax"] / FP8_MAX
    assert torch.equal(fake_quant(seen[0], scale, "fp8"), seen[0])  # already on the grid
    assert seen[0].abs().max() <= scales[f"{name}.input_absmax"] * (1 + 1e-6)
    assert 0 < (out - ref).abs().max() < 0.5 * ref.abs().max()
    handles.remove()
    tables = scale_tables(model.config.to_dict(), config, quantized, scales)
    w = tables["weight_scales.json"]["qwen2.layers.1.mlp.down_proj.weight_quanter"]
    assert isinstance(w, float) and w == pytest.approx(float(quantized[name].scales[0, 0]) * FP8_MAX)
    act = tables["act_scales.json"]["qwen2.layers.1.mlp.down_proj.activation_quanter"]
    assert act == pytest.approx(float(scales[f"{name}.input_absmax"]))
    k = tables["cachekv_scales.json"]["qwen2.layers.1.self_attn.cachek_matmul.activation_quanter"]
    assert k == [pytest.approx(float(scales["model.layers.1.self_attn.k_absmax"].max()))] * 4  # num_heads
