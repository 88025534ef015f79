"""Exports loaded by real third-party loaders, compared with quantlab's fake-quant model of the
same canonical form.

* GGUF through transformers' GGUF loader (its own dequantizer, name map and Q/K un-permute).
* compressed-tensors through transformers + compressed-tensors (needs `compressed_tensors`),
  loaded the plain way (`from_pretrained(path)`): symmetric checkpoints on transformers'
  compressed route, asymmetric ones on its dequantize-at-load route, which reads the zero
  point packed along the output dim as vLLM does (quantlab/export/compressed_tensors.py).
* AWQ through transformers + gptqmodel, GPTQ through `GPTQModel.load`, in gptqmodel's own
  environment (quantlab.toolenv; built on first use, ~1 min; `.ci/run` builds it up front).
The GGUF and compressed-tensors tests need `gguf` / `compressed_tensors`, both in the dev extra.
"""

from __future__ import annotations

import pytest
import torch

from quantlab.export import api
from quantlab.quant.canonical import load_canonical, load_fake_quant_model
from quantlab.quant.scheme import WeightScheme
from test_export_helpers import make_canonical

ASYM = WeightScheme(bits=4, symmetric=False, group_size=32)
SYM = WeightScheme(bits=4, symmetric=True, group_size=64)


def sample_ids(batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def logits(model, ids) -> torch.Tensor:
    return model(ids).logits.float()


def with_decoded_gguf(canonical, out):
    """The canonical model with the weights quantlab's GGUF reader decodes from `out`."""
    from quantlab.export import gguf_file

    model = load_fake_quant_model(canonical)
    floats, _ = gguf_file.read(out)
    missing, unexpected = model.load_state_dict(floats, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model


# ----------------------------------------------------------------------------- GGUF / transformers


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", ["f16", "q4_0"])
def test_gguf_loads_in_transformers(tmp_path, tokenizer, model_type, qtype):
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    canonical = make_canonical(tmp_path, tokenizer, model_type, SYM)
    out = tmp_path / "gguf"
    api.export(canonical, out, f"gguf-{qtype}")
    fname = next(out.glob("*.gguf")).name
    loaded = AutoModelForCausalLM.from_pretrained(out, gguf_file=fname, dtype=torch.float32).eval()
    ids = sample_ids()
    got = logits(loaded, ids)
    # 1. exactly the weights our reader decodes: same names, same Q/K un-permutation
    assert torch.allclose(got, logits(with_decoded_gguf(canonical, out), ids), atol=1e-5, rtol=0), qtype
    # 2. close to the canonical fake-quant model (f16 rounding; q4_0 adds the Q8_0 embedding)
    ref = logits(load_fake_quant_model(canonical), ids)
    tol = {"f16": 2e-3, "q4_0": 3e-2}[qtype] * float(ref.abs().max())
    assert float((got - ref).abs().max()) < tol
    if model_type == "llama":  # transformers rebuilds a GPT-2 BPE tokenizer from the GGUF vocab
        tok = AutoTokenizer.from_pretrained(out, gguf_file=fname)
        text = "The quick brown fox, in 1987, jumped over 42 lazy dogs!<|endoftext|>"
        assert tok(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_gguf_carries_a_quantized_lm_head(tmp_path, tokenizer):
    """`lm_head: true` on a tied llama: Q4_0 writes the head's codes exactly as `output.weight`
    beside the (Q8_0) token embedding, and transformers' GGUF loader computes what our reader
    decodes, close to the fake-quant model."""
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    from quantlab.export.source import read_sidecar

    canonical = make_canonical(tmp_path, tokenizer, "llama", WeightScheme(bits=4, symmetric=True, group_size=32),
                               head=True)
    out = tmp_path / "gguf"
    api.export(canonical, out, "gguf-q4_0")
    assert read_sidecar(out)["modules"]["lm_head"] == {"tensor": "output.weight", "type": "Q4_0",
                                                        "encoding": "transcoded"}
    loaded = AutoModelForCausalLM.from_pretrained(out, gguf_file=next(out.glob("*.gguf")).name,
                                                  dtype=torch.float32).eval()
    assert not loaded.config.tie_word_embeddings
    ids = sample_ids()
    got = logits(loaded, ids)
    assert torch.allclose(got, logits(with_decoded_gguf(canonical, out), ids), atol=1e-5, rtol=0)
    ref = logits(load_fake_quant_model(canonical), ids)
    assert float((got - ref).abs().max()) < 3e-2 * float(ref.abs().max())


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_gguf_k_quant_through_llama_cpp_quantizer(tmp_path, tokenizer, model_type):
    """Q4_K_M: the folded weights as F16, re-quantized by llama.cpp (its tool environment); the
    validator decodes every Linear back near the canonical weight and transformers loads it. A
    run that kept no float weights is refused rather than rounded twice."""
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    from quantlab.errors import UserError
    from quantlab.export import gguf_file

    dims = dict(hidden_size=256, intermediate_size=512)
    codes_only = make_canonical(tmp_path / "codes", tokenizer, model_type, SYM, **dims)
    with pytest.raises(UserError, match=r"^gguf-q4_k_m: llama.cpp's quantizer reads the float weights"):
        api.export(codes_only, tmp_path / "refused", "gguf-q4_k_m")
    assert not (tmp_path / "refused").exists()
    canonical = make_canonical(tmp_path, tokenizer, model_type, SYM, folded=True, **dims)
    out = tmp_path / "gguf"
    report = api.export(canonical, out, "gguf-q4_k_m")
    assert report.ok, report.failures()
    assert {"Q4_K", "Q6_K"} <= set(report.facts["types"])  # llama.cpp's Q4_K_M mix, not a fallback
    decoded = [c for c in report.checks if c.rule == "decoded weights"]
    assert len(decoded) == 2 * 7 and all(c.ok for c in decoded)
    assert not (out / "model-F16.partial.gguf").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out, gguf_file=next(out.glob("*.gguf")).name,
                                                  dtype=torch.float32).eval()
    ids = sample_ids()  # transformers decodes the very weights our reader does
    assert torch.allclose(logits(loaded, ids), logits(with_decoded_gguf(canonical, out), ids), atol=1e-5, rtol=0)
    # a wrong Q/K permutation (or tensor name) would decode far from the canonical weight
    floats, _ = gguf_file.read(out)
    q = floats["model.layers.0.self_attn.q_proj.weight"]
    want = load_canonical(canonical)[1]["model.layers.0.self_attn.q_proj"].dequantize()
    assert float((q - want).norm() / want.norm()) < gguf_file.K_QUANT_TOLERANCE["q4_k_m"]
    assert float((q.flip(0) - want).norm() / want.norm()) > 1.0


def test_gguf_k_quant_rounds_the_folded_weights_once(tmp_path, tokenizer):
    """With the float weights kept (`folded.safetensors`), llama.cpp quantizes them, not the
    dequantized 4-bit codes: the decoded GGUF sits nearer the float weight than the codes do."""
    pytest.importorskip("gguf")
    from quantlab.export import gguf_file
    from quantlab.export.source import read_sidecar
    from quantlab.quant.canonical import load_folded

    canonical = make_canonical(tmp_path, tokenizer, "llama", SYM, folded=True, hidden_size=256,
                               intermediate_size=512)
    out = tmp_path / "gguf"
    report = api.export(canonical, out, "gguf-q4_k_m")
    assert report.ok, report.failures()
    modules = read_sidecar(out)["modules"]
    assert len(modules) == 14 and all("folded" in m["encoding"] for m in modules.values())
    floats, _ = gguf_file.read(out)
    folded, codes = load_folded(canonical), load_canonical(canonical)[1]
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        got, want = floats[f"{name}.weight"], folded[name].float()
        once = float((got - want).norm() / want.norm())
        twice = float((got - codes[name].dequantize()).norm() / want.norm())
        assert once < gguf_file.K_QUANT_TOLERANCE["q4_k_m"] and once < twice


# ----------------------------------------------------------------------------- compressed-tensors


CT_CASES = {
    "sym-g64-llama": ("llama", SYM, {}),
    "sym-g64-qwen2": ("qwen2", SYM, {}),
    "asym-g64-qwen2": ("qwen2", WeightScheme(bits=4, symmetric=False, group_size=64), {}),
    "asym-g32-qwen3": ("qwen3", ASYM, {}),  # q/k norms
    "sym-g64-gemma3": ("gemma3_text", SYM, {}),  # 1 + weight norms, sandwich norms, GELU, sliding window
    "asym-g128": ("llama", WeightScheme(bits=4, symmetric=False, group_size=128),
                  dict(hidden_size=128, intermediate_size=256)),
    # k_proj / v_proj have 20 outputs: their zero points end in a half-filled int32 word
    "asym-g16-packing-tail": ("llama", WeightScheme(bits=4, symmetric=False, group_size=16),
                              dict(head_dim=20, num_key_value_heads=1)),
    "w8-asym-channel": ("llama", WeightScheme(bits=8, symmetric=False, group_size=None), {}),
}


@pytest.mark.parametrize("case", CT_CASES)
def test_compressed_tensors_loads_in_transformers(tmp_path, tokenizer, case):
    """`AutoModelForCausalLM.from_pretrained(export)` with no arguments, as a user loads it,
    computes the fake-quant model's logits; the validator's load-layout rule ran."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    model_type, scheme, dims = CT_CASES[case]
    canonical = make_canonical(tmp_path, tokenizer, model_type, scheme, **dims)
    out = tmp_path / "ct"
    report = api.export(canonical, out, "compressed-tensors")
    assert report.rule_counts()["transformers load layout"][0] >= 3
    assert report.facts["transformers route"].startswith("compressed" if scheme.symmetric else "dense")
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = sample_ids()
    ref = logits(load_fake_quant_model(canonical), ids)
    assert torch.allclose(logits(loaded, ids), ref, atol=1e-5, rtol=0)


def test_compressed_tensors_validator_rejects_what_transformers_cannot_load(tmp_path, tokenizer):
    """An asymmetric export without `dequantize` (llm-compressor's own output at these
    versions) fails validation twice: the route rule, and the layout transformers' compressed
    route builds, asked of the installed packages (the dev extra pins compressed-tensors 0.20,
    whose meta-device compression leaves the zero point unpacked)."""
    pytest.importorskip("compressed_tensors")
    import json

    from quantlab.export import compressed_tensors as ct, ct_load_layout
    from quantlab.export.checks import Report
    from quantlab.export.hf_checkpoint import load_tensors

    canonical = make_canonical(tmp_path, tokenizer, "llama", ASYM)
    out = tmp_path / "ct"
    api.export(canonical, out, "compressed-tensors")
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]["dequantize"]
    (out / "config.json").write_text(json.dumps(config))
    assert [c.subject for c in ct.validate(out).failures] == ["quantization_config.dequantize"]
    report = Report("compressed-tensors", str(out))
    ct_load_layout.check(report, out, config["quantization_config"], load_tensors(out), ct.read(out)[1])
    assert report.facts["transformers route"] == "compressed" and len(report.failures) == 2 * 7
    details = {c.subject: c.detail for c in report.failures}
    assert details["model.layers.0.self_attn.q_proj"].endswith("weight_zero_point [8, 2] where the loader builds [64, 2]")


def test_compressed_tensors_carries_a_quantized_lm_head(tmp_path, tokenizer):
    """A run with `lm_head: true` (tied llama, so the head is untied first): transformers +
    compressed-tensors load lm_head from its packed codes and compute the fake-quant logits;
    formats that keep lm_head float refuse the run instead of dropping its codes (GPTQ and GGUF
    carry it: `test_gptq_loads_with_gptqmodel[lm_head]`, `test_gguf_carries_a_quantized_lm_head`)."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    from quantlab.errors import UserError

    canonical = make_canonical(tmp_path, tokenizer, "llama", SYM, head=True)
    out = tmp_path / "ct"
    report = api.export(canonical, out, "compressed-tensors")
    assert report.facts["quantized Linears"] == 2 * 7 + 1
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert not loaded.config.tie_word_embeddings
    ids = sample_ids()
    ref = logits(load_fake_quant_model(canonical), ids)
    assert torch.allclose(logits(loaded, ids), ref, atol=1e-5, rtol=0)
    for fmt in ("awq", "trtllm", "paddlenlp"):
        with pytest.raises(UserError, match=rf"^{fmt}: this run quantized lm_head"):
            api.export(canonical, tmp_path / fmt, fmt)
        assert not (tmp_path / fmt).exists()


@pytest.mark.parametrize("scheme", [ASYM, SYM, WeightScheme(bits=8, symmetric=False, group_size=None)],
                         ids=lambda s: s.name)
def test_compressed_tensors_decompressor_reads_the_layout(tmp_path, tokenizer, scheme):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    from quantlab.export.hf_checkpoint import load_tensors, read_config

    canonical = make_canonical(tmp_path, tokenizer, "llama", scheme)
    out = tmp_path / "ct"
    api.export(canonical, out, "compressed-tensors")
    qcfg = QuantizationConfig.model_validate(read_config(out)["quantization_config"])
    group = qcfg.config_groups["group_0"]
    tensors = load_tensors(out)
    _, ref = load_canonical(canonical)
    for name, qw in ref.items():
        local = {k.removeprefix(f"{name}."): v for k, v in tensors.items() if k.startswith(f"{name}.")}
        local = {k: v for k, v in local.items() if k != "bias"}
        weight = PackedQuantizationCompressor.decompress(local, group)["weight"]
        assert torch.equal(weight.float(), qw.dequantize()), name


# ----------------------------------------------------------------------------- gptqmodel


def gptqmodel_logits(export, backend: str | None = None, layer_class: str = "") -> torch.Tensor:
    """Logits from the export loaded in gptqmodel's own environment (quantlab.toolenv builds it
    on first use: gptqmodel's pins conflict with ours), on `sample_ids()`; the first q_proj
    must be a quantized layer class (`layer_class` in its name), not a dequantized Linear."""
    from quantlab.export import engine_check

    result = engine_check.score(export, sample_ids(), logits=True, backend=backend)
    assert layer_class in result["linear_class"] and result["linear_class"] != "Linear", result["linear_class"]
    return result["logits"]


def assert_close_fp16(got: torch.Tensor, canonical) -> None:
    ref = logits(load_fake_quant_model(canonical, dtype=torch.float16), sample_ids())
    # both sides run in fp16: differences are accumulation order, far below a wrong weight's
    assert float((got - ref).abs().max()) < 1e-2 * float(ref.abs().max())


# asymmetric and symmetric packing, with and without q/k/v biases; Qwen3's AWQ layout (q/k
# norms in float) loads in tests/test_moe.py's qwen3_moe case
@pytest.mark.parametrize("model_type,scheme", [("llama", ASYM), ("qwen2", SYM)], ids=lambda v: getattr(v, "name", v))
def test_awq_loads_with_gptqmodel(tmp_path, tokenizer, model_type, scheme):
    canonical = make_canonical(tmp_path, tokenizer, model_type, scheme)
    out = tmp_path / "awq"
    api.export(canonical, out, "awq")
    assert_close_fp16(gptqmodel_logits(out, layer_class="Awq"), canonical)


@pytest.mark.parametrize("case", ["sym", "asym", "act_order", "tail", "lm_head"])
def test_gptq_loads_with_gptqmodel(tmp_path, tokenizer, case):
    kwargs = {"sym": dict(scheme=SYM), "asym": dict(scheme=ASYM), "act_order": dict(scheme=ASYM, act_order=True),
              "tail": dict(scheme=ASYM, hidden_size=80, intermediate_size=160),
              "lm_head": dict(scheme=ASYM, head=True)}[case]
    canonical = make_canonical(tmp_path, tokenizer, "qwen2" if case == "sym" else "llama", **kwargs)
    out = tmp_path / "gptq"
    api.export(canonical, out, "gptq")
    # the default CPU kernel (aten int4pack) needs G | in; the plain torch kernel takes tails
    assert_close_fp16(gptqmodel_logits(out, backend="GPTQ_TORCH" if case == "tail" else None), canonical)


def test_compressed_tensors_exports_without_compressed_tensors_installed(tmp_path, tokenizer, monkeypatch):
    """quantlab writes and validates the layout itself; only the load-layout rule needs the
    package, and it says which one a user needs."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "compressed_tensors" else find_spec(name, *a))
    report = api.export(make_canonical(tmp_path, tokenizer, "llama", ASYM), tmp_path / "ct", "compressed-tensors")
    assert report.ok and "transformers load layout" not in report.rule_counts()
    assert any("pip install compressed-tensors" in why for why in report.facts["skipped"])
    assert report.facts["engine"].endswith("not installed here: pip install compressed-tensors")
