"""The sequential engine with RTN on tiny models of each dense family."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from quantlab.algorithms.rtn import RTN
from quantlab.engine.sequential import LayerContext, capture_layer0_inputs, run_sequential
from quantlab.models.arch import arch_spec_for
from quantlab.quant.primitives import QuantizedWeight, quantize_weight
from quantlab.quant.scheme import WeightScheme
from conftest import tiny_model

CPU = torch.device("cpu")
FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "gemma3_text")
SCHEME = WeightScheme(bits=4, symmetric=False, group_size=32)  # down_proj (in 96) gets 3 groups


@dataclass
class Spy:
    """An algorithm that quantizes nothing and records what the engine showed it."""

    seen: list[dict] = field(default_factory=list)

    def apply(self, ctx: LayerContext) -> dict[str, QuantizedWeight]:
        self.seen.append({"index": ctx.index, "prefix": ctx.prefix, "batches": len(ctx.batches),
                          "hidden": [b.hidden.clone() for b in ctx.batches]})
        return {}


def decoder_linears(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    spec = arch_spec_for(model)
    return {f"{spec.layers}.{i}.{name}": layer.get_submodule(name).weight.detach().clone()
            for i, layer in enumerate(spec.decoder_layers(model)) for name in spec.linears}


def ids(n: int, length: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_rtn_quantizes_every_decoder_linear_like_quantize_weight(family: str) -> None:
    model = tiny_model(family)
    original = decoder_linears(model)
    others = {k: v.clone() for k, v in model.state_dict().items() if ".".join(k.split(".")[:-1]) not in original}
    spy = Spy()
    quantized = run_sequential(model, arch_spec_for(model), ids(5), [RTN(SCHEME), spy], CPU, batch_size=2)

    assert len(quantized) == 7 * 2 and set(quantized) == set(original)
    for name, qw in quantized.items():
        expected = quantize_weight(original[name], SCHEME)
        assert torch.equal(qw.codes, expected.codes), name
        assert torch.equal(qw.scales, expected.scales) and torch.equal(qw.zeros, expected.zeros)
        assert torch.equal(qw.g_idx, expected.g_idx) and qw.scheme == SCHEME
        # the model now computes with the dequantized weights
        assert torch.equal(model.get_submodule(name).weight, expected.dequantize())
    # embeddings, norms, biases, lm_head are untouched
    for key, value in model.state_dict().items():
        if key in others:
            assert torch.equal(value, others[key]), key
    assert [s["batches"] for s in spy.seen] == [3, 3]  # ceil(5 / 2) batches at every layer
    assert [s["prefix"] for s in spy.seen] == ["model.layers.0", "model.layers.1"]


@pytest.mark.parametrize("n,batch_size", [(7, 3), (4, 4), (1, 8), (9, 2)])
def test_captured_batches(n: int, batch_size: int) -> None:
    model = tiny_model("llama")
    batches = capture_layer0_inputs(model, arch_spec_for(model), ids(n), batch_size, CPU)
    assert len(batches) == -(-n // batch_size)
    sizes = [b.hidden.shape[0] for b in batches]
    assert sum(sizes) == n and all(s <= batch_size for s in sizes)
    assert all(b.hidden.shape[1:] == (24, 64) for b in batches)
    assert all("past_key_values" not in b.kwargs and b.kwargs["use_cache"] is False for b in batches)
    # layer 0 sees the token embeddings
    embedded = model.get_input_embeddings()(ids(n))
    assert torch.equal(torch.cat([b.hidden for b in batches]), embedded)


@pytest.mark.parametrize("family", FAMILIES)
def test_later_layers_see_the_quantized_model(family: str) -> None:
    """Layer i's calibration inputs are the hidden states of the already-quantized layers."""
    model = tiny_model(family, seed=1)
    spy = Spy()
    run_sequential(model, arch_spec_for(model), ids(3, seed=2), [RTN(SCHEME), spy], CPU, batch_size=2)
    with torch.no_grad():
        states = model(ids(3, seed=2), output_hidden_states=True, use_cache=False).hidden_states
    for layer, seen in enumerate(spy.seen):
        torch.testing.assert_close(torch.cat(seen["hidden"]), states[layer], rtol=1e-5, atol=1e-5)


def test_zero_calibration_samples() -> None:
    model = tiny_model("llama")
    original = decoder_linears(model)
    spy = Spy()
    quantized = run_sequential(model, arch_spec_for(model), torch.zeros(0, 1, dtype=torch.int64),
                               [RTN(SCHEME), spy], CPU)
    assert [s["batches"] for s in spy.seen] == [0, 0]
    assert set(quantized) == set(original)
    for name, qw in quantized.items():
        assert torch.equal(qw.codes, quantize_weight(original[name], SCHEME).codes)


def test_ignore_patterns_leave_linears_in_float() -> None:
    model = tiny_model("qwen2")
    original = decoder_linears(model)
    algo = RTN(SCHEME, ignore=["*.mlp.down_proj", "model.layers.1.self_attn.*"])
    quantized = run_sequential(model, arch_spec_for(model), ids(2), [algo], CPU)
    assert sorted(quantized) == sorted([
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
        "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
        "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj",
    ])
    for name in set(original) - set(quantized):
        assert torch.equal(model.get_submodule(name).weight, original[name])


def test_unsupported_architecture_is_a_user_error() -> None:
    from quantlab.errors import UserError

    model = tiny_model("llama")
    model.config.model_type = "gpt2"
    with pytest.raises(UserError, match=r"^model: architecture 'gpt2' is not supported"):
        arch_spec_for(model)


def test_data_free_stages_run_no_calibration_forward() -> None:
    """RTN alone never runs the layers (no calibration forward), and encodes the same codes."""
    model, reference = tiny_model("llama", seed=4), tiny_model("llama", seed=4)
    calls = []
    for layer in arch_spec_for(model).decoder_layers(model):
        layer.register_forward_pre_hook(lambda *_: calls.append(1))
    quantized = run_sequential(model, arch_spec_for(model), ids(3, seed=2), [RTN(SCHEME)], CPU)
    assert calls == []
    expected = run_sequential(reference, arch_spec_for(reference), ids(3, seed=2), [RTN(SCHEME), Spy()], CPU)
    assert set(quantized) == set(expected)
    for name, qw in quantized.items():
        assert torch.equal(qw.codes, expected[name].codes) and torch.equal(qw.scales, expected[name].scales)


@pytest.mark.parametrize("stages", ["gptq", "awq+gptq"])
def test_folded_weights_are_what_the_winning_stage_rounded(stages: str) -> None:
    """`folded` gets the float weights the codes were rounded from: GPTQ writes its rounding
    into the weights as it goes, so the engine keeps what GPTQ started from — the original
    weights alone, AWQ's rescaled ones after AWQ — never the rounded ones."""
    from quantlab.algorithms.awq import AWQ
    from quantlab.algorithms.gptq import GPTQ

    model = tiny_model("llama")
    original = decoder_linears(model)
    algorithms = ([AWQ(SCHEME)] if stages.startswith("awq") else []) + [GPTQ(SCHEME)]
    folded: dict[str, torch.Tensor] = {}
    quantized = run_sequential(model, arch_spec_for(model), ids(4), algorithms, CPU, batch_size=2, folded=folded)
    assert set(folded) == set(quantized)
    for name, qw in quantized.items():
        w, rounded = folded[name].float(), qw.dequantize()
        assert float((w - rounded).norm() / w.norm()) > 1e-2, name  # not the rounded weight
        if stages == "gptq":
            assert torch.equal(folded[name], original[name].half()), name
        # the codes are a 4-bit rounding of it (GPTQ's compensation moves codes a little)
        assert float((w - rounded).norm() / w.norm()) < 0.2, name
    if stages == "awq+gptq":  # AWQ rescaled some inputs: those weights are not the original ones
        assert any(not torch.equal(folded[n], original[n].half()) for n in quantized)


def test_head_stage_unties_and_quantizes_lm_head_alone() -> None:
    """`head_algorithms` quantize lm_head after the last layer: a tied embedding is copied
    first, so the input embedding stays float while lm_head holds the dequantized codes."""
    model = tiny_model("llama", seed=3)  # tied
    embed = model.get_input_embeddings().weight.detach().clone()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    quantized = run_sequential(model, arch_spec_for(model), ids(2), [RTN(SCHEME)], CPU,
                               head_algorithms=[RTN(SCHEME)])
    assert "lm_head" in quantized and len(quantized) == 2 * 7 + 1
    assert torch.equal(quantized["lm_head"].codes, quantize_weight(embed, SCHEME).codes)
    assert torch.equal(model.get_input_embeddings().weight, embed)
    assert torch.equal(model.lm_head.weight, quantized["lm_head"].dequantize())
    assert model.config.tie_word_embeddings is False


def test_gptq_head_compensates_on_the_final_norm_outputs() -> None:
    """GPTQ on lm_head observes what the head really reads (the final norm of the last layer's
    quantized outputs): its logits on those inputs are closer to the float head's than RTN's."""
    from quantlab.algorithms.gptq import GPTQ

    calib = ids(8, length=32, seed=5)
    outs = {}
    for name, head in (("rtn", RTN(SCHEME)), ("gptq", GPTQ(SCHEME))):
        model = tiny_model("qwen2", seed=6)  # untied
        w = model.lm_head.weight.detach().clone()
        captured = []
        model.model.norm.register_forward_hook(lambda _m, _a, out: captured.append(out.detach()))
        quantized = run_sequential(model, arch_spec_for(model), calib, [RTN(SCHEME)], CPU, batch_size=4,
                                   head_algorithms=[head])
        with torch.no_grad():
            model(calib)  # the quantized body: the head's inputs as GPTQ saw them
        x = captured[-1].reshape(-1, w.shape[1])
        outs[name] = float((x @ quantized["lm_head"].dequantize().t() - x @ w.t()).norm())
        if name == "gptq":
            assert head.stats["lm_head"]["tokens"] == calib.numel()
    assert outs["gptq"] < 0.9 * outs["rtn"], outs
