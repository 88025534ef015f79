"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): unfusing the experts is exact, the
expanded ArchSpec names every expert, RTN / GPTQ / AWQ quantize every expert Linear and never
the router or the shared-expert gate, AWQ's folds keep the float function (router included),
experts no calibration token reaches still get quantized and are reported, the canonical form
round-trips, compressed-tensors / AWQ / GPTQ exports load in transformers and gptqmodel with
the fake-quant model's logits, and the other exporters refuse MoE models by name."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import WIKI_TRAIN, tiny_model
from quantlab.algorithms.act_ranges import ActRanges
from quantlab.algorithms.awq import AWQ, RoutedGram, output_error
from quantlab.algorithms.gptq import GPTQ
from quantlab.algorithms.rtn import RTN
from quantlab.algorithms.smoothquant import SmoothQuant
from quantlab.engine.sequential import LayerContext, run_sequential
from quantlab.errors import UserError
from quantlab.export import api
from quantlab.models.arch import arch_spec_for
from quantlab.models.moe import Experts, calibrate_all_experts, unfuse_experts
from quantlab.pipeline import run_recipe
from quantlab.quant.canonical import load_canonical, load_fake_quant_model, save_canonical
from quantlab.quant.primitives import quantize_weight
from quantlab.quant.scheme import WeightScheme
from quantlab.recipe import validate_recipe

CPU = torch.device("cpu")
SCHEME = WeightScheme(bits=4, symmetric=False, group_size=32)
MOE_TYPES = ["mixtral", "qwen2_moe", "qwen3_moe"]
ALGORITHMS = {"rtn": lambda: RTN(SCHEME), "gptq": lambda: GPTQ(SCHEME), "awq": lambda: AWQ(SCHEME, max_tokens=256)}
FLOAT_ONLY = ("mlp.gate", "mlp.shared_expert_gate")  # router and shared-expert gate


pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(n: int = 8, length: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (n, length), generator=torch.Generator().manual_seed(seed))


def unfused_model(model_type: str, seed: int = 0) -> nn.Module:
    model = tiny_model(model_type, seed=seed)
    assert unfuse_experts(model) == 2  # one experts module per layer
    return model


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _route_to_first_two(model: nn.Module) -> None:
    """Every token goes to experts 0 and 1 (a router hook rewrites its top-k choice); 2 and 3 see none."""
    def hook(_module: nn.Module, _args: tuple, out: tuple) -> tuple:
        logits, weights, index = out
        return logits, weights, torch.tensor([0, 1]).expand_as(index)

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(hook)


# --------------------------------------------------------------------------- unfusing


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_unfusing_is_exact(model_type):
    model = tiny_model(model_type)
    ids = _ids(3, 17)
    fused_default = _logits(model, ids)  # grouped_mm
    model.config._experts_implementation = "eager"
    fused_eager = _logits(model, ids)
    fused = {i: (layer.mlp.experts.gate_up_proj.detach().clone(), layer.mlp.experts.down_proj.detach().clone())
             for i, layer in enumerate(model.model.layers)}

    assert unfuse_experts(model) == 2 and unfuse_experts(model) == 0  # idempotent
    out = _logits(model, ids)
    assert torch.equal(out, fused_eager)  # the eager loop, bit for bit
    assert torch.allclose(out, fused_default, atol=1e-6, rtol=0)
    assert not any(name.endswith(("gate_up_proj", "experts.down_proj")) for name, _ in model.named_parameters())
    inter = model.config.intermediate_size if model_type == "mixtral" else model.config.moe_intermediate_size
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer.mlp.experts, Experts) and len(layer.mlp.experts) == 4
        assert not any(m.training for m in layer.mlp.experts.modules())  # eval, like the model
        gate_up, down = fused[i]
        for e, expert in enumerate(layer.mlp.experts):
            assert torch.equal(expert.gate_proj.weight, gate_up[e, :inter])
            assert torch.equal(expert.up_proj.weight, gate_up[e, inter:])
            assert torch.equal(expert.down_proj.weight, down[e])


def test_unrouted_expert_is_never_called():
    """Hooks on an expert's Linears see exactly its routed tokens: none for an unrouted expert."""
    model = unfused_model("mixtral")
    _route_to_first_two(model)
    rows: dict[int, int] = {}
    for e, expert in enumerate(model.model.layers[0].mlp.experts):
        expert.gate_proj.register_forward_pre_hook(lambda m, a, e=e: rows.update({e: rows.get(e, 0) + a[0].shape[0]}))
    _logits(model, _ids(2, 10))
    assert rows == {0: 20, 1: 20}


# --------------------------------------------------------------------------- ArchSpec


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_spec_names_every_expert_and_no_router(model_type):
    model = unfused_model(model_type)
    spec = arch_spec_for(model)
    shared = model_type == "qwen2_moe"
    assert len(spec.linears) == 4 + 3 * 4 + 3 * shared
    layer = model.model.layers[0]
    assert all(isinstance(layer.get_submodule(n), nn.Linear) for n in spec.linears)
    assert {f"mlp.experts.{e}.{p}_proj" for e in range(4) for p in ("gate", "up", "down")} <= set(spec.linears)
    assert not set(FLOAT_ONLY) & set(spec.linears)
    # the post-attention norm feeds every expert and the router: a fold must reach all of them
    (norm_group,) = [g for g in spec.scaling if g.prev == "post_attention_layernorm"]
    assert "mlp.gate" in norm_group.linears and ("mlp.shared_expert_gate" in norm_group.linears) == shared
    assert ("mlp.experts.2.up_proj", ("mlp.experts.2.down_proj",)) in [(g.prev, g.linears) for g in spec.scaling]
    # each expert reads its own tokens: its gate/up share one input, other experts' do not
    assert ("mlp.experts.1.gate_proj", "mlp.experts.1.up_proj") in spec.input_sets
    assert all(len({n.split(".")[2] for n in s if n.startswith("mlp.experts")}) <= 1 for s in spec.input_sets)
    # true-sequential: all gate/up before any down
    order = {n: i for i, group in enumerate(spec.sequential) for n in group}
    assert max(order[f"mlp.experts.{e}.up_proj"] for e in range(4)) < min(order[f"mlp.experts.{e}.down_proj"]
                                                                          for e in range(4))


def test_fused_moe_model_is_refused():
    with pytest.raises(UserError, match=r"layer 0 has no Linear 'mlp\.experts\.0\.gate_proj'.*unfuse"):
        arch_spec_for(tiny_model("mixtral"))


def test_dense_layers_in_a_moe_model_are_refused():
    model = tiny_model("qwen2_moe", mlp_only_layers=[1])
    unfuse_experts(model)
    with pytest.raises(UserError, match=r"qwen2_moe layer 1 has no Linear 'mlp\.experts\.0\.gate_proj'"):
        arch_spec_for(model)


def test_unsupported_architecture_lists_the_supported_ones():
    fake = SimpleNamespace(config=SimpleNamespace(model_type="gpt_neox"))
    with pytest.raises(UserError, match=r"'gpt_neox' is not supported yet; supported: .*mixtral.*qwen2_moe"):
        arch_spec_for(fake)


# --------------------------------------------------------------------------- algorithms


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_stages_quantize_every_expert_and_keep_the_router_float(model_type, algorithm):
    model = unfused_model(model_type)
    spec = arch_spec_for(model)
    float_only = {k: v.clone() for k, v in model.state_dict().items()
                  if k.endswith(tuple(f"{n}.weight" for n in FLOAT_ONLY))}
    assert len(float_only) == 2 * (1 + (model_type == "qwen2_moe"))
    algo = ALGORITHMS[algorithm]()
    quantized = run_sequential(model, spec, _ids(), [algo], CPU, batch_size=4)

    assert set(quantized) == {f"model.layers.{i}.{n}" for i in range(2) for n in spec.linears}
    assert not any(name.endswith(FLOAT_ONLY) for name in quantized)
    for name, qw in quantized.items():  # the engine wrote every expert's codes back
        assert torch.equal(model.get_submodule(name).weight, qw.dequantize()), name
    if algorithm != "awq":  # (AWQ's folds rescale them, in float: tested below)
        state = model.state_dict()
        assert all(torch.equal(state[key], before) for key, before in float_only.items())
    if algorithm == "gptq":  # each expert's Hessian comes from its routed tokens only
        for i in range(2):
            routed = sum(algo.stats[f"model.layers.{i}.mlp.experts.{e}.gate_proj"]["tokens"] for e in range(4))
            assert routed == model.config.num_experts_per_tok * _ids().numel()
            assert all(algo.stats[f"model.layers.{i}.mlp.experts.{e}.down_proj"]["tokens"] > 0 for e in range(4))
            if model_type == "qwen2_moe":
                assert algo.stats[f"model.layers.{i}.mlp.shared_expert.gate_proj"]["tokens"] == _ids().numel()


def test_routed_gram_error_is_the_mse_over_routed_outputs():
    """AWQ's shared-scale objective for experts reading different tokens, checked in activation space."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(t, 16, generator=gen) for t in (50, 7)]
    deltas = [torch.randn(r, 16, generator=gen) for r in (6, 4)]
    gram = RoutedGram([6, 4], [x.T @ x / x.shape[0] for x in xs], [50, 7])
    direct = sum((x @ d.T).pow(2).sum() for x, d in zip(xs, deltas)) / (50 * 6 + 7 * 4)
    assert output_error(torch.cat(deltas), gram) == pytest.approx(direct.item(), rel=1e-4)


class _FoldOnly:
    """AWQ's scale search and folding, in float; the engine then writes no codes back."""

    def __init__(self, awq: AWQ) -> None:
        self.awq = awq

    def apply(self, ctx: LayerContext) -> dict:
        self.awq.scale_layer(ctx)
        return {}


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_awq_folding_preserves_the_float_moe_model(model_type):
    model = unfused_model(model_type)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # outlier channels, so the searches do pick non-identity scales
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight.mul_(torch.exp(2 * torch.randn(64, generator=gen)))
    ids = _ids()
    reference = _logits(model, ids)
    routers = [layer.mlp.gate.weight.detach().clone() for layer in model.model.layers]
    awq = AWQ(SCHEME, max_tokens=256)
    run_sequential(model, arch_spec_for(model), ids, [_FoldOnly(awq)], CPU, batch_size=4)

    folded = {r["layer"] for r in awq.records
              if r.get("prev") == "post_attention_layernorm" and r.get("alpha") is not None}
    assert folded, "no fold into the post-attention norm happened: the test would prove nothing"
    for i in folded:  # the router absorbed the norm's scales
        assert not torch.equal(model.model.layers[i].mlp.gate.weight, routers[i])
    assert torch.allclose(_logits(model, ids), reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_experts_without_tokens_are_quantized_and_reported(model_type, capsys):
    ids = _ids()
    gptq_model = unfused_model(model_type)
    _route_to_first_two(gptq_model)
    floats = {n: p.detach().clone() for n, p in gptq_model.named_parameters()}
    gptq = GPTQ(SCHEME)
    quantized = run_sequential(gptq_model, arch_spec_for(gptq_model), ids, [gptq], CPU, batch_size=4)
    assert "no calibration tokens reached it" in capsys.readouterr().err
    for i in range(2):
        for e in range(4):
            for proj in ("gate", "up", "down"):
                name = f"model.layers.{i}.mlp.experts.{e}.{proj}_proj"
                assert (gptq.stats[name]["tokens"] == 0) == (e >= 2), name
                if e >= 2:  # RTN of its untouched float weight
                    rtn = quantize_weight(floats[f"{name}.weight"], SCHEME)
                    assert torch.equal(quantized[name].codes, rtn.codes), name

    awq_model = unfused_model(model_type)
    _route_to_first_two(awq_model)
    awq = AWQ(SCHEME, max_tokens=256)
    quantized = run_sequential(awq_model, arch_spec_for(awq_model), ids, [awq], CPU, batch_size=4)
    assert "no calibration tokens reached" in capsys.readouterr().err
    assert all(f"model.layers.{i}.mlp.experts.{e}.{p}_proj" in quantized
               for i in range(2) for e in range(4) for p in ("gate", "up", "down"))
    norm = [r for r in awq.records if r.get("prev") == "post_attention_layernorm"]
    assert all(set(r["no_tokens"]) == {f"mlp.experts.{e}.{p}_proj" for e in (2, 3) for p in ("gate", "up")}
               and "alpha" in r for r in norm)  # searched on the routed experts
    down = {r["prev"]: r for r in awq.records if r.get("prev", "").endswith("up_proj")}
    assert "skipped" in down["mlp.experts.3.up_proj"] and "skipped" not in down["mlp.experts.0.up_proj"]


def test_all_experts_calibrates_every_expert_and_keeps_the_outputs():
    """`calibration.all_experts`: experts 2 and 3, never routed to, get GPTQ Hessians from every
    token like the others, while routing (counted) and the layer outputs stay the same."""
    ids = _ids()
    model = unfused_model("qwen3_moe")
    _route_to_first_two(model)
    reference = _logits(model, ids)
    assert calibrate_all_experts(model, True) == 2
    torch.testing.assert_close(_logits(model, ids), reference, rtol=1e-6, atol=1e-6)
    gptq, routed = GPTQ(SCHEME), {}
    run_sequential(model, arch_spec_for(model), ids, [gptq], CPU, batch_size=4, routed=routed)
    assert routed == {f"model.layers.{i}.mlp.experts": [256, 256, 0, 0] for i in range(2)}
    assert {gptq.stats[f"model.layers.{i}.mlp.experts.{e}.{p}_proj"]["tokens"]
            for i in range(2) for e in range(4) for p in ("gate", "up", "down")} == {256}


@pytest.mark.parametrize("stage", [SmoothQuant(), ActRanges()], ids=["smoothquant", "act_ranges"])
def test_stages_without_moe_support_refuse_by_name(stage):
    model = unfused_model("mixtral")
    with pytest.raises(UserError, match=r"mixture-of-experts models \(mixtral\) are not supported"):
        run_sequential(model, arch_spec_for(model), _ids(2), [stage], CPU)


# --------------------------------------------------------------------------- canonical form and exports


@pytest.fixture(scope="module", params=MOE_TYPES)
def canonical(request, tmp_path_factory, tokenizer) -> tuple[str, nn.Module, Path]:
    model = unfused_model(request.param, seed=3)
    quantized = run_sequential(model, arch_spec_for(model), _ids(), [RTN(SCHEME)], CPU, batch_size=4)
    target = tmp_path_factory.mktemp(request.param) / "quantized"
    save_canonical(target, model, quantized, tokenizer)
    return request.param, model, target


def test_canonical_round_trip_rebuilds_the_quantized_moe_model(canonical):
    model_type, model, target = canonical
    tensors, quantized = load_canonical(target)
    assert "model.layers.1.mlp.experts.3.down_proj" in quantized
    assert "model.layers.0.mlp.gate.weight" in tensors  # the router, in float
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" not in tensors  # codes only
    loaded = load_fake_quant_model(target)  # re-unfused, then loaded strictly by name
    assert loaded.config.model_type == model_type
    ids = _ids(2, 20, seed=5)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


@pytest.mark.parametrize("fmt", ["trtllm", "paddlenlp"])
def test_exporters_without_moe_layouts_refuse_by_name(canonical, fmt, tmp_path):
    model_type, _, target = canonical
    with pytest.raises(UserError, match=repr(model_type)):
        api.export(target, tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module", params=MOE_TYPES)
def symmetric(request, tmp_path_factory, tokenizer) -> tuple[str, Path]:
    """A W4 g32 symmetric canonical form whose routers are decisive (weights ×30): a random
    router's near-ties would let last-bit differences between engines pick other experts."""
    model = unfused_model(request.param, seed=4)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(30)
    scheme = WeightScheme(bits=4, symmetric=True, group_size=32)
    quantized = run_sequential(model, arch_spec_for(model), _ids(), [RTN(scheme)], CPU, batch_size=4)
    target = tmp_path_factory.mktemp(f"{request.param}-sym") / "quantized"
    save_canonical(target, model, quantized, tokenizer)
    return request.param, target


def test_compressed_tensors_moe_loads_in_transformers(symmetric, tmp_path):
    """Per-expert packed tensors under the names transformers' MoE loader merges (Mixtral's
    `block_sparse_moe.experts.{e}.w1/w3/w2`), routers in `ignore`: the same logits."""
    from transformers import AutoModelForCausalLM

    model_type, target = symmetric
    out = tmp_path / "ct"
    assert api.export(target, out, "compressed-tensors").ok
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = _ids(2, 20, seed=6)
    assert torch.equal(_logits(loaded, ids), _logits(load_fake_quant_model(target), ids))
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    router = "block_sparse_moe.gate" if model_type == "mixtral" else "mlp.gate"
    assert f"model.layers.1.{router}" in ignore


# one format per family: both share gptqmodel's MoE loader, the dense tests cover each packing
GPTQMODEL_FORMAT = {"qwen2_moe": "gptq", "qwen3_moe": "awq", "mixtral": "awq"}


def test_awq_or_gptq_moe_loads_with_gptqmodel(symmetric, tmp_path):
    """gptqmodel's MoE layout (`mlp.experts.{e}.gate_proj.qweight`, …) loaded by
    `GPTQModel.load` in its own environment: fp16 logits as the fake-quant model's."""
    from test_export_loaders import assert_close_fp16, gptqmodel_logits

    model_type, target = symmetric
    fmt = GPTQMODEL_FORMAT[model_type]
    out = tmp_path / fmt
    assert api.export(target, out, fmt).ok
    assert_close_fp16(gptqmodel_logits(out, layer_class="Awq" if fmt == "awq" else ""), target)


def test_recipe_run_quantizes_a_saved_moe_checkpoint(tmp_path, tokenizer):
    """Loading from disk unfuses (float model), the canonical form reloads into an unfused
    model (quantized eval): both perplexities come out, the quantized one from every expert."""
    model_dir, data = tmp_path / "model", tmp_path / "data.txt"
    tiny_model("qwen2_moe").save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data.write_text("".join(WIKI_TRAIN.read_text(encoding="utf-8").splitlines(keepends=True)[:150]))
    recipe = validate_recipe({
        "name": "moe", "seed": 0, "device": "cpu", "model": {"id": str(model_dir)},
        "calibration": {"dataset": {"source": str(data)}, "num_samples": 4, "seq_len": 32},
        "stages": [{"gptq": {"weights": {"bits": 4, "symmetric": False, "group_size": 32}}}],
        "evaluate": {"perplexity": {"dataset": {"source": str(data)}, "seq_len": 32, "max_windows": 2}},
        "output": {"dir": str(tmp_path / "run")},
    })
    run_recipe(recipe)
    modules = json.loads((tmp_path / "run" / "quantized" / "quant_config.json").read_text())["modules"]
    assert len(modules) == 2 * (4 + 3 * 4 + 3) and "model.layers.0.mlp.shared_expert_gate" not in modules
    report = json.loads((tmp_path / "run" / "reports" / "report.json").read_text())
    results = report["perplexity"]
    assert sorted(r["model"] for r in results) == ["float", "quantized"]
    assert all(0 < r["perplexity"] < float("inf") for r in results)
    coverage = report["expert_coverage"]  # 4 × 32 calibration tokens, 2 experts each, per layer
    assert [row["total"] for row in coverage["layers"]] == [256, 256] and coverage["experts"] == 8
    assert "## Expert coverage" in (tmp_path / "run" / "reports" / "report.md").read_text()
    assert "Expert coverage" in (tmp_path / "run" / "reports" / "report.html").read_text()
