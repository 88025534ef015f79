"""SmoothQuant: folding keeps the float model's function, biases are handled, GQA skips v→o,
the scale formula is the paper's, and the α search never loses to no smoothing."""

from __future__ import annotations

import pytest
import torch

from quantlab.algorithms.smoothquant import (
    SmoothQuant,
    can_smooth,
    smoothing_scales,
    w8a8_error,
)
from quantlab.engine.sequential import run_sequential
from quantlab.models.arch import ScalingGroup, arch_spec_for
from quantlab.quant.scheme import PRESETS, ActivationScheme
from conftest import tiny_model

STATIC = ActivationScheme(dynamic=False, granularity="tensor")
CPU = torch.device("cpu")


def planted_outliers(model: torch.nn.Module) -> None:
    """Give the norms a few large channels (real LLMs' activation outliers) and Qwen2's
    attention biases non-zero values, so the smoothing has something to move."""
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.uniform_(0.5, 1.5)
                norm.weight[:3] *= 40
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                if proj.bias is not None:
                    proj.bias.normal_()


def smooth(model: torch.nn.Module, algo: SmoothQuant, ids: torch.Tensor) -> None:
    run_sequential(model, arch_spec_for(model), ids, [algo], CPU, batch_size=2)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("kv_heads", [2, 4])
@pytest.mark.parametrize("search", [False, True])
def test_smoothing_keeps_float_outputs(model_type: str, kv_heads: int, search: bool):
    model = tiny_model(model_type, num_key_value_heads=kv_heads)
    planted_outliers(model)
    ids = torch.randint(0, 512, (4, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    before = {k: v.clone() for k, v in model.state_dict().items()}
    algo = SmoothQuant(alpha=0.6, search=search, grid=5, activations=STATIC)
    smooth(model, algo, ids)
    with torch.no_grad():
        out = model(ids).logits
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert any("layernorm" in k for k in changed)  # something was actually folded
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_qwen2_biases(kv_heads: int):
    """q/k/v biases sit after the input-channel scaling and must not change; v's bias is
    divided with v's rows when v_proj absorbs o_proj's scales (only possible without GQA)."""
    model = tiny_model("qwen2", num_key_value_heads=kv_heads)
    planted_outliers(model)
    attn = model.model.layers[0].self_attn
    q_b, k_b, v_b = (p.bias.detach().clone() for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    o_w = attn.o_proj.weight.detach().clone()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    smooth(model, SmoothQuant(alpha=0.5), ids)
    assert torch.equal(attn.q_proj.bias, q_b) and torch.equal(attn.k_proj.bias, k_b)
    if kv_heads == 4:
        s_vo = attn.o_proj.weight[0] / o_w[0]  # o's columns were multiplied by s
        assert not torch.allclose(s_vo, torch.ones_like(s_vo))
        torch.testing.assert_close(attn.v_proj.bias * s_vo, v_b, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(attn.v_proj.bias, v_b)
        assert torch.equal(attn.o_proj.weight, o_w)


def test_gqa_skips_v_to_o():
    group = ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",))
    assert not can_smooth(tiny_model("llama", num_key_value_heads=2).model.layers[0], group)
    assert can_smooth(tiny_model("llama", num_key_value_heads=4).model.layers[0], group)
    norm = ScalingGroup("input_layernorm", ("self_attn.q_proj",))
    assert can_smooth(tiny_model("llama").model.layers[0], norm)


def test_scale_formula():
    x = torch.tensor([4.0, 0.25, 0.0, 9.0])
    w = torch.tensor([0.5, 2.0, 1.0, 0.0])
    s = smoothing_scales(x, w, alpha=0.5)
    torch.testing.assert_close(s[:2], torch.tensor([4.0**0.5 / 0.5**0.5, 0.25**0.5 / 2.0**0.5]))
    assert s[2] == 1 and s[3] == 1  # never-active input or all-zero column: left alone
    torch.testing.assert_close(smoothing_scales(x[:2], w[:2], alpha=1.0), x[:2])
    torch.testing.assert_close(smoothing_scales(x[:2], w[:2], alpha=0.0), 1 / w[:2])


def outlier_inputs(seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 64, generator=g)
    x[:, :2] *= 60  # two outlier channels, as in LLM activations
    return x, [torch.randn(32, 64, generator=g) * 0.05, torch.randn(16, 64, generator=g) * 0.05]


@pytest.mark.parametrize("scheme", [STATIC, ActivationScheme()], ids=["static", "per_token"])
def test_smoothing_reduces_w8a8_error_on_outliers(scheme: ActivationScheme):
    x, weights = outlier_inputs()
    reference = x @ torch.cat(weights).T
    w_absmax = torch.cat(weights).abs().amax(0)
    s = smoothing_scales(x.abs().amax(0), w_absmax, 0.5)
    plain = w8a8_error(x, weights, torch.ones(64), PRESETS["W8A16"], scheme, reference)
    smoothed = w8a8_error(x, weights, s, PRESETS["W8A16"], scheme, reference)
    assert smoothed < 0.5 * plain


def test_search_never_worse_than_no_smoothing():
    x, weights = outlier_inputs(3)
    linears = []
    for w in weights:
        lin = torch.nn.Linear(64, w.shape[0], bias=False)
        lin.weight.data.copy_(w)
        linears.append(lin)
    algo = SmoothQuant(search=True, grid=10, activations=STATIC)
    reference = x @ torch.cat(weights).T
    s, alpha = algo._search(x, linears, x.abs().amax(0), torch.cat(weights).abs().amax(0))
    err = w8a8_error(x, weights, s, algo.weights, STATIC, reference)
    plain = w8a8_error(x, weights, torch.ones(64), algo.weights, STATIC, reference)
    assert alpha is not None and err < plain
    for i in range(11):  # and it is the grid's best
        cand = smoothing_scales(x.abs().amax(0), torch.cat(weights).abs().amax(0), i / 10)
        assert err <= w8a8_error(x, weights, cand, algo.weights, STATIC, reference) + 1e-9


def test_static_search_scores_the_deployed_range():
    """A massive activation on a token the search's subsample missed still sets the static
    range act_ranges deploys (`max_c absmax_c / s_c`); the search must score α with that
    range, not the subsample's (which would pick a much worse α here)."""
    from quantlab.algorithms.smoothquant import deployed_static_absmax

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=g)
    x[:, :2] *= 8
    weights = [torch.randn(32, 64, generator=g) * 0.05, torch.randn(16, 64, generator=g) * 0.05]
    linears = []
    for w in weights:
        lin = torch.nn.Linear(64, w.shape[0], bias=False)
        lin.weight.data.copy_(w)
        linears.append(lin)
    x_absmax = x.abs().amax(0)
    x_absmax[5] = 400.0  # seen by the full-data per-channel absmax, not in the sample
    w_absmax = torch.cat(weights).abs().amax(0)
    reference = x @ torch.cat(weights).T

    def deployed_error(s: torch.Tensor) -> float:
        static = deployed_static_absmax(STATIC, x_absmax, s)
        assert static == (x_absmax / s).max()
        return w8a8_error(x, weights, s, PRESETS["W8A16"], STATIC, reference, static)

    algo = SmoothQuant(search=True, grid=10, activations=STATIC)
    s, alpha = algo._search(x, linears, x_absmax, w_absmax)
    cands = [smoothing_scales(x_absmax, w_absmax, i / 10) for i in range(11)] + [torch.ones(64)]
    errors = [deployed_error(c) for c in cands]
    assert alpha is not None and deployed_error(s) == pytest.approx(min(errors))
    subsample_choice = min(cands, key=lambda c: w8a8_error(x, weights, c, PRESETS["W8A16"], STATIC, reference))
    assert deployed_error(subsample_choice) > 1.5 * deployed_error(s)
    assert deployed_static_absmax(ActivationScheme(), x_absmax, s) is None  # dynamic: nothing to deploy
    clipped = ActivationScheme(dynamic=False, granularity="tensor", observer="mse")
    assert deployed_static_absmax(clipped, x_absmax, s) is None  # the observer runs on the sample


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_smoothquant_then_gptq_static_w8a8(model_type: str):
    """SmoothQuant → GPTQ W8 → static act_ranges composes: GPTQ encodes the *smoothed*
    weights, and with activations really quantized (static per tensor) the model is far
    closer to float than the same pipeline without smoothing."""
    from quantlab.algorithms.act_ranges import ActRanges, canonical_entries
    from quantlab.algorithms.gptq import GPTQ
    from quantlab.eval.fake_quant import apply_fake_quant

    ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(0))

    def run(smoothed: bool) -> tuple[float, torch.nn.Module, dict, SmoothQuant]:
        model = tiny_model(model_type)
        planted_outliers(model)
        original = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            ref = model(ids).logits
        sq = SmoothQuant(search=True, grid=5, activations=STATIC)
        stages = ([sq] if smoothed else []) + [GPTQ(PRESETS["W8A16"]), ActRanges(STATIC)]
        scales: dict[str, torch.Tensor] = {}
        quantized = run_sequential(model, arch_spec_for(model), ids, stages, CPU, batch_size=2, scales=scales)
        apply_fake_quant(model, canonical_entries(stages[-1], scales), scales)
        with torch.no_grad():
            err = (model(ids).logits - ref).pow(2).mean().item()
        return err, model, {"original": original, "quantized": quantized}, sq

    plain_err, _, _, _ = run(False)
    sq_err, model, state, sq = run(True)
    assert sq_err < 0.3 * plain_err
    assert any(a is not None for a in sq.summary().values())
    # q_proj's codes encode W·diag(s), s read back from the norm that absorbed 1/s
    norm = "model.layers.0.input_layernorm.weight"
    s = state["original"][norm] / model.get_submodule("model.layers.0.input_layernorm").weight.detach()
    assert (s - 1).abs().max() > 0.5
    q = "model.layers.0.self_attn.q_proj"
    deq = state["quantized"][q].dequantize()
    smoothed_w, raw_w = state["original"][f"{q}.weight"] * s, state["original"][f"{q}.weight"]
    assert (deq - smoothed_w).norm() < 0.05 * smoothed_w.norm()  # GPTQ moves weights a bit
    assert (deq - raw_w).norm() > 0.5 * raw_w.norm()


def test_search_weight_scheme_follows_the_next_weight_stage(tmp_path):
    from quantlab.recipe import validate_recipe

    def stage0(stages: list) -> SmoothQuant:
        raw = {"name": "t", "seed": 0, "model": {"id": "m"}, "stages": stages,
               "calibration": {"dataset": {"source": "x.txt"}}}
        return validate_recipe(raw).stages[0].smoothquant

    assert stage0([{"smoothquant": {}}, {"rtn": {"weights": "FP8"}}]).weights == PRESETS["FP8"]
    assert stage0([{"smoothquant": {}}, {"gptq": {"weights": "W8A16"}}]).weights == PRESETS["W8A16"]
    assert stage0([{"smoothquant": {}}, {"act_ranges": {}}]).weights == PRESETS["W8A16"]
    explicit = stage0([{"smoothquant": {"weights": "W8A16_ASYM"}}, {"rtn": {"weights": "FP8"}}])
    assert explicit.weights == PRESETS["W8A16_ASYM"]


def test_static_benchmark_pair_differs_only_by_smoothing():
    """The peers benchmark compares these two recipes (static W8A8 with and without SmoothQuant):
    everything but the smoothquant stage must match."""
    from quantlab.recipe import load_recipe
    from conftest import REPO

    plain = load_recipe(REPO / "recipes" / "smollm2_a8w8_static.yaml")
    smooth = load_recipe(REPO / "recipes" / "smollm2_smoothquant_a8w8_static.yaml")
    assert [e.kind for e in smooth.stages] == ["smoothquant"] + [e.kind for e in plain.stages]
    assert [e.dump() for e in smooth.stages[1:]] == [e.dump() for e in plain.stages]
    ranges = plain.stages[-1].act_ranges.activations
    assert not ranges.dynamic and ranges.granularity == "tensor"
    sq = smooth.stages[0].smoothquant
    assert sq.search and sq.activations == ranges and sq.weights == plain.stages[0].rtn.weights
    assert (smooth.model, smooth.calibration, smooth.evaluate, smooth.seed) == (
        plain.model, plain.calibration, plain.evaluate, plain.seed)
