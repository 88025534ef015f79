"""The canonical quantized form: exact save/load round trip and a faithful fake-quant model."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from quantlab.models.arch import arch_spec_for
from quantlab.quant.canonical import FORMAT, load_canonical, load_fake_quant_model, save_canonical
from quantlab.quant.primitives import fake_quantize_weight, quantize_weight
from quantlab.quant.scheme import WeightScheme
from conftest import tiny_model

# A different scheme per Linear role: every bit width, sym/asym, per-channel, a group larger
# than the input (up/gate: in 64, G 128) and a tail group (down: in 96, G 64 → 64 + 32).
SCHEMES = {
    "self_attn.q_proj": WeightScheme(bits=4, symmetric=False, group_size=16),
    "self_attn.k_proj": WeightScheme(bits=3, symmetric=True, group_size=32),
    "self_attn.v_proj": WeightScheme(bits=2, symmetric=False, group_size=None),
    "self_attn.o_proj": WeightScheme(bits=8, symmetric=True, group_size=None),
    "mlp.gate_proj": WeightScheme(bits=4, symmetric=True, group_size=128),
    "mlp.up_proj": WeightScheme(bits=8, symmetric=False, group_size=8),
    "mlp.down_proj": WeightScheme(bits=3, symmetric=False, group_size=64),
}


def quantize_all(model: torch.nn.Module) -> dict:
    spec = arch_spec_for(model)
    return {f"{spec.layers}.{i}.{name}": quantize_weight(layer.get_submodule(name).weight.detach(), SCHEMES[name])
            for i, layer in enumerate(spec.decoder_layers(model)) for name in spec.linears}


def fake_quantized_copy(model: torch.nn.Module) -> torch.nn.Module:
    ref = copy.deepcopy(model)
    spec = arch_spec_for(ref)
    with torch.no_grad():
        for layer in spec.decoder_layers(ref):
            for name in spec.linears:
                weight = layer.get_submodule(name).weight
                weight.copy_(fake_quantize_weight(weight, SCHEMES[name]))
    return ref


@pytest.fixture(params=["llama", "qwen2"])
def saved(request, tmp_path: Path, tokenizer):
    model = tiny_model(request.param, seed=3)
    if request.param == "qwen2":  # make the q/k/v biases non-trivial
        with torch.no_grad():
            for layer in model.model.layers:
                for name in ("q_proj", "k_proj", "v_proj"):
                    getattr(layer.self_attn, name).bias.normal_()
    quantized = quantize_all(model)
    target = tmp_path / "quantized"
    save_canonical(target, model, quantized, tokenizer, extra={"source_model": "tiny"})
    return request.param, model, quantized, target


def test_round_trip_is_exact(saved) -> None:
    family, model, quantized, target = saved
    tensors, loaded = load_canonical(target)
    assert set(loaded) == set(quantized) and len(loaded) == 14
    for name, qw in quantized.items():
        got = loaded[name]
        assert got.scheme == qw.scheme
        assert got.codes.dtype == torch.uint8 and torch.equal(got.codes, qw.codes), name
        assert torch.equal(got.scales, qw.scales) and got.scales.dtype == torch.float32
        assert torch.equal(got.zeros, qw.zeros) and got.zeros.dtype == torch.uint8
        assert torch.equal(got.g_idx, qw.g_idx) and got.g_idx.dtype == torch.int32
        assert f"{name}.weight" not in tensors  # stored as codes only
    state = model.state_dict()
    for key, value in tensors.items():
        assert torch.equal(value, state[key]), key
    if family == "llama":  # tied: the shared matrix is stored once
        assert model.config.tie_word_embeddings
        assert "model.embed_tokens.weight" in tensors and "lm_head.weight" not in tensors
    else:
        assert "lm_head.weight" in tensors
        biases = [k for k in tensors if k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))]
        assert len(biases) == 6
    config = json.loads((target / "quant_config.json").read_text())
    assert config["format"] == FORMAT and config["source_model"] == "tiny"
    assert config["modules"]["model.layers.1.mlp.down_proj"]["shape"] == [64, 96]
    assert (target / "config.json").is_file() and (target / "tokenizer.json").is_file()


def test_packed_on_disk(saved) -> None:
    _, _, quantized, target = saved
    with safe_open(target / "model.safetensors", "pt") as f:
        packed = f.get_tensor("model.layers.0.mlp.down_proj.weight_packed")  # 3-bit, 96 columns
        assert f.metadata()["format"] == FORMAT
    assert packed.dtype == torch.int32 and packed.shape == (64, 10)  # ceil(96 / 10)


def test_fake_quant_model_matches_direct_fake_quantization(saved) -> None:
    family, model, _, target = saved
    reference = fake_quantized_copy(model)
    loaded = load_fake_quant_model(target)
    assert loaded.config.model_type == family
    input_ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(input_ids).logits
        got = loaded(input_ids).logits
        original = model(input_ids).logits
    assert torch.equal(got, expected)
    assert not torch.equal(got, original)  # quantization did change the model
    if family == "llama":
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_not_a_canonical_directory(tmp_path: Path) -> None:
    (tmp_path / "quant_config.json").write_text(json.dumps({"format": "other/2"}))
    with pytest.raises(ValueError, match="not a quantlab.canonical/1 directory"):
        load_canonical(tmp_path)


def test_save_is_atomic_on_failure(tmp_path: Path, tokenizer) -> None:
    """A failing save leaves neither a half-written target nor its temporary sibling."""
    model = tiny_model("llama")

    class Broken:
        def save_pretrained(self, _path):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        save_canonical(tmp_path / "quantized", model, quantize_all(model), Broken())
    assert list(tmp_path.iterdir()) == []
