"""PaddleNLP scale tables: key names per family, absmax semantics, num_heads entries under GQA,
and the same tables from memory and from the canonical directory."""

from __future__ import annotations

import json

import pytest
import torch

from quantlab.algorithms.act_ranges import ActRanges, canonical_entries
from quantlab.algorithms.rtn import RTN
from quantlab.engine.sequential import run_sequential
from quantlab.models.arch import arch_spec_for
from quantlab.quant.canonical import save_canonical
from quantlab.quant.scale_tables import (
    kv_head_list,
    paddle_name,
    scale_tables,
    scale_tables_from_canonical,
    write_scale_tables,
)
from quantlab.quant.scheme import PRESETS, ActivationScheme, KVCacheScheme
from conftest import tiny_model

LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def quantize(model_type: str, weights=PRESETS["W8A16"], kv_granularity: str = "head"):
    model = tiny_model(model_type)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    stage = ActRanges(ActivationScheme(dynamic=False, granularity="tensor"), KVCacheScheme(granularity=kv_granularity))
    scales: dict[str, torch.Tensor] = {}
    quantized = run_sequential(model, arch_spec_for(model), ids, [RTN(weights), stage], torch.device("cpu"),
                               scales=scales)
    config = canonical_entries(stage, scales)
    return model, quantized, scales, config


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_keys_follow_paddlenlp_naming(model_type: str):
    model, quantized, scales, config = quantize(model_type)
    tables = scale_tables(model.config.to_dict(), config, quantized, scales)
    assert set(tables) == {"weight_scales.json", "act_scales.json", "cachekv_scales.json"}
    layers = range(model.config.num_hidden_layers)
    assert set(tables["weight_scales.json"]) == {
        f"{model_type}.layers.{i}.{n}.weight_quanter" for i in layers for n in LINEARS}
    assert set(tables["act_scales.json"]) == {
        f"{model_type}.layers.{i}.{n}.activation_quanter" for i in layers for n in LINEARS}
    assert set(tables["cachekv_scales.json"]) == {
        f"{model_type}.layers.{i}.self_attn.{c}_matmul.activation_quanter" for i in layers for c in ("cachek", "cachev")}


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_values_are_absmax(model_type: str):
    model, quantized, scales, config = quantize(model_type)
    tables = scale_tables(model.config.to_dict(), config, quantized, scales)
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    assert heads == 2 * kv_heads  # the tiny config is GQA
    name = "model.layers.1.mlp.down_proj"
    qw = quantized[name]
    w_scale = torch.tensor(tables["weight_scales.json"][f"{paddle_name(name, model_type)}.weight_quanter"])
    assert w_scale.shape == (qw.codes.shape[0],)
    # Paddle stores round(127·w/absmax): that must give back our exact codes
    w = qw.dequantize()
    ints = torch.round(127 * w / w_scale[:, None])
    torch.testing.assert_close(ints, qw.codes.float() - 128)
    assert ints.abs().max() <= 128
    # an absmax (the row's range, to within one step), not a step size
    original = model.model.layers[1].mlp.down_proj.weight  # holds the dequantized weight
    assert ((w_scale - original.abs().amax(dim=1)).abs() <= qw.scales[:, 0] * 1.01).all()
    act = tables["act_scales.json"][f"{paddle_name(name, model_type)}.activation_quanter"]
    assert act == pytest.approx(float(scales[f"{name}.input_absmax"]))
    k_list = tables["cachekv_scales.json"][f"{model_type}.layers.1.self_attn.cachek_matmul.activation_quanter"]
    k_absmax = scales["model.layers.1.self_attn.k_absmax"]
    assert len(k_list) == heads
    # PaddleNLP's CacheScaleLoader reads entry j·(heads/kv) for KV head j
    assert k_list[:: heads // kv_heads] == pytest.approx(k_absmax.tolist())
    assert k_list == pytest.approx(k_absmax.repeat_interleave(heads // kv_heads).tolist())


def test_per_tensor_kv_repeats_the_max():
    assert kv_head_list(torch.tensor([1.0, 3.0]), 4, per_head=False) == [3.0] * 4
    assert kv_head_list(torch.tensor([1.0, 3.0]), 4, per_head=True) == [1.0, 1.0, 3.0, 3.0]
    assert kv_head_list(torch.tensor([1.0, 3.0]), 2, per_head=True) == [1.0, 3.0]


def test_fp8_weight_scales_are_absmax():
    for preset, per_tensor in (("FP8", False), ("FP8_PER_TENSOR", True)):
        model, quantized, scales, config = quantize("llama", weights=PRESETS[preset])
        tables = scale_tables(model.config.to_dict(), config, quantized, scales)
        value = tables["weight_scales.json"]["llama.layers.0.self_attn.q_proj.weight_quanter"]
        w = model.model.layers[0].self_attn.q_proj.weight  # holds the dequantized FP8 weight
        if per_tensor:
            assert isinstance(value, float) and value == pytest.approx(w.abs().max().item(), rel=1e-6)
        else:
            assert value == pytest.approx(w.abs().amax(dim=1).tolist(), rel=1e-6)


def test_low_bit_weights_are_refused():
    model, quantized, scales, config = quantize("llama", weights=PRESETS["W4A16"])
    with pytest.raises(ValueError, match="int8"):
        scale_tables(model.config.to_dict(), config, quantized, scales)


def test_canonical_round_trip_and_files(tmp_path, tokenizer):
    model, quantized, scales, config = quantize("qwen2")
    save_canonical(tmp_path / "q", model, quantized, tokenizer, config, scales=scales)
    from_disk = scale_tables_from_canonical(tmp_path / "q")
    assert from_disk == scale_tables(model.config.to_dict(), config, quantized, scales)
    written = write_scale_tables(tmp_path / "q", from_disk)
    assert sorted(p.name for p in written) == ["act_scales.json", "cachekv_scales.json", "weight_scales.json"]
    assert json.loads((tmp_path / "q" / "act_scales.json").read_text()) == from_disk["act_scales.json"]


def test_a_quantized_head_keeps_its_paddle_name():
    """With `lm_head: true` the head's weight scale is `lm_head.weight_quanter` (a top-level
    module in PaddleNLP), not under the decoder's prefix; its input stays float."""
    model = tiny_model("qwen2")
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    stage = ActRanges(ActivationScheme(dynamic=False, granularity="tensor"), KVCacheScheme())
    scales: dict[str, torch.Tensor] = {}
    quantized = run_sequential(model, arch_spec_for(model), ids, [RTN(PRESETS["W8A16"]), stage], torch.device("cpu"),
                               scales=scales, head_algorithms=[RTN(PRESETS["W8A16"])])
    tables = scale_tables(model.config.to_dict(), canonical_entries(stage, scales), quantized, scales)
    weights = tables["weight_scales.json"]
    assert "lm_head.weight_quanter" in weights and not any("model.lm_head" in k or "qwen2.lm_head" in k for k in weights)
    assert not any(k.startswith("lm_head") for k in tables["act_scales.json"])
