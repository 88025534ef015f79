"""The canonical quantized form: the one artifact every exporter, the runner and eval read.

A directory holding
  * `model.safetensors` — for each quantized Linear `N`: `N.weight_packed` (int32, codes
    packed along the input dim), `N.weight_scale` (fp32 `[out, groups]`),
    `N.weight_zero_point` (uint8 `[out, groups]`), `N.g_idx` (int32 `[in]`); every other
    parameter of the model in float, after any folding the algorithms did (AWQ scales in
    norms, biases);
    FP8 Linears (`"type": "float"` in their scheme) store `N.weight` (float8_e4m3fn `[out,
    in]`, `w ≈ weight · scale`) and `N.weight_scale` (fp32 `[out, 1]` per channel, `[1]` per
    tensor) instead: no packing, no zero point, no g_idx;
  * `quant_config.json` — format version and the scheme and shape of every quantized Linear
    (`modules`), plus, when the recipe quantizes activations or the KV cache:
      - `"activations"`: the `ActivationScheme` fields (`type` int|float, `dynamic`,
        `granularity` token|tensor, `observer`, `percentile`) and `"modules"`: the Linears whose
        inputs are quantized;
      - `"kv_cache"`: the `KVCacheScheme` fields (`type`, `granularity` head|tensor) and
        `"modules"`: the attention modules (`model.layers.N.self_attn`);
  * `scales.safetensors` — the calibrated ranges, all **absmax** (fp32; scale = absmax/127
    for int8, absmax/448 for FP8):
      - `N.input_absmax` (shape `[]`): per-tensor input range of Linear `N` (the observer's
        choice: plain absmax or a clipped threshold); written for every module listed under
        `activations`, dynamic schemes included (static-scale exporters need it);
      - `A.k_absmax`, `A.v_absmax` (`[num_key_value_heads]`): per-KV-head range of K (after
        RoPE) and V of attention module `A`; per-tensor schemes use their max;
      - `N.input_channel_absmax` (`[in]`) and `N.output_channel_absmax` (`[out]`): plain
        per-channel absmax of the input and output of every Linear of the ArchSpec (written by
        `act_ranges`; informational: nothing dequantizes with them, but smoothing-aware
        exporters and analysis can, and k_proj/v_proj outputs give pre-RoPE per-head ranges);
  * `folded.safetensors` (only when the recipe exports a llama.cpp K-quant): `N.weight` for
    every quantized Linear `N` as fp16, the float weight the quantizer rounded (after AWQ /
    SmoothQuant scale folding and AWQ clipping), so llama.cpp's quantizer rounds it once
    instead of re-rounding the codes;
  * the model's `config.json`, generation config and tokenizer files, so the directory is
    self-contained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from quantlab.models.moe import unfuse_experts
from quantlab.quant.activations import compute_dtype
from quantlab.quant.packing import pack, unpack
from quantlab.quant.primitives import QuantizedWeight
from quantlab.quant.scheme import WeightScheme
from quantlab.rundir import atomic_path

FORMAT = "quantlab.canonical/1"
QUANT_FIELDS = ("weight_packed", "weight_scale", "weight_zero_point", "g_idx")
SCALES_FILE = "scales.safetensors"
FOLDED_FILE = "folded.safetensors"


def input_absmax_key(linear: str) -> str:
    return f"{linear}.input_absmax"


def channel_absmax_keys(linear: str) -> tuple[str, str]:
    return f"{linear}.input_channel_absmax", f"{linear}.output_channel_absmax"


def kv_absmax_keys(attention: str) -> tuple[str, str]:
    return f"{attention}.k_absmax", f"{attention}.v_absmax"


def save_canonical(
    target: Path, model: torch.nn.Module, quantized: dict[str, QuantizedWeight], tokenizer: Any,
    extra: dict[str, Any] | None = None, scales: dict[str, torch.Tensor] | None = None,
    folded: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write the canonical directory; `scales` (named as in the module docstring) go to
    `scales.safetensors`, their schemes belong in `extra` (`activations`, `kv_cache`);
    `folded` (full Linear name → float weight before rounding) to `folded.safetensors`."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name, tensor in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        storage = (tensor.data_ptr(), tuple(tensor.shape))
        if (module in quantized and name.endswith(".weight")) or storage in seen:
            continue  # quantized weights are stored as codes; tied weights once
        seen.add(storage)
        tensors[name] = tensor.detach().cpu().contiguous()
    modules = {}
    for name, qw in quantized.items():
        if qw.scheme.type == "float":
            tensors[f"{name}.weight"] = qw.codes.to(torch.float8_e4m3fn).contiguous()
            scale = qw.scales.float()
            tensors[f"{name}.weight_scale"] = (scale[:1, 0] if qw.scheme.per_tensor else scale).contiguous()
        else:
            tensors[f"{name}.weight_packed"] = pack(qw.codes, qw.scheme.bits)
            tensors[f"{name}.weight_scale"] = qw.scales.float().contiguous()
            tensors[f"{name}.weight_zero_point"] = qw.zeros.to(torch.uint8).contiguous()
            tensors[f"{name}.g_idx"] = qw.g_idx.to(torch.int32).contiguous()
        modules[name] = {"shape": list(qw.codes.shape), **qw.scheme.model_dump()}
    config = {"format": FORMAT, "modules": modules, **(extra or {})}
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as tmp:
        tmp.mkdir()
        save_file(tensors, tmp / "model.safetensors", metadata={"format": FORMAT})
        (tmp / "quant_config.json").write_text(json.dumps(config, indent=2) + "\n")
        if scales:
            save_file({k: v.detach().float().cpu().contiguous() for k, v in scales.items()},
                      tmp / SCALES_FILE, metadata={"format": FORMAT})
        if folded:
            save_file({f"{k}.weight": v.detach().half().cpu().contiguous() for k, v in folded.items()},
                      tmp / FOLDED_FILE, metadata={"format": FORMAT})
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


def load_canonical(source: Path) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """Float tensors and quantized weights, exactly as stored."""
    config = json.loads((source / "quant_config.json").read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"{source}: not a {FORMAT} directory (format={config.get('format')!r})")
    tensors = load_file(source / "model.safetensors")
    quantized = {}
    for name, info in config["modules"].items():
        scheme = WeightScheme(bits=info["bits"], symmetric=info["symmetric"], group_size=info["group_size"],
                              type=info.get("type", "int"), per_tensor=info.get("per_tensor", False))
        out_f, in_f = info["shape"]
        if scheme.type == "float":
            quantized[name] = _fp8_weight(tensors.pop(f"{name}.weight"), tensors.pop(f"{name}.weight_scale"), scheme)
            continue
        quantized[name] = QuantizedWeight(
            codes=unpack(tensors.pop(f"{name}.weight_packed"), scheme.bits, in_f),
            scales=tensors.pop(f"{name}.weight_scale"),
            zeros=tensors.pop(f"{name}.weight_zero_point"),
            g_idx=tensors.pop(f"{name}.g_idx"),
            scheme=scheme,
        )
    return tensors, quantized


def _fp8_weight(codes: torch.Tensor, scale: torch.Tensor, scheme: WeightScheme) -> QuantizedWeight:
    out_f, in_f = codes.shape
    return QuantizedWeight(codes, scale.float().reshape(-1, 1).expand(out_f, 1).contiguous(),
                           torch.zeros(out_f, 1, dtype=torch.uint8), torch.zeros(in_f, dtype=torch.int32), scheme)


def load_quant_config(source: Path) -> dict[str, Any]:
    return json.loads((source / "quant_config.json").read_text())


def load_scales(source: Path) -> dict[str, torch.Tensor]:
    """The calibrated activation / KV ranges (empty when the run had none)."""
    path = source / SCALES_FILE
    return load_file(path) if path.is_file() else {}


def load_folded(source: Path) -> dict[str, torch.Tensor]:
    """The float weights before rounding, by Linear name (empty when the run kept none)."""
    path = source / FOLDED_FILE
    return {k.removesuffix(".weight"): v for k, v in load_file(path).items()} if path.is_file() else {}


def load_fake_quant_model(source: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Rebuild a float model whose quantized Linears hold their dequantized weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(source)
    with no_init_weights():  # every weight is overwritten below; buffers (rotary) are computed
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    unfuse_experts(model)  # MoE: the canonical form names per-expert Linears
    tensors, quantized = load_canonical(source)
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    wide = compute_dtype(dtype)  # float64 models dequantize exactly
    state.update({f"{name}.weight": qw.dequantize(wide).to(dtype) for name, qw in quantized.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    still_missing = [k for k in missing if k not in tied]
    if still_missing or unexpected:
        raise ValueError(f"{source}: canonical form does not match the model: missing "
                         f"{still_missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    return model.eval()
