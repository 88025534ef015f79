"""Validators: a good export passes every rule; each deliberately broken export is rejected
with a message naming the tensor or key and the rule it breaks."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from quantlab.cli import app
from quantlab.export import api
from quantlab.export.bits import pack_dense
from quantlab.export.checks import ExportInvalid
from quantlab.quant.scheme import WeightScheme
from test_export_helpers import edit_config, edit_tensors, make_canonical, rejected

ASYM = WeightScheme(bits=4, symmetric=False, group_size=32)
SYM = WeightScheme(bits=4, symmetric=True, group_size=64)
Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tokenizer) -> dict[str, Path]:
    """One good export per format (asymmetric llama, symmetric for TensorRT-LLM)."""
    root = tmp_path_factory.mktemp("exports")
    asym = make_canonical(root / "asym", tokenizer, "llama", ASYM)
    sym = make_canonical(root / "sym", tokenizer, "qwen2", SYM)
    out = {}
    for fmt, src in (("awq", asym), ("gptq", asym), ("compressed-tensors", asym), ("trtllm", sym),
                     ("gguf-q4_0", sym)):
        out[fmt] = src.parent / "export" / fmt
        api.export(src, out[fmt], fmt)
    return out


def broken_copy(exports, fmt, tmp_path) -> Path:
    """A copy next to the original's canonical source, so fingerprints still resolve."""
    src = exports[fmt]
    dst = src.parent / f"{fmt}-broken-{tmp_path.name}"
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("fmt", ["awq", "gptq", "compressed-tensors", "trtllm", "gguf-q4_0"])
def test_good_exports_pass_every_rule(exports, fmt):
    report = api.inspect(exports[fmt])
    assert report.ok, [c.line() for c in report.failures][:5]
    rules = report.rule_counts()
    decoded = "decoded weights" if fmt.startswith("gguf") else "decoded codes"
    assert rules[decoded][0] > 0 and "skipped" not in report.facts


def test_wrong_dtype(exports, tmp_path):
    bad = broken_copy(exports, "awq", tmp_path)
    edit_tensors(bad, lambda t: t.update({f"{Q}.scales": t[f"{Q}.scales"].float()}))
    msg = rejected(bad, f"{Q}.scales", "dtype")
    assert f"{Q}.scales: dtype: expected float16, got float32" in msg


def test_wrong_shape(exports, tmp_path):
    bad = broken_copy(exports, "compressed-tensors", tmp_path)
    edit_tensors(bad, lambda t: t.update({f"{Q}.weight_scale": t[f"{Q}.weight_scale"][:, :1].contiguous()}))
    assert "expected [64, 2], got [64, 1]" in rejected(bad, f"{Q}.weight_scale", "shape")


def test_missing_config_key(exports, tmp_path):
    bad = broken_copy(exports, "gptq", tmp_path)
    edit_config(bad, lambda c: c["quantization_config"].pop("bits"))
    assert "quantization_config.bits: config key: key is missing" in rejected(bad, "quantization_config.bits",
                                                                              "config key")


def test_missing_tensor(exports, tmp_path):
    bad = broken_copy(exports, "gptq", tmp_path)
    edit_tensors(bad, lambda t: t.pop(f"{Q}.g_idx"))
    rejected(bad, f"{Q}.g_idx", "present")


def test_wrong_config_value(exports, tmp_path):
    bad = broken_copy(exports, "awq", tmp_path)
    edit_config(bad, lambda c: c["quantization_config"].update({"version": "gemv"}))
    rejected(bad, "quantization_config.version", "config value")


def test_awq_sequential_pack_order_is_caught(exports, tmp_path):
    """Same shapes and dtypes, nibbles in GPTQ's sequential order instead of AWQ's interleave."""
    from quantlab.export.bits import unpack_awq

    bad = broken_copy(exports, "awq", tmp_path)
    edit_tensors(bad, lambda t: t.update({f"{Q}.qweight": pack_dense(unpack_awq(t[f"{Q}.qweight"]), 4)}))
    assert "wrong pack order" in rejected(bad, Q, "decoded codes")


def test_gptq_packed_along_the_wrong_dim_is_caught(exports, tmp_path):
    from quantlab.export.bits import unpack_dense

    bad = broken_copy(exports, "gptq", tmp_path)

    def along_out(t):  # [in/8, out] codes repacked along out: [in, out/8]
        codes = unpack_dense(t[f"{Q}.qweight"], 4, 64, dim=0)
        t[f"{Q}.qweight"] = pack_dense(codes, 4, dim=1)

    edit_tensors(bad, along_out)
    assert "expected [8, 64], got [64, 8]" in rejected(bad, f"{Q}.qweight", "shape")


def test_gptq_g_idx_reordered_without_desc_act(exports, tmp_path):
    bad = broken_copy(exports, "gptq", tmp_path)
    edit_tensors(bad, lambda t: t.update({f"{Q}.g_idx": t[f"{Q}.g_idx"].flip(0).contiguous()}))
    rejected(bad, f"{Q}.g_idx", "g_idx is i // group_size without desc_act")


def test_trtllm_swapped_fc_gate_is_caught(exports, tmp_path):
    bad = broken_copy(exports, "trtllm", tmp_path)
    layer = "transformer.layers.0.mlp"

    def swap(t):
        for suffix in ("weight", "weights_scaling_factor"):
            t[f"{layer}.fc.{suffix}"], t[f"{layer}.gate.{suffix}"] = t[f"{layer}.gate.{suffix}"], t[f"{layer}.fc.{suffix}"]

    edit_tensors(bad, swap, "rank0.safetensors")
    message = rejected(bad, "model.layers.0.mlp.gate_proj", "decoded codes")
    assert "swapped tensors" in message


def test_trtllm_prequant_scale_must_be_ones(exports, tmp_path):
    bad = broken_copy(exports, "trtllm", tmp_path)
    name = "transformer.layers.1.attention.dense.prequant_scaling_factor"
    edit_tensors(bad, lambda t: t.update({name: t[name] * 2}), "rank0.safetensors")
    rejected(bad, name, "prequant scale is ones (AWQ scales folded)")


def test_trtllm_wrong_dtype(exports, tmp_path):
    bad = broken_copy(exports, "trtllm", tmp_path)
    name = "transformer.layers.0.attention.qkv.weight"
    edit_tensors(bad, lambda t: t.update({name: t[name].view(torch.uint8)}), "rank0.safetensors")
    assert "expected int8, got uint8" in rejected(bad, name, "dtype")


def test_gguf_rows_not_permuted_is_caught(exports, tmp_path):
    import gguf

    bad = broken_copy(exports, "gguf-q4_0", tmp_path)
    reader = gguf.GGUFReader(next(bad.glob("*.gguf")), "r+")
    t = next(t for t in reader.tensors if t.name == "blk.1.attn_k.weight")
    t.data[:] = np.ascontiguousarray(t.data[::-1])  # rows in the wrong order
    reader.data.flush()
    del reader
    rejected(bad, "model.layers.1.self_attn.k_proj", "decoded weights")


def test_gguf_missing_metadata_never_lands(tmp_path, tokenizer, monkeypatch):
    from quantlab.export import gguf_file

    canonical = make_canonical(tmp_path, tokenizer, "llama", SYM)
    original = gguf_file.add_hparams

    def without_kv_heads(writer, config, file_type, name):
        writer.add_head_count_kv = lambda n: None
        original(writer, config, file_type, name)

    monkeypatch.setattr(gguf_file, "add_hparams", without_kv_heads)
    with pytest.raises(ExportInvalid, match=r"llama\.attention\.head_count_kv: metadata key: key is missing"):
        api.export(canonical, tmp_path / "out", "gguf-q8_0")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_gguf_pre_tokenizer_llama_cpp_refuses_never_lands(tmp_path, tokenizer, monkeypatch):
    """llama.cpp refuses to load a file whose pre-tokenizer name it does not know ("gpt2")."""
    from quantlab.export import gguf_file

    canonical = make_canonical(tmp_path, tokenizer, "llama", SYM)
    monkeypatch.setattr(gguf_file, "tokenizer_pre", lambda tok: "gpt2")
    with pytest.raises(ExportInvalid, match=r"tokenizer\.ggml\.pre: config value: llama\.cpp refuses"):
        api.export(canonical, tmp_path / "out", "gguf-q8_0")
    assert not (tmp_path / "out").exists()


def test_without_fingerprints_pack_order_is_reported_unverifiable(exports, tmp_path):
    bad = broken_copy(exports, "awq", tmp_path)
    (bad / "quantlab_export.json").unlink()
    report = api.inspect(bad)
    assert report.ok and any("pack order not verifiable" in s for s in report.facts["skipped"])


def test_cli_inspect(exports, tmp_path):
    runner = CliRunner()
    good = runner.invoke(app, ["inspect", str(exports["gptq"])])
    assert good.exit_code == 0, good.output
    assert "gptq" in good.output and "ok   decoded codes" in good.output and "checkpoint_format: gptq_v2" in good.output
    bad = broken_copy(exports, "awq", tmp_path)
    edit_tensors(bad, lambda t: t.update({f"{Q}.scales": t[f"{Q}.scales"].float()}))
    result = runner.invoke(app, ["inspect", str(bad)])
    assert result.exit_code == 1
    assert f"FAIL {Q}.scales: dtype: expected float16, got float32" in result.output
    missing = runner.invoke(app, ["inspect", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "no such file or directory" in missing.output


def test_cli_export(tmp_path, tokenizer, monkeypatch):
    """Exports (and inspects) without the engines' packages, naming the one a deploying user needs."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gptqmodel" else find_spec(name, *a))
    canonical = make_canonical(tmp_path / "run", tokenizer, "llama", SYM)
    runner = CliRunner()
    result = runner.invoke(app, ["export", str(canonical.parent), "--format", "gptq", "--format", "gguf-q8_0",
                                 "--max-shard-size", "50kB"])
    assert result.exit_code == 0, result.output
    assert "load with GPTQModel.load or transformers + gptqmodel, or vLLM; not installed here: pip install gptqmodel" \
        in result.output
    inspected = runner.invoke(app, ["inspect", str(canonical.parent / "export" / "gptq")])
    assert inspected.exit_code == 0 and "not installed here: pip install gptqmodel" in inspected.output
    assert (canonical.parent / "export" / "gptq" / "model.safetensors.index.json").is_file()
    assert list((canonical.parent / "export" / "gguf-q8_0").glob("*.gguf"))
    bad = runner.invoke(app, ["export", str(canonical.parent), "--format", "onnx"])
    assert bad.exit_code == 2 and "unknown; formats: awq, gptq" in bad.output
    refused = runner.invoke(app, ["export", str(tmp_path), "--format", "awq"])
    assert refused.exit_code == 2 and "no quantized model" in refused.output
