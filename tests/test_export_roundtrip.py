"""Export → the format's own reader → the canonical codes, zeros, g_idx and scales.

Codes, zero points and g_idx come back exactly in every format. Scales come back exactly
where the format stores them in the model's float dtype (compressed-tensors, float32 here) and
as `fp16(scale)` where the format stores fp16 (AWQ, GPTQ, TensorRT-LLM). GGUF re-encodes per
32-column block: the decoded weights must equal `(q − z)·fp16(s)` when transcoded and the
`gguf.quants` encoding of the dequantized weight when requantized.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from quantlab.errors import UserError
from quantlab.export import api
from quantlab.export.registry import module_for
from quantlab.export.shards import INDEX
from quantlab.quant.canonical import load_canonical
from quantlab.quant.scheme import WeightScheme
from test_export_helpers import make_canonical

ASYM = WeightScheme(bits=4, symmetric=False, group_size=32)
SYM = WeightScheme(bits=4, symmetric=True, group_size=64)
FP16_SCALES = {"awq", "gptq", "trtllm"}


def assert_same(fmt, canonical, tmp_path):
    out = tmp_path / "export" / fmt
    api.export(canonical, out, fmt)
    floats_ref, ref = load_canonical(canonical)
    floats, got = module_for(fmt)[0].read(out)
    assert set(got) == set(ref)
    for name, qw in ref.items():
        g = got[name]
        assert torch.equal(g.codes, qw.codes), f"{fmt} {name} codes"
        assert torch.equal(g.zeros, qw.zeros), f"{fmt} {name} zeros"
        assert torch.equal(g.g_idx, qw.g_idx), f"{fmt} {name} g_idx"
        want = qw.scales.half().float() if fmt in FP16_SCALES else qw.scales
        assert torch.equal(g.scales, want), f"{fmt} {name} scales"
        assert g.scheme.bits == qw.scheme.bits and g.scheme.group_size == qw.scheme.group_size
    for name, t in floats_ref.items():  # norms, embedding, biases; fp16 formats round them
        assert torch.equal(floats[name].float(), t.to(floats[name].dtype).float()), name
    return out


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("fmt,scheme", [
    ("awq", ASYM), ("awq", SYM), ("gptq", ASYM), ("gptq", SYM),
    ("compressed-tensors", ASYM), ("compressed-tensors", SYM), ("trtllm", SYM),
    ("gptq", WeightScheme(bits=8, symmetric=True, group_size=None)),
    ("awq", WeightScheme(bits=4, symmetric=False, group_size=None)),
    ("gptq", WeightScheme(bits=3, symmetric=False, group_size=32)),
    ("compressed-tensors", WeightScheme(bits=8, symmetric=False, group_size=None)),
], ids=lambda v: v.name if isinstance(v, WeightScheme) else v)
def test_round_trip(tmp_path, tokenizer, model_type, fmt, scheme):
    canonical = make_canonical(tmp_path, tokenizer, model_type, scheme)
    assert_same(fmt, canonical, tmp_path)


def test_awq_stores_symmetric_codes_with_zero_eight(tmp_path, tokenizer):
    out = assert_same("awq", make_canonical(tmp_path, tokenizer, "llama", SYM), tmp_path)
    _, got = module_for("awq")[0].read(out)
    assert all(bool((q.zeros == 8).all()) and q.scheme.symmetric for q in got.values())


@pytest.mark.parametrize("scheme", [ASYM, SYM], ids=["asym", "sym"])
def test_gptq_act_order_g_idx(tmp_path, tokenizer, scheme):
    canonical = make_canonical(tmp_path, tokenizer, "llama", scheme, act_order=True)
    out = assert_same("gptq", canonical, tmp_path)
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["desc_act"] is True
    assert qcfg["checkpoint_format"] == ("gptq" if scheme.symmetric else "gptq_v2")
    assert json.loads((out / "quantize_config.json").read_text()) == qcfg


def test_gptq_tail_group(tmp_path, tokenizer):
    """80 inputs at G=32: groups of 32, 32, 16 — GPTQ stores ceil(80/32) = 3 groups."""
    canonical = make_canonical(tmp_path, tokenizer, "llama", ASYM, hidden_size=80, intermediate_size=160)
    out = assert_same("gptq", canonical, tmp_path)
    _, got = module_for("gptq")[0].read(out)
    assert got["model.layers.0.self_attn.q_proj"].scales.shape == (80, 3)


@pytest.mark.parametrize("fmt", ["awq", "compressed-tensors"])
def test_tail_group_is_refused_with_the_reason(tmp_path, tokenizer, fmt):
    canonical = make_canonical(tmp_path, tokenizer, "llama", ASYM, hidden_size=80, intermediate_size=160)
    with pytest.raises(UserError, match=r"80 inputs, not a multiple of group_size 32.*gptq"):
        api.export(canonical, tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists()


def test_awq_refuses_eight_bit_and_act_order(tmp_path, tokenizer):
    eight = make_canonical(tmp_path / "a", tokenizer, "llama", WeightScheme(bits=8, symmetric=False, group_size=32))
    with pytest.raises(UserError, match="awq: AWQ GEMM stores 4-bit codes only; scheme W8A16_ASYM_g32"):
        api.export(eight, tmp_path / "a" / "out", "awq")
    act = make_canonical(tmp_path / "b", tokenizer, "llama", ASYM, act_order=True)
    with pytest.raises(UserError, match="act-order g_idx"):
        api.export(act, tmp_path / "b" / "out", "awq")


def test_trtllm_refuses_asymmetric(tmp_path, tokenizer):
    canonical = make_canonical(tmp_path, tokenizer, "llama", WeightScheme(bits=4, symmetric=False, group_size=64))
    with pytest.raises(UserError, match="trtllm: W4A16_AWQ .* no zero point; scheme W4A16_ASYM_g64"):
        api.export(canonical, tmp_path / "out", "trtllm")


def test_trtllm_names_and_fc_gate_swap(tmp_path, tokenizer):
    from safetensors.torch import load_file

    from quantlab.export.bits import unpack_int4_pairs

    canonical = make_canonical(tmp_path, tokenizer, "qwen2", SYM)
    out = tmp_path / "trt"
    api.export(canonical, out, "trtllm")
    t = load_file(out / "rank0.safetensors")
    _, ref = load_canonical(canonical)
    layer = "model.layers.1"

    def signed(name):
        return ref[f"{layer}.{name}"].codes.to(torch.int8) - 8

    assert torch.equal(unpack_int4_pairs(t["transformer.layers.1.mlp.fc.weight"]), signed("mlp.gate_proj"))
    assert torch.equal(unpack_int4_pairs(t["transformer.layers.1.mlp.gate.weight"]), signed("mlp.up_proj"))
    qkv = torch.cat([signed(f"self_attn.{p}_proj") for p in "qkv"])
    assert torch.equal(unpack_int4_pairs(t["transformer.layers.1.attention.qkv.weight"]), qkv)
    assert t["transformer.layers.1.attention.qkv.weight"].shape == (128 // 2, 64)
    assert t["transformer.layers.1.attention.qkv.bias"].shape == (128,)
    assert bool((t["transformer.layers.1.attention.qkv.prequant_scaling_factor"] == 1).all())
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": None, "group_size": 64,
                                      "has_zero_point": False, "pre_quant_scale": True, "exclude_modules": ["lm_head"]}


def test_gptq_shards_with_index(tmp_path, tokenizer):
    canonical = make_canonical(tmp_path, tokenizer, "llama", SYM)
    out = tmp_path / "gptq"
    api.export(canonical, out, "gptq", max_shard_bytes=40_000)
    index = json.loads((out / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    assert not (out / "model.safetensors").exists()
    _, ref = load_canonical(canonical)
    _, got = module_for("gptq")[0].read(out)
    assert all(torch.equal(got[n].codes, q.codes) for n, q in ref.items())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).is_file(), name


def test_ignored_linears_stay_float_and_are_declared(tmp_path, tokenizer):
    canonical = make_canonical(tmp_path, tokenizer, "llama", SYM, skip=("mlp.down_proj",))
    for fmt, key in (("gptq", "dynamic"), ("awq", "modules_to_not_convert"), ("compressed-tensors", "ignore")):
        out = tmp_path / fmt
        api.export(canonical, out, fmt)
        qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
        assert "model.layers.0.mlp.down_proj" in json.dumps(qcfg[key]).replace("\\\\", "")


# ----------------------------------------------------------------------------- GGUF


def expected_gguf_weight(qw, qtype: str) -> torch.Tensor:
    """What the GGUF block should decode to, computed from the canonical form directly."""
    s16 = qw.scales.half().float()[:, qw.g_idx.long()]
    z = qw.zeros.float()[:, qw.g_idx.long()]
    q = qw.codes.float()
    if qtype in ("q8_0", "q4_0"):
        return (q - z) * s16
    if qtype == "q4_1":
        m = (-(qw.zeros.float() * qw.scales.float())).half().float()[:, qw.g_idx.long()]
        return q * s16 + m
    raise ValueError(qtype)


@pytest.mark.parametrize("qtype,scheme,act_order", [
    ("q4_0", ASYM, False), ("q4_1", WeightScheme(bits=4, symmetric=False, group_size=16), False),
    ("q4_1", WeightScheme(bits=8, symmetric=True, group_size=None), False),
    ("q8_0", WeightScheme(bits=8, symmetric=False, group_size=None), False), ("q8_0", SYM, True),
], ids=["q4_0-asym", "q4_1-g16", "q4_1-w8", "q8_0-w8-asym", "q8_0-act-order"])
def test_gguf_refuses_codes_a_block_type_cannot_hold(tmp_path, tokenizer, qtype, scheme, act_order):
    """Such codes would be rounded a second time: refused, nothing written."""
    from quantlab.errors import UserError

    canonical = make_canonical(tmp_path, tokenizer, "llama", scheme, act_order=act_order)
    with pytest.raises(UserError, match=rf"^gguf-{qtype}: .* would be rounded a second time"):
        api.export(canonical, tmp_path / "gguf", f"gguf-{qtype}")
    assert not (tmp_path / "gguf").exists()


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype,scheme,encoding", [
    ("q4_0", SYM, "transcoded"), ("q4_1", ASYM, "transcoded"), ("q4_1", SYM, "transcoded"),
    ("q8_0", ASYM, "transcoded"), ("q8_0", WeightScheme(bits=8, symmetric=True, group_size=None), "transcoded"),
    ("f16", ASYM, "f16"),
], ids=lambda v: v.name if isinstance(v, WeightScheme) else v)
def test_gguf_round_trip(tmp_path, tokenizer, model_type, qtype, scheme, encoding):
    import gguf

    from quantlab.export import gguf_file

    canonical = make_canonical(tmp_path, tokenizer, model_type, scheme)
    out = tmp_path / "gguf"
    api.export(canonical, out, f"gguf-{qtype}")
    floats, meta = gguf_file.read(out)
    floats_ref, ref = load_canonical(canonical)
    side = json.loads((out / "quantlab_export.json").read_text())
    for name, qw in ref.items():
        assert side["modules"][name]["encoding"] == encoding
        got = floats[f"{name}.weight"]
        if encoding == "transcoded":
            want = expected_gguf_weight(qw, qtype)
        elif encoding == "f16":
            want = qw.dequantize().half().float()
        else:
            qt = getattr(gguf.GGMLQuantizationType, qtype.upper())
            data = gguf.quants.quantize(qw.dequantize().numpy(), qt)
            want = torch.from_numpy(np.array(gguf.quants.dequantize(data, qt), dtype=np.float32))
        assert torch.equal(got, want), name
        if encoding == "transcoded":  # exact up to fp16 rounding of d (and m = −z·s): < (|q|+|z|)·s·2^-11
            idx = qw.g_idx.long()
            bound = (qw.codes.float() + qw.zeros.float()[:, idx] + 1) * qw.scales[:, idx] * 2**-10
            assert bool(((got - qw.dequantize()).abs() <= bound).all()), name
    for name in ("model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(floats[name], floats_ref[name])  # 1-D tensors are F32
    assert ("lm_head.weight" in floats) == (model_type == "qwen2")  # llama ties the head
    assert meta["general.architecture"] == model_type
    assert meta["general.quantization_version"] == 2
    assert meta[f"{model_type}.attention.head_count_kv"] == 2
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.eos_token_id"] == tokenizer.eos_token_id


def test_gguf_llama_qk_rows_are_permuted_qwen2_not(tmp_path, tokenizer):
    import gguf

    from quantlab.export.gguf_file import permute_rows

    for model_type, permuted in (("llama", True), ("qwen2", False)):
        canonical = make_canonical(tmp_path / model_type, tokenizer, model_type, SYM)
        out = tmp_path / model_type / "gguf"
        api.export(canonical, out, "gguf-f16")
        reader = gguf.GGUFReader(next(out.glob("*.gguf")))
        raw = {t.name: torch.from_numpy(np.array(t.data, dtype=np.float32)) for t in reader.tensors}
        _, ref = load_canonical(canonical)
        q = ref["model.layers.0.self_attn.q_proj"].dequantize().half().float()
        k = ref["model.layers.0.self_attn.k_proj"].dequantize().half().float()
        # llama.cpp's LlamaModel.permute: reshape(n_head, 2, d/2, in).swapaxes(1, 2)
        q_llama = q.reshape(4, 2, 8, 64).swapaxes(1, 2).reshape(64, 64)
        k_llama = k.reshape(2, 2, 8, 64).swapaxes(1, 2).reshape(32, 64)
        assert torch.equal(permute_rows(64, 4), torch.arange(64).reshape(4, 2, 8).swapaxes(1, 2).reshape(-1))
        assert torch.equal(raw["blk.0.attn_q.weight"], q_llama if permuted else q)
        assert torch.equal(raw["blk.0.attn_k.weight"], k_llama if permuted else k)


def test_gguf_tokenizer_metadata(tmp_path, tokenizer):
    import gguf

    canonical = make_canonical(tmp_path, tokenizer, "llama", SYM)
    out = tmp_path / "gguf"
    api.export(canonical, out, "gguf-q8_0")
    reader = gguf.GGUFReader(next(out.glob("*.gguf")))
    f = reader.fields
    tokens = [f["tokenizer.ggml.tokens"].contents(i) for i in range(len(f["tokenizer.ggml.tokens"].data))]
    vocab = tokenizer.get_vocab()
    assert len(tokens) == 512 and all(tokens[i] == t for t, i in vocab.items())
    types = f["tokenizer.ggml.token_type"].contents()
    eos = tokenizer.eos_token_id
    assert types[eos] == gguf.TokenType.CONTROL and types[eos + 1] == gguf.TokenType.NORMAL
    assert len(f["tokenizer.ggml.merges"].data) > 0
    assert f["tokenizer.ggml.pre"].contents() == "gpt-2"
