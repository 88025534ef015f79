"""TensorRT-LLM checkpoint (`config.json` + `rank0.safetensors`, read by `trtllm-build`).

One export name, `trtllm`; the quant_algo follows the canonical scheme
(`trtllm_layouts.layout_for`): symmetric int4 groups → W4A16_AWQ, int8 weights with per-token
int8 activations → W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN, FP8 weights and static FP8
activations → FP8. Each layout's tensors are described in `trtllm_layouts`.

Names follow TensorRT-LLM's llama/qwen mapping (`models/llama/convert.py`
`get_prefix_and_param_name_map`): q,k,v concatenated on the output dim into `attention.qkv`
(rows q, then k, then v: `(heads + 2·kv_heads)·head_size` of them under GQA), `o_proj` →
`attention.dense`, **`gate_proj` → `mlp.fc`, `up_proj` → `mlp.gate`**, `down_proj` →
`mlp.proj`; `input_layernorm`, `post_layernorm`, `transformer.vocab_embedding`,
`transformer.ln_f`, `lm_head` (always written: `share_embedding_table` false).

KV cache (INT8 or FP8, `kv_cache_quant_algo`): `attention.kv_cache_scaling_factor` fp32 `[1]`,
the step `amax/127` or `amax/448`. TensorRT-LLM keeps one scale for K and V of a layer
(`preprocess_weights` merges separate k/v factors by max), so amax is the max over both and
over the KV heads: a per-head or per-K/V canonical scheme is coarsened to it, as TensorRT-LLM's
own converters do.

W4A16_GPTQ (zero points) is not written: TensorRT-LLM's GPTQ checkpoints hold weights already
interleaved by its CUDA op `preprocess_weights_for_mixed_gemm` for one GPU architecture, and
`trtllm-build` does not preprocess them; an unprocessed file of the same shape would load and
compute garbage. TensorRT-LLM reads the `gptq` export directly instead (its PyTorch backend
accepts 4-bit HF GPTQ with desc_act false), and its `convert_checkpoint.py --quant_ckpt_path`
reads the GPTQ safetensors.

Round trip: codes come back exactly; scales exactly where stored fp32 (SmoothQuant
per-channel, FP8, KV, activation), as `fp16(s)` for W4A16_AWQ.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from quantlab.file_checks import read_json_object
from quantlab.errors import UserError
from quantlab.export.checks import Report
from quantlab.export.source import (Canonical, check_fingerprints, fingerprint, head_dim, linear_shapes,
                                    scale_fingerprints, write_sidecar)
from quantlab.export.trtllm_layouts import FP16, FP32, KV_ALGOS, LAYOUTS, concat, layout_for
from quantlab.models.arch import ARCH_SPECS
from quantlab.quant.activations import scale_from_absmax
from quantlab.quant.primitives import QuantizedWeight

NAME = "trtllm"
WEIGHTS = "rank0.safetensors"
CARRIES_ACTIVATIONS = True
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# TensorRT-LLM module → the Hugging Face Linears it concatenates (on the output dim)
MODULES = {"attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "attention.dense": ("self_attn.o_proj",),
           "mlp.fc": ("mlp.gate_proj",), "mlp.gate": ("mlp.up_proj",), "mlp.proj": ("mlp.down_proj",)}
NORMS = {"input_layernorm": "input_layernorm", "post_layernorm": "post_attention_layernorm"}
KV_FACTOR = "attention.kv_cache_scaling_factor"


def check_exportable(src: Canonical):
    """Refuse what the quant_algo cannot hold; returns its layout."""
    if src.model_type not in ARCHITECTURES:
        raise UserError(f"{NAME}: model_type {src.model_type!r} is not mapped; supported: "
                        f"{', '.join(ARCHITECTURES)}")
    layout = layout_for(src)
    layout.check(src)
    if src.scheme.type == "int":
        src.require_default_g_idx(NAME)
    if src.unquantized_linears():
        raise UserError(f"{NAME}: Linears left in float ({src.unquantized_linears()[0]}, ...) cannot be mixed into "
                        f"one {layout.quant_algo} checkpoint")
    src.require_kv_on_every_layer(NAME)
    multiple = layout.pad_multiple(src)
    if multiple:
        shapes = linear_shapes(src.config, src.spec)
        for module, parts in MODULES.items():
            out_f, in_f = sum(shapes[p][0] for p in parts), shapes[parts[0]][1]
            if in_f % multiple or out_f % multiple:
                raise UserError(f"{NAME}: {module} is [{out_f}, {in_f}]; TensorRT-LLM pads groupwise int4 Linears to "
                                f"multiples of {multiple} on both dims, so an unpadded checkpoint does not load "
                                "(try group_size 64, or export as gptq)")
    return layout


def trt_config(src: Canonical, layout) -> dict[str, Any]:
    c = src.config
    rope = c.get("rope_parameters") or {}
    kv = src.kv_cache
    return {
        "architecture": ARCHITECTURES[src.model_type], "dtype": "float16", "logits_dtype": "float32",
        "vocab_size": c["vocab_size"], "max_position_embeddings": c["max_position_embeddings"],
        "hidden_size": c["hidden_size"], "num_hidden_layers": c["num_hidden_layers"],
        "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c.get("num_key_value_heads") or c["num_attention_heads"],
        "head_size": head_dim(c), "intermediate_size": c["intermediate_size"], "hidden_act": c.get("hidden_act", "silu"),
        "norm_epsilon": c["rms_norm_eps"], "position_embedding_type": "rope_gpt_neox",
        "rotary_base": rope.get("rope_theta") or c.get("rope_theta") or 10000.0, "rotary_scaling": None,
        "attn_bias": ARCH_SPECS[src.model_type].qkv_bias, "mlp_bias": False, "share_embedding_table": False,
        "tie_word_embeddings": src.tied, **({"qwen_type": "qwen2"} if src.model_type == "qwen2" else {}),
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        "quantization": {"quant_algo": layout.quant_algo, "kv_cache_quant_algo": KV_ALGOS[kv.type] if kv else None,
                         **layout.quantization(src), "exclude_modules": ["lm_head"]},
    }


def kv_factor(src: Canonical, attention: str) -> torch.Tensor:
    """One step for K and V of a layer: max over both and over the KV heads."""
    k, v = src.kv_absmax(attention)
    return scale_from_absmax(torch.maximum(k.max(), v.max()), src.kv_cache.kind).reshape(1)


def write(src: Canonical, tmp: Path, final: Path) -> None:
    layout = check_exportable(src)
    spec, t = src.spec, src.tensors
    out: dict[str, torch.Tensor] = {"transformer.vocab_embedding.weight": t["model.embed_tokens.weight"].to(FP16),
                                    "transformer.ln_f.weight": t["model.norm.weight"].to(FP16),
                                    "lm_head.weight": t.get("lm_head.weight", t["model.embed_tokens.weight"]).to(FP16)}
    stored: dict[str, QuantizedWeight] = {}
    for i in range(int(src.config["num_hidden_layers"])):
        hf, trt = f"{spec.layers}.{i}", f"transformer.layers.{i}"
        for norm, hf_norm in NORMS.items():
            out[f"{trt}.{norm}.weight"] = t[f"{hf}.{hf_norm}.weight"].to(FP16)
            out.update({f"{trt}.{norm}.{k}": v for k, v in layout.norm_tensors().items()})
        for module, parts in MODULES.items():
            names = [f"{hf}.{p}" for p in parts]
            qws = layout.stored([src.quantized[n] for n in names])
            stored.update(zip(names, qws))
            out.update({f"{trt}.{module}.{k}": v for k, v in layout.module_tensors(src, module, names,
                                                                                   concat(qws)).items()})
            biases = [t.get(f"{n}.bias") for n in names]
            if all(b is not None for b in biases):
                out[f"{trt}.{module}.bias"] = torch.cat(biases).to(FP16)
        if src.kv_cache is not None:
            out[f"{trt}.{KV_FACTOR}"] = kv_factor(src, f"{hf}.self_attn")
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in out.items()}, tmp / WEIGHTS)
    (tmp / "config.json").write_text(json.dumps(trt_config(src, layout), indent=2) + "\n")
    write_sidecar(src, final, tmp, NAME, {"quant_algo": layout.quant_algo},
                  modules={n: fingerprint(q, scales=True) for n, q in stored.items()},
                  extra={"scales": scale_fingerprints(expected_scales(src))})


def expected_scales(src: Canonical) -> dict[str, torch.Tensor]:
    """What `read_scales` must give back: the FP8 activation step of each fused Linear (one input
    feeds q, k and v) and each layer's KV step."""
    out: dict[str, torch.Tensor] = {}
    acts = src.activations
    for i in range(int(src.config["num_hidden_layers"])):
        hf = f"{src.spec.layers}.{i}"
        if acts is not None and not acts.dynamic:
            for parts in MODULES.values():
                names = [f"{hf}.{p}" for p in parts]
                step = scale_from_absmax(torch.stack([src.input_absmax(n) for n in names]).max(), acts.kind)
                out.update({f"{n}.input_scale": step.reshape(1) for n in names})
        if src.kv_cache is not None:
            out[f"{hf}.self_attn.k_scale"] = out[f"{hf}.self_attn.v_scale"] = kv_factor(src, f"{hf}.self_attn")
    return out


# ----------------------------------------------------------------------------- reading


def _load(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], str]:
    config = read_json_object(path / "config.json")
    model_type = next(k for k, v in ARCHITECTURES.items() if v == config["architecture"])
    return config, load_file(path / WEIGHTS), model_type


def _part_sizes(config: dict[str, Any], parts: tuple[str, ...], rows: int) -> list[int]:
    if len(parts) == 1:
        return [rows]
    hd, heads, kv = config["head_size"], config["num_attention_heads"], config["num_key_value_heads"]
    return [heads * hd, kv * hd, kv * hd]


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """Back to Hugging Face names: splits qkv by the head counts, undoes the fc/gate naming."""
    config, tensors, model_type = _load(path)
    quant = config["quantization"]
    layout = LAYOUTS[quant["quant_algo"]]
    spec = ARCH_SPECS[model_type]
    floats = {"model.embed_tokens.weight": tensors["transformer.vocab_embedding.weight"],
              "model.norm.weight": tensors["transformer.ln_f.weight"], "lm_head.weight": tensors["lm_head.weight"]}
    quantized: dict[str, QuantizedWeight] = {}
    for i in range(int(config["num_hidden_layers"])):
        hf, trt = f"{spec.layers}.{i}", f"transformer.layers.{i}"
        for norm, hf_norm in NORMS.items():
            floats[f"{hf}.{hf_norm}.weight"] = tensors[f"{trt}.{norm}.weight"]
        for module, parts in MODULES.items():
            qw = layout.decode(tensors, f"{trt}.{module}", quant)
            sizes = _part_sizes(config, parts, qw.codes.shape[0])
            bias = tensors.get(f"{trt}.{module}.bias")
            for j, (p, c, s, z) in enumerate(zip(parts, qw.codes.split(sizes), qw.scales.split(sizes),
                                                 qw.zeros.split(sizes))):
                quantized[f"{hf}.{p}"] = QuantizedWeight(c.contiguous(), s.contiguous(), z.contiguous(), qw.g_idx,
                                                         qw.scheme)
                if bias is not None:
                    floats[f"{hf}.{p}.bias"] = bias.split(sizes)[j]
    return floats, quantized


def read_scales(path: Path) -> dict[str, torch.Tensor]:
    """Deploy-time steps under Hugging Face names: `N.input_scale` (FP8 activation factor of the
    fused Linear, repeated for each part) and `A.k_scale` = `A.v_scale` (the layer's KV factor)."""
    config, tensors, model_type = _load(path)
    spec = ARCH_SPECS[model_type]
    out: dict[str, torch.Tensor] = {}
    for i in range(int(config["num_hidden_layers"])):
        hf, trt = f"{spec.layers}.{i}", f"transformer.layers.{i}"
        for module, parts in MODULES.items():
            act = tensors.get(f"{trt}.{module}.activation_scaling_factor")
            if act is not None:
                out.update({f"{hf}.{p}.input_scale": act.float() for p in parts})
        kv = tensors.get(f"{trt}.{KV_FACTOR}")
        if kv is not None:
            out[f"{hf}.self_attn.k_scale"] = out[f"{hf}.self_attn.v_scale"] = kv.float()
    return out


# ----------------------------------------------------------------------------- validation


def _check_config(report: Report, config: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    arch = report.key(config, "architecture", "config", allowed=tuple(ARCHITECTURES.values()))
    for key in ("dtype", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_size", "intermediate_size", "norm_epsilon", "rotary_base"):
        report.key(config, key, "config")
    report.key(config, "position_embedding_type", "config", "rope_gpt_neox")
    report.key(config, "attn_bias", "config", allowed=(True, False))
    mapping = report.key(config, "mapping", "config") or {}
    report.key(mapping, "tp_size", "config.mapping", 1)
    report.key(mapping, "pp_size", "config.mapping", 1)
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv_heads, int):
        report.check("GQA head counts", "config.num_key_value_heads",
                     0 < kv_heads <= heads and heads % kv_heads == 0,
                     f"{kv_heads} KV heads do not divide {heads} attention heads")
    quant = report.key(config, "quantization", "config") or {}
    where = "config.quantization"
    algo = report.key(quant, "quant_algo", where, allowed=tuple(LAYOUTS))
    report.key(quant, "kv_cache_quant_algo", where, allowed=(None, *KV_ALGOS.values()))
    report.key(quant, "has_zero_point", where, False)
    report.key(quant, "exclude_modules", where, ["lm_head"])
    report.key(quant, "group_size", where, allowed=(64, 128))  # read by W4A16_AWQ only
    if algo in LAYOUTS:
        report.key(quant, "pre_quant_scale", where, algo == "W4A16_AWQ")
    return arch, quant


def validate(path: Path) -> Report:
    report = Report(NAME, str(path))
    cfg_file = path / "config.json"
    if not report.check("file", "config.json", cfg_file.is_file(), "missing"):
        return report
    config = read_json_object(cfg_file)
    arch, quant = _check_config(report, config)
    if not report.check("file", WEIGHTS, (path / WEIGHTS).is_file(), "missing") or not report.ok:
        return report
    layout = LAYOUTS[quant["quant_algo"]]
    model_type = next(k for k, v in ARCHITECTURES.items() if v == arch)
    spec = ARCH_SPECS[model_type]
    tensors = load_file(path / WEIGHTS)
    hidden, vocab, n_layers = int(config["hidden_size"]), int(config["vocab_size"]), int(config["num_hidden_layers"])
    shapes = linear_shapes({**config, "model_type": model_type, "head_dim": config["head_size"]}, spec)
    known = {"transformer.vocab_embedding.weight", "transformer.ln_f.weight", "lm_head.weight"}

    def expect(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        known.add(name)
        report.tensor(tensors, name, dtype, shape)

    expect("transformer.vocab_embedding.weight", FP16, (vocab, hidden))
    expect("transformer.ln_f.weight", FP16, (hidden,))
    expect("lm_head.weight", FP16, (vocab, hidden))
    kv_algo = quant.get("kv_cache_quant_algo")
    for i in range(n_layers):
        trt = f"transformer.layers.{i}"
        for norm in NORMS:
            expect(f"{trt}.{norm}.weight", FP16, (hidden,))
            for s in layout.norm_specs():
                expect(f"{trt}.{norm}.{s.suffix}", s.dtype, s.shape)
            layout.check_norm(report, tensors, f"{trt}.{norm}")
        for module, parts in MODULES.items():
            out_f, in_f = sum(shapes[p][0] for p in parts), shapes[parts[0]][1]
            name = f"{trt}.{module}"
            for s in layout.specs(module, out_f, in_f, quant):
                expect(f"{name}.{s.suffix}", s.dtype, s.shape)
            layout.check_values(report, tensors, name, module)
            if module == "attention.qkv" and config.get("attn_bias"):
                expect(f"{name}.bias", FP16, (out_f,))
        if kv_algo:
            expect(f"{trt}.{KV_FACTOR}", FP32, (1,))
            factor = tensors.get(f"{trt}.{KV_FACTOR}")
            if factor is not None:
                f = factor.float()
                report.check("scale is positive and finite", f"{trt}.{KV_FACTOR}",
                             bool(torch.isfinite(f).all() and (f > 0).all()), "a step size must be > 0 and finite")
    for name in tensors:
        report.check("known tensor", name, name in known,
                     f"not a TensorRT-LLM tensor of this architecture and quant_algo {layout.quant_algo}"
                     + ("" if kv_algo or not name.endswith(KV_FACTOR) else " (kv_cache_quant_algo is null)"))
    report.facts.update({"architecture": arch, "quant_algo": layout.quant_algo, "kv_cache_quant_algo": kv_algo,
                         "group_size": quant.get("group_size"), "layers": n_layers,
                         "heads / KV heads": f"{config['num_attention_heads']} / {config['num_key_value_heads']}"})
    if report.ok:
        _, quantized = read(path)
        check_fingerprints(report, path, quantized, read_scales(path))
    return report


def matches(path: Path) -> bool:
    return (path / WEIGHTS).is_file() and (path / "config.json").is_file()
