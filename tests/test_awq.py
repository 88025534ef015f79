"""AWQ: scale folding is exact, the searches never do worse than their identity candidate,
the Gram shortcut equals the activation-space error, GQA skips v→o, and AWQ composes with
the stages after it in the engine."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from conftest import tiny_model
from quantlab.algorithms import build_algorithm
from quantlab.algorithms.awq import (
    AWQ,
    apply_clip,
    collect_input_stats,
    fake_quantize,
    input_sites,
    output_error,
    search_clip,
    search_scales,
    token_subsample,
)
from quantlab.algorithms.rtn import RTN
from quantlab.engine.sequential import Batch, LayerContext, capture_layer0_inputs, run_sequential
from quantlab.models.arch import arch_spec_for
from quantlab.quant.primitives import quantize_weight
from quantlab.quant.scheme import WeightScheme
from quantlab.recipe import StageEntry, load_recipe

CPU = torch.device("cpu")
ASYM = WeightScheme(bits=4, symmetric=False, group_size=32)
SCHEMES = [ASYM, WeightScheme(bits=4, symmetric=True, group_size=32),
           WeightScheme(bits=3, symmetric=False, group_size=None),
           WeightScheme(bits=4, symmetric=True, group_size=64)]  # 96 inputs: tail group of 32


pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(n: int = 8, length: int = 48, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (n, length), generator=torch.Generator().manual_seed(seed))


def _model_with_outliers(model_type: str, **overrides) -> torch.nn.Module:
    """A tiny model whose norms feeding Linears emphasize a few channels, like real LLM
    activations (Gemma's norms multiply by `1 + weight`: the gain is what gets scaled)."""
    model = tiny_model(model_type, **overrides)
    spec = arch_spec_for(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            for group in spec.scaling:
                norm = layer.get_submodule(group.prev)
                if isinstance(norm, torch.nn.Linear):
                    continue
                gain = (norm.weight + spec.norm_offset) * torch.exp(torch.randn(norm.weight.shape, generator=gen))
                norm.weight.copy_(gain - spec.norm_offset)
    return model


def _scale_only(model: torch.nn.Module, awq: AWQ, ids: torch.Tensor) -> None:
    """Run only AWQ's scale search and folding on every layer, in float (no rounding)."""
    spec = arch_spec_for(model)
    batches = capture_layer0_inputs(model, spec, ids, 4, CPU)
    for index, layer in enumerate(spec.decoder_layers(model)):
        batches = [b.for_layer(index, b.hidden, CPU) for b in batches]
        ctx = LayerContext(index, f"{spec.layers}.{index}", layer, spec, batches, CPU)
        awq.scale_layer(ctx)
        batches = [Batch(out, b.kwargs, b.layer_kwargs) for out, b in zip(ctx.forward(), batches)]


def _linear_inputs(ctx: LayerContext, name: str) -> torch.Tensor:
    seen = []
    handle = ctx.linear(name).register_forward_hook(lambda m, a, o: seen.append(a[0].reshape(-1, a[0].shape[-1])))
    ctx.forward()
    handle.remove()
    return torch.cat(seen)


def _layer0_ctx(model: torch.nn.Module, ids: torch.Tensor) -> LayerContext:
    spec = arch_spec_for(model)
    batches = capture_layer0_inputs(model, spec, ids, 4, CPU)
    return LayerContext(0, f"{spec.layers}.0", spec.decoder_layers(model)[0], spec, batches, CPU)


# --------------------------------------------------------------------------- primitives


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_fake_quantize_matches_the_canonical_encoding(scheme):
    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(0))
    assert torch.equal(fake_quantize(w, scheme), quantize_weight(w, scheme).dequantize())


def test_gram_error_equals_activation_space_mse():
    gen = torch.Generator().manual_seed(0)
    x, delta = torch.randn(300, 40, generator=gen), torch.randn(16, 40, generator=gen)
    direct = (x @ delta.T).pow(2).mean().item()
    assert output_error(delta, x.T @ x / x.shape[0]) == pytest.approx(direct, rel=1e-4)


def test_token_subsample_is_seeded_and_bounded():
    sizes = [96] * 10
    a = token_subsample(sizes, 200, torch.Generator().manual_seed(3))
    b = token_subsample(sizes, 200, torch.Generator().manual_seed(3))
    assert a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    chosen, rows = a
    assert len(chosen) == 3 and sum(len(r) for r in rows) == 200
    assert all(r.numel() == 0 or (r.min() >= 0 and r.max() < 96) for r in rows)
    assert token_subsample(sizes, 10_000, torch.Generator().manual_seed(3))[0] == list(range(10))


# --------------------------------------------------------------------------- folding


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "gemma3_text"])
def test_random_scales_fold_exactly(model_type):
    """Every compatible group (GQA off, so v→o folds too) absorbs arbitrary positive scales."""
    model = tiny_model(model_type, num_key_value_heads=4)
    ids = _ids()
    reference = model(ids).logits
    spec = arch_spec_for(model)
    gen = torch.Generator().manual_seed(0)
    for layer in spec.decoder_layers(model):
        for group in spec.scaling:
            consumers = [layer.get_submodule(n) for n in group.linears]
            s = torch.exp(torch.randn(consumers[0].in_features, generator=gen))
            spec.fold_scales(layer.get_submodule(group.prev), consumers, s)
    assert torch.allclose(model(ids).logits, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "gemma3_text"])
def test_awq_folding_preserves_the_float_model(model_type):
    model = _model_with_outliers(model_type)
    ids = _ids()
    reference = model(ids).logits
    before = copy.deepcopy(model.state_dict())
    awq = AWQ(ASYM, max_tokens=256)
    _scale_only(model, awq, ids)
    folded = [r for r in awq.records if r.get("alpha") is not None]
    assert folded, "the search should pick a non-trivial scale somewhere"
    assert not torch.equal(model.model.layers[0].input_layernorm.weight, before["model.layers.0.input_layernorm.weight"])
    assert torch.allclose(model(ids).logits, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_gqa_skips_v_to_o_and_mha_folds_it(model_type):
    gqa = AWQ(ASYM, max_tokens=256)
    _scale_only(tiny_model(model_type), gqa, _ids())
    v_to_o = [r for r in gqa.records if r["prev"] == "self_attn.v_proj"]
    assert len(v_to_o) == 2 and all("shape mismatch" in r["skipped"] for r in v_to_o)
    mha = AWQ(ASYM, max_tokens=256)
    _scale_only(tiny_model(model_type, num_key_value_heads=4), mha, _ids())
    assert all("skipped" not in r for r in mha.records if r["prev"] == "self_attn.v_proj")


# --------------------------------------------------------------------------- searches


@pytest.mark.parametrize("duo", [False, True])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_scale_search_never_loses_to_rtn(scheme, duo):
    model = _model_with_outliers("qwen2")
    ctx = _layer0_ctx(model, _ids())
    group = ctx.spec.scaling[0]
    stats = collect_input_stats(ctx, input_sites(ctx.spec).values(), 256, seed=0)[group.linears[0]]
    w = torch.cat([ctx.linear(n).weight.data for n in group.linears])
    found = search_scales(w, stats.x_mean, stats.gram, scheme, grid=10, duo_scaling=duo)
    assert torch.isfinite(found.scales).all() and (found.scales > 0).all()
    assert found.error <= min(found.errors.values()) and found.error <= found.identity_error
    if not duo:  # α = 0 is plain RTN
        assert found.errors[0.0] == pytest.approx(found.identity_error)
    # the chosen scales' error, measured directly on the token subsample's activations
    s = found.scales
    delta = fake_quantize(w * s, scheme) / s - w
    assert output_error(delta, stats.gram) == pytest.approx(found.error, rel=1e-4)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_clip_search_never_increases_the_measured_error(scheme):
    model = _model_with_outliers("llama")
    ctx = _layer0_ctx(model, _ids())
    x = _linear_inputs(ctx, "mlp.down_proj")
    gram = x.T @ x / x.shape[0]
    w = ctx.linear("mlp.down_proj").weight.data.clone()
    lo, hi, err, unclipped = search_clip(w, gram, scheme, grid=20)
    assert (err <= unclipped).all() and (err < unclipped).any()
    clipped = apply_clip(w.clone(), lo, hi, scheme.group_size)
    # the RTN encoding of the clamped weight is exactly the searched quantizer
    assert torch.equal(quantize_weight(clipped, scheme).dequantize(), fake_quantize(w, scheme, lo, hi))
    # and the summed per-group error it reports is the error of that encoding
    d = quantize_weight(clipped, scheme).dequantize() - w
    g = x.shape[1] if scheme.group_size is None else scheme.group_size
    per_group = sum(output_error(d[:, i:i + g], gram[i:i + g, i:i + g]) for i in range(0, w.shape[1], g))
    assert per_group == pytest.approx(err.sum().item() / w.shape[0], rel=1e-4)
    assert per_group <= unclipped.sum().item() / w.shape[0]


# --------------------------------------------------------------------------- engine


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "gemma3_text"])
def test_awq_alone_returns_codes_for_every_linear_and_beats_rtn_at_every_layer(model_type):
    """Biased q/k/v with GQA (qwen2), q/k norms (qwen3), Gemma's norms and sliding window: every
    decoder layer's output is closer to float after AWQ than after RTN of the same scheme."""
    model = _model_with_outliers(model_type)
    spec, ids = arch_spec_for(model), _ids(seed=1)
    with torch.no_grad():
        reference = model(ids, output_hidden_states=True).hidden_states[1:]
    errors = {}
    for name, algorithms in {"rtn": [RTN(ASYM)], "awq": [AWQ(ASYM, max_tokens=512)]}.items():
        quantized_model = copy.deepcopy(model)
        quantized = run_sequential(quantized_model, spec, ids, algorithms, CPU, batch_size=4)
        assert len(quantized) == len(spec.linears) * 2
        for full, qw in quantized.items():  # the engine wrote AWQ's codes into the model
            assert torch.equal(quantized_model.get_submodule(full).weight, qw.dequantize())
        with torch.no_grad():
            states = quantized_model(ids, output_hidden_states=True).hidden_states[1:]
        errors[name] = [(s - r).pow(2).mean().item() for s, r in zip(states, reference)]
    assert all(a < r for a, r in zip(errors["awq"], errors["rtn"])), errors


def test_block_objective_measures_the_layer_output_and_restores_the_weights():
    """`objective: block`: a candidate's error is the layer output MSE with the group's Linears
    fake-quantized (s = 1: plain RTN of them), and the float weights are back afterwards; the
    chosen scales keep the float model's function."""
    from quantlab.algorithms.awq import _BlockError, fake_quantize

    model = _model_with_outliers("qwen2")
    ctx = _layer0_ctx(model, _ids())
    block = _BlockError.of(ctx, tokens=96)
    assert len(block.batches) == 1  # the first batch (4 × 48 tokens) covers 96
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    linears = [ctx.linear(n) for n in names]
    before = [lin.weight.detach().clone() for lin in linears]
    got = block.error(linears, torch.ones(64), ASYM)
    assert all(torch.equal(lin.weight, w) for lin, w in zip(linears, before))
    for lin in linears:
        lin.weight.data = fake_quantize(lin.weight.data, ASYM)
    expected = (dataclasses.replace(ctx, batches=block.batches).forward()[0] - block.reference[0]).pow(2).mean()
    assert got == pytest.approx(expected.item(), rel=1e-5)
    ids = _ids()
    model = _model_with_outliers("qwen2")
    reference = model(ids).logits
    awq = AWQ(ASYM, max_tokens=256, objective="block", block_tokens=96)
    _scale_only(model, awq, ids)
    assert any(r.get("alpha") is not None for r in awq.records if r["prev"] == "input_layernorm")
    assert torch.allclose(model(ids).logits, reference, atol=1e-4, rtol=1e-4)


class _Spy:
    """Records the weights the stage after AWQ sees."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def apply(self, ctx: LayerContext) -> dict:
        for name, qw in ctx.quantized.items():
            self.seen[f"{ctx.prefix}.{name}"] = (ctx.linear(name).weight.data.clone(), qw.dequantize())
        return {}


def test_stage_after_awq_sees_its_float_weights_not_its_rounding():
    model = _model_with_outliers("llama")
    spy = _Spy()
    run_sequential(model, arch_spec_for(model), _ids(), [AWQ(ASYM, max_tokens=256), spy], CPU, batch_size=4)
    assert len(spy.seen) == 14
    for weight, awq_rounding in spy.seen.values():
        assert not torch.equal(weight, awq_rounding)  # unrounded …
        assert torch.equal(quantize_weight(weight, ASYM).dequantize(), awq_rounding)  # … and what AWQ encoded


@pytest.mark.parametrize("after", ["rtn", "gptq"])
def test_awq_composes_with_a_following_encoder(after):
    model = _model_with_outliers("qwen2")
    ids = _ids()
    weights = {"bits": 4, "symmetric": False, "group_size": 32}
    stages = [StageEntry.model_validate({"awq": {"weights": weights, "max_tokens": 256}}),
              StageEntry.model_validate({after: {"weights": weights}})]
    algorithms = [build_algorithm(e) for e in stages]
    quantized = run_sequential(model, arch_spec_for(model), ids, algorithms, CPU, batch_size=4)
    assert len(quantized) == 14
    assert all(qw.scheme == ASYM for qw in quantized.values())
    assert any(r.get("alpha") is not None for r in algorithms[0].records)
    assert torch.isfinite(model(ids).logits).all()


def test_ignored_linears_stay_float_and_unencoded():
    model = _model_with_outliers("llama")
    before = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    awq = AWQ(ASYM, max_tokens=256, ignore=["*.mlp.down_proj"])
    quantized = run_sequential(model, arch_spec_for(model), _ids(), [awq], CPU, batch_size=4)
    assert not any(name.endswith("down_proj") for name in quantized)
    assert all("skipped" in r for r in awq.records if r.get("prev") == "mlp.up_proj")
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, before)


# --------------------------------------------------------------------------- recipes


@pytest.mark.parametrize("recipe", ["smollm2_awq_w4a16.yaml", "qwen2_awq_int4.yaml"])
def test_shipped_awq_recipes_validate(recipe):
    from conftest import REPO

    loaded = load_recipe(REPO / "recipes" / recipe)
    assert loaded.stages[0].kind == "awq" and not loaded.stages[0].config.weights.symmetric


def test_awq_stage_accepts_presets_and_rejects_unknown_keys():
    entry = StageEntry.model_validate({"awq": {"weights": "W4A16_ASYM", "duo_scaling": False}})
    assert entry.config.weights.group_size == 128 and entry.config.grid == 20
    with pytest.raises(Exception, match="grids"):
        StageEntry.model_validate({"awq": {"grids": 10}})
