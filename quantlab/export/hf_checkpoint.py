"""What the three Hugging Face quantized checkpoints (AWQ, GPTQ, compressed-tensors) share:
float tensors kept as they are, per-Linear quantized tensors, `config.json` with a
`quantization_config`, the tokenizer files, sharded safetensors and the fingerprint sidecar;
and, on the way back, the checks every such checkpoint must pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from quantlab.file_checks import read_json_object
from quantlab.errors import UserError
from quantlab.export.checks import Report
from quantlab.export.shards import DEFAULT_MAX_SHARD, check_index, load_sharded, save_sharded
from quantlab.export.source import (Canonical, copy_side_files, head_dim, linear_shapes, router_width,
                                    write_config, write_sidecar)
from quantlab.models.arch import spec_for_config, supported_types
from quantlab.quant.primitives import QuantizedWeight

QuantTensors = Callable[[str, QuantizedWeight], dict[str, torch.Tensor]]
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def write_checkpoint(src: Canonical, tmp: Path, final: Path, fmt: str, quant_tensors: QuantTensors,
                     quantization_config: dict[str, Any], float_dtype: torch.dtype,
                     max_shard_bytes: int = DEFAULT_MAX_SHARD, options: dict[str, Any] | None = None,
                     extra: dict[str, torch.Tensor] | None = None, sidecar: dict[str, Any] | None = None,
                     family_names: bool = False) -> None:
    """`extra`: tensors outside any Linear (KV-cache scales on the attention modules);
    `sidecar`: `modules` / `extra` for `write_sidecar` (default: the codes fingerprints);
    `family_names`: tensors named as the family's original checkpoints name them
    (`ArchSpec.to_checkpoint`: Mixtral's `block_sparse_moe`, what transformers and vLLM load),
    else as quantlab and gptqmodel name them (`mlp.experts.{e}.gate_proj`)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, t in src.tensors.items():
        tensors[name] = t.to(float_dtype) if t.is_floating_point() else t
    for name, qw in src.quantized.items():
        for suffix, t in quant_tensors(name, qw).items():
            tensors[f"{name}.{suffix}"] = t.contiguous()
    tensors.update({name: t.contiguous() for name, t in (extra or {}).items()})
    if family_names:
        tensors = {src.spec.to_checkpoint(name): t for name, t in tensors.items()}
    tmp.mkdir(parents=True)
    save_sharded(dict(sorted(tensors.items())), tmp, max_shard_bytes)
    write_config(src, tmp, quantization_config, dtype=str(float_dtype).removeprefix("torch."))
    copy_side_files(src.path, tmp)
    write_sidecar(src, final, tmp, fmt, options or {}, **(sidecar or {}))


def read_config(path: Path) -> dict[str, Any]:
    f = path / "config.json"
    if not f.is_file():
        raise UserError(f"{path}: no config.json")
    return read_json_object(f)


def start_validation(path: Path, name: str, quant_method: str) -> tuple[Report, dict[str, Any], dict[str, Any]]:
    """The opening every HF-family validator shares: a report, config.json, and its
    quantization_config (empty, with the failure recorded, when config.json has none)."""
    report = Report(name, str(path))
    config = read_config(path)
    qcfg: dict[str, Any] = config.get("quantization_config") or {}
    if report.check("config key", "config.json.quantization_config", bool(qcfg), "key is missing"):
        report.key(qcfg, "quant_method", "quantization_config", quant_method)
    return report, config, qcfg


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under quantlab's names (a family's own checkpoint names, such
    as Mixtral's `block_sparse_moe`, mapped back)."""
    try:
        tensors = load_sharded(path)
    except FileNotFoundError as exc:
        raise UserError(str(exc)) from None
    spec = spec_for_config(read_config(path))
    return tensors if spec is None else {spec.from_checkpoint(name): t for name, t in tensors.items()}


def check_layout(report: Report, path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                 skip: set[str], per_linear: Callable[[str, int, int], None],
                 weight_is_quantized: bool = False, head_quantized: bool = False) -> list[str]:
    """Names every Linear the config implies, checks its quantized tensors through `per_linear`
    and the float tensors (embedding, norms, head); returns the expected Linear names.
    `weight_is_quantized`: the format keeps the codes in `.weight` itself (int8 / FP8), so
    `per_linear` checks its dtype instead of its absence. `head_quantized`: lm_head is one of
    the quantized Linears (untied from the embedding)."""
    check_index(report, path)
    spec = spec_for_config(config)
    if not report.check("architecture", "config.json.model_type", spec is not None,
                        f"{config.get('model_type')!r} is not one of {', '.join(supported_types())}"):
        return []
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    expected = []
    for i in range(int(config["num_hidden_layers"])):
        for lin, (out_f, in_f) in linear_shapes(config, spec).items():
            name = f"{spec.layers}.{i}.{lin}"
            if name in skip:
                report.tensor(tensors, f"{name}.weight", (torch.float16, torch.bfloat16, torch.float32), (out_f, in_f))
                continue
            expected.append(name)
            if not weight_is_quantized:
                report.check("quantized, not float", name, f"{name}.weight" not in tensors,
                             "holds a float .weight next to its quantized tensors")
            per_linear(name, out_f, in_f)
        for norm in spec.norms:
            report.tensor(tensors, f"{spec.layers}.{i}.{norm}.weight", _FLOATS, (hidden,))
        for norm in spec.head_norms:
            report.tensor(tensors, f"{spec.layers}.{i}.{norm}.weight", _FLOATS, (head_dim(config),))
        for router in spec.float_linears:
            report.tensor(tensors, f"{spec.layers}.{i}.{router}.weight", _FLOATS, (router_width(config, router), hidden))
    report.tensor(tensors, "model.embed_tokens.weight", _FLOATS, (vocab, hidden))
    report.tensor(tensors, "model.norm.weight", _FLOATS, (hidden,))
    if head_quantized:
        report.check("a quantized lm_head is untied", "config.json.tie_word_embeddings",
                     not config.get("tie_word_embeddings", False), "true, but lm_head has its own codes")
        expected.append("lm_head")
        per_linear("lm_head", vocab, hidden)
    elif not config.get("tie_word_embeddings", False):
        report.tensor(tensors, "lm_head.weight", _FLOATS, (vocab, hidden))
    report.facts["quantized Linears"] = len(expected)
    return expected



def check_bias(report: Report, tensors: dict[str, torch.Tensor], config: dict[str, Any], name: str, out_f: int) -> None:
    spec = spec_for_config(config)
    if spec.qkv_bias and name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj"):
        report.tensor(tensors, f"{name}.bias", _FLOATS, (out_f,))
