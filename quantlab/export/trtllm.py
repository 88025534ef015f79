"""TensorRT-LLM checkpoint (`config.json` + `rank0.safetensors`, read by `trtllm-build`), quant_algo
W4A16_AWQ, in the layout ModelOpt exports and `trtllm-build` preprocesses itself
(`models/modeling_utils.py` `preprocess_perlayer_weights`).

Per quantized Linear: `weight` int8 `[out/2, in]`: two signed int4 codes `q − 8` per byte,
low nibble = even output row; `weights_scaling_factor` fp16 `[out, in/G]`, dequant
`(q − 8)·s` (so only symmetric schemes fit: W4A16_AWQ has no zero point);
`prequant_scaling_factor` fp16 `[in]` of ones (quantlab folds AWQ scales into the previous
op, so there is no input scale left to apply; q, k and v share one).
Names follow TensorRT-LLM's llama/qwen mapping: q,k,v concatenated into `attention.qkv`,
`o_proj` → `attention.dense`, `gate_proj` → `mlp.fc`, `up_proj` → `mlp.gate`,
`down_proj` → `mlp.proj`.

W4A16_GPTQ (zero points) is not written: TensorRT-LLM's GPTQ checkpoints hold weights already
interleaved by its CUDA op `preprocess_weights_for_mixed_gemm` for one GPU architecture, and
`trtllm-build` does not preprocess them; an unprocessed file of the same shape would load and
compute garbage. TensorRT-LLM reads the `gptq` export directly instead (its PyTorch backend
accepts 4-bit HF GPTQ with desc_act false), and its `convert_checkpoint.py --quant_ckpt_path`
reads the GPTQ safetensors. Scales round-trip within fp16 rounding; codes exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from quantlab.errors import UserError
from quantlab.export.bits import pack_int4_pairs, unpack_int4_pairs
from quantlab.export.checks import Report
from quantlab.export.source import Canonical, check_fingerprints, head_dim, linear_shapes, write_sidecar
from quantlab.models.arch import ARCH_SPECS
from quantlab.quant.primitives import QuantizedWeight, default_g_idx
from quantlab.quant.scheme import WeightScheme

NAME = "trtllm"
WEIGHTS = "rank0.safetensors"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
GROUP_SIZES = (64, 128)  # TensorRT-LLM's groupwise int4 kernels
# TensorRT-LLM module → the Hugging Face Linears it concatenates (on the output dim)
MODULES = {"attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "attention.dense": ("self_attn.o_proj",),
           "mlp.fc": ("mlp.gate_proj",), "mlp.gate": ("mlp.up_proj",), "mlp.proj": ("mlp.down_proj",)}


def check_exportable(src: Canonical) -> None:
    scheme = src.scheme
    if src.model_type not in ARCHITECTURES:
        raise UserError(f"{NAME}: model_type {src.model_type!r} is not mapped; supported: "
                        f"{', '.join(ARCHITECTURES)}")
    if scheme.bits != 4 or not scheme.symmetric:
        raise UserError(f"{NAME}: W4A16_AWQ stores symmetric 4-bit codes with no zero point; scheme {scheme.name} "
                        "does not fit (use bits 4, symmetric true, or export as gptq, which TensorRT-LLM's "
                        "PyTorch backend loads as W4A16_GPTQ)")
    if scheme.group_size not in GROUP_SIZES:
        raise UserError(f"{NAME}: group_size {scheme.group_size} is not one TensorRT-LLM's int4 kernels take "
                        f"({', '.join(map(str, GROUP_SIZES))})")
    src.require_default_g_idx(NAME)
    if src.unquantized_linears():
        raise UserError(f"{NAME}: Linears left in float ({src.unquantized_linears()[0]}, ...) cannot be mixed into "
                        "one W4A16_AWQ checkpoint")
    multiple = max(64, scheme.group_size)
    shapes = linear_shapes(src.config, src.spec)
    for module, parts in MODULES.items():
        out_f, in_f = sum(shapes[p][0] for p in parts), shapes[parts[0]][1]
        if in_f % multiple or out_f % multiple:
            raise UserError(f"{NAME}: {module} is [{out_f}, {in_f}]; TensorRT-LLM pads groupwise int4 Linears to "
                            f"multiples of {multiple} on both dims, so an unpadded checkpoint does not load "
                            "(try group_size 64, or export as gptq)")


def trt_config(src: Canonical) -> dict[str, Any]:
    c = src.config
    rope = c.get("rope_parameters") or {}
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
        "quantization": {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": None, "group_size": src.scheme.group_size,
                         "has_zero_point": False, "pre_quant_scale": True, "exclude_modules": ["lm_head"]},
    }


def _concat(qws: list[QuantizedWeight]) -> QuantizedWeight:
    return QuantizedWeight(torch.cat([q.codes for q in qws]), torch.cat([q.scales for q in qws]),
                           torch.cat([q.zeros for q in qws]), qws[0].g_idx, qws[0].scheme)


def write(src: Canonical, tmp: Path, final: Path) -> None:
    check_exportable(src)
    spec, fp16 = src.spec, torch.float16
    t = src.tensors
    out: dict[str, torch.Tensor] = {"transformer.vocab_embedding.weight": t["model.embed_tokens.weight"].to(fp16),
                                    "transformer.ln_f.weight": t["model.norm.weight"].to(fp16),
                                    "lm_head.weight": t.get("lm_head.weight", t["model.embed_tokens.weight"]).to(fp16)}
    for i in range(int(src.config["num_hidden_layers"])):
        hf, trt = f"{spec.layers}.{i}", f"transformer.layers.{i}"
        out[f"{trt}.input_layernorm.weight"] = t[f"{hf}.input_layernorm.weight"].to(fp16)
        out[f"{trt}.post_layernorm.weight"] = t[f"{hf}.post_attention_layernorm.weight"].to(fp16)
        for module, parts in MODULES.items():
            qw = _concat([src.quantized[f"{hf}.{p}"] for p in parts])
            out[f"{trt}.{module}.weight"] = pack_int4_pairs(qw.codes.to(torch.int16) - 8)
            out[f"{trt}.{module}.weights_scaling_factor"] = qw.scales.to(fp16)
            out[f"{trt}.{module}.prequant_scaling_factor"] = torch.ones(qw.codes.shape[1], dtype=fp16)
            biases = [t.get(f"{hf}.{p}.bias") for p in parts]
            if all(b is not None for b in biases):
                out[f"{trt}.{module}.bias"] = torch.cat(biases).to(fp16)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in out.items()}, tmp / WEIGHTS)
    (tmp / "config.json").write_text(json.dumps(trt_config(src), indent=2) + "\n")
    write_sidecar(src, final, tmp, NAME, {"quant_algo": "W4A16_AWQ"})


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """Back to Hugging Face names: splits qkv by the head counts, undoes the fc/gate naming."""
    config = json.loads((path / "config.json").read_text())
    group = int(config["quantization"]["group_size"])
    tensors = load_file(path / WEIGHTS)
    model_type = next(k for k, v in ARCHITECTURES.items() if v == config["architecture"])
    spec = ARCH_SPECS[model_type]
    hd, heads, kv = config["head_size"], config["num_attention_heads"], config["num_key_value_heads"]
    sizes = {"self_attn.q_proj": heads * hd, "self_attn.k_proj": kv * hd, "self_attn.v_proj": kv * hd}
    floats = {"model.embed_tokens.weight": tensors.pop("transformer.vocab_embedding.weight"),
              "model.norm.weight": tensors.pop("transformer.ln_f.weight"),
              "lm_head.weight": tensors.pop("lm_head.weight")}
    quantized: dict[str, QuantizedWeight] = {}
    scheme = WeightScheme(bits=4, symmetric=True, group_size=group)
    for i in range(int(config["num_hidden_layers"])):
        hf, trt = f"{spec.layers}.{i}", f"transformer.layers.{i}"
        floats[f"{hf}.input_layernorm.weight"] = tensors.pop(f"{trt}.input_layernorm.weight")
        floats[f"{hf}.post_attention_layernorm.weight"] = tensors.pop(f"{trt}.post_layernorm.weight")
        for module, parts in MODULES.items():
            codes = (unpack_int4_pairs(tensors.pop(f"{trt}.{module}.weight")).to(torch.int16) + 8).to(torch.uint8)
            scales = tensors.pop(f"{trt}.{module}.weights_scaling_factor").float()
            tensors.pop(f"{trt}.{module}.prequant_scaling_factor")
            bias = tensors.pop(f"{trt}.{module}.bias", None)
            splits = [sizes[p] for p in parts] if len(parts) > 1 else [codes.shape[0]]
            for p, c, s, b in zip(parts, codes.split(splits), scales.split(splits),
                                  bias.split(splits) if bias is not None else [None] * len(parts)):
                quantized[f"{hf}.{p}"] = QuantizedWeight(c.contiguous(), s.contiguous(),
                                                         torch.full(s.shape, 8, dtype=torch.uint8),
                                                         default_g_idx(c.shape[1], group), scheme)
                if b is not None:
                    floats[f"{hf}.{p}.bias"] = b
    return floats, quantized


def validate(path: Path) -> Report:
    report = Report(NAME, str(path))
    cfg_file = path / "config.json"
    if not report.check("file", "config.json", cfg_file.is_file(), "missing"):
        return report
    config = json.loads(cfg_file.read_text())
    arch = report.key(config, "architecture", "config", allowed=tuple(ARCHITECTURES.values()))
    for key in ("dtype", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_size", "intermediate_size", "norm_epsilon", "rotary_base"):
        report.key(config, key, "config")
    report.key(config, "position_embedding_type", "config", "rope_gpt_neox")
    mapping = report.key(config, "mapping", "config") or {}
    report.key(mapping, "tp_size", "config.mapping", 1)
    report.key(mapping, "pp_size", "config.mapping", 1)
    quant = report.key(config, "quantization", "config") or {}
    report.key(quant, "quant_algo", "config.quantization", "W4A16_AWQ")
    report.key(quant, "has_zero_point", "config.quantization", False)
    report.key(quant, "pre_quant_scale", "config.quantization", True)
    group = report.key(quant, "group_size", "config.quantization", allowed=GROUP_SIZES)
    if not report.check("file", WEIGHTS, (path / WEIGHTS).is_file(), "missing") or not report.ok:
        return report
    model_type = next(k for k, v in ARCHITECTURES.items() if v == arch)
    spec = ARCH_SPECS[model_type]
    tensors = load_file(path / WEIGHTS)
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    hf_cfg = {**config, "model_type": model_type, "head_dim": config["head_size"]}
    shapes = linear_shapes(hf_cfg, spec)
    fp16 = torch.float16
    report.tensor(tensors, "transformer.vocab_embedding.weight", fp16, (vocab, hidden))
    report.tensor(tensors, "transformer.ln_f.weight", fp16, (hidden,))
    report.tensor(tensors, "lm_head.weight", fp16, (vocab, hidden))
    for i in range(int(config["num_hidden_layers"])):
        trt = f"transformer.layers.{i}"
        report.tensor(tensors, f"{trt}.input_layernorm.weight", fp16, (hidden,))
        report.tensor(tensors, f"{trt}.post_layernorm.weight", fp16, (hidden,))
        for module, parts in MODULES.items():
            out_f, in_f = sum(shapes[p][0] for p in parts), shapes[parts[0]][1]
            name = f"{trt}.{module}"
            report.tensor(tensors, f"{name}.weight", torch.int8, (out_f // 2, in_f))
            report.tensor(tensors, f"{name}.weights_scaling_factor", fp16, (out_f, in_f // group))
            pre = report.tensor(tensors, f"{name}.prequant_scaling_factor", fp16, (in_f,))
            if pre is not None and pre.shape == (in_f,):
                report.check("prequant scale is ones (AWQ scales folded)", f"{name}.prequant_scaling_factor",
                             bool((pre == 1).all()), "not all ones, but quantlab folds AWQ scales into the weights")
            if config.get("attn_bias") and module == "attention.qkv":
                report.tensor(tensors, f"{name}.bias", fp16, (out_f,))
    known = {f"transformer.layers.{i}.{m}.{s}" for i in range(int(config["num_hidden_layers"])) for m in MODULES
             for s in ("weight", "weights_scaling_factor", "prequant_scaling_factor", "bias")}
    known |= {f"transformer.layers.{i}.{n}.weight" for i in range(int(config["num_hidden_layers"]))
              for n in ("input_layernorm", "post_layernorm")}
    known |= {"transformer.vocab_embedding.weight", "transformer.ln_f.weight", "lm_head.weight"}
    for name in tensors:
        report.check("known tensor", name, name in known, "not a TensorRT-LLM tensor of this architecture")
    report.facts.update({"architecture": arch, "quant_algo": quant.get("quant_algo"), "group_size": group,
                         "layers": config["num_hidden_layers"]})
    if report.ok:
        _, quantized = read(path)
        check_fingerprints(report, path, quantized)
    return report


def matches(path: Path) -> bool:
    return (path / WEIGHTS).is_file() and (path / "config.json").is_file()
