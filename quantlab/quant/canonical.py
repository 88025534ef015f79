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
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from safetensors.torch import load_file, save_file

from quantlab.file_checks import read_json_object
from quantlab.models.lazy import (INDEX, CheckpointLayers, checkpoint_files, load_outside_layers, read_checkpoint,
                                   read_tensors, skeleton)
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
    """Write the canonical directory of a model held whole in memory; `scales` (named as in the
    module docstring) go to `scales.safetensors`, their schemes belong in `extra`
    (`activations`, `kv_cache`); `folded` (full Linear name → float weight before rounding) to
    `folded.safetensors`."""
    with canonical_writer(target) as writer:
        writer.finish(model, tokenizer, quantized, extra, scales, folded)


@contextmanager
def canonical_writer(target: Path) -> Iterator["CanonicalWriter"]:
    """A `CanonicalWriter` into a temporary sibling of `target` that replaces `target` only
    once the block returns (an interrupted run leaves no half-written canonical form)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as tmp:
        tmp.mkdir()
        yield CanonicalWriter(tmp)


def layer_tensors(prefix: str, layer: torch.nn.Module, quantized: Iterable[str]) -> dict[str, torch.Tensor]:
    """A block's float tensors under full names, on the CPU, without the weights of its
    quantized Linears (`quantized`: block-relative names), which are stored as codes."""
    skip = {f"{name}.weight" for name in quantized}
    full = (lambda n: f"{prefix}.{n}") if prefix else (lambda n: n)
    return {full(n): t.detach().cpu().contiguous() for n, t in layer.state_dict().items() if n not in skip}


class CanonicalWriter:
    """Writes the canonical form block by block: each decoder layer's tensors go to their own
    shard as soon as the layer is quantized (`add_block`), so no step holds every layer's codes;
    `finish` adds the rest of the model (embeddings, final norm, lm_head) and the metadata.
    A form written in one piece is the single file `model.safetensors`; a sharded one is
    `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`, Hugging Face's
    layout (`load_canonical` reads both)."""

    def __init__(self, path: Path):
        self.path = path
        self.shards: list[str] = []
        self.weight_map: dict[str, str] = {}
        self.modules: dict[str, dict[str, Any]] = {}
        self.total_size = 0

    def add_block(self, tensors: dict[str, torch.Tensor], quantized: dict[str, QuantizedWeight]) -> None:
        """One shard: float tensors (full names, CPU) and quantized Linears (full names)."""
        shard = dict(tensors)
        for name, qw in quantized.items():
            shard.update(_encoded(name, qw))
            self.modules[name] = {"shape": list(qw.codes.shape), **qw.scheme.model_dump()}
        fname = f"shard-{len(self.shards):05d}.safetensors"
        save_file(shard, self.path / fname, metadata={"format": FORMAT})
        self.shards.append(fname)
        self.weight_map.update(dict.fromkeys(shard, fname))
        self.total_size += sum(t.numel() * t.element_size() for t in shard.values())

    def finish(self, model: torch.nn.Module, tokenizer: Any, quantized: dict[str, QuantizedWeight] | None = None,
               extra: dict[str, Any] | None = None, scales: dict[str, torch.Tensor] | None = None,
               folded: dict[str, torch.Tensor] | None = None) -> None:
        """The last shard (every tensor of `model` not written yet, `quantized` as codes), the
        index, quant_config.json, scales, folded weights, config and tokenizer."""
        quantized = quantized or {}
        rest: dict[str, torch.Tensor] = {}
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for name, tensor in model.state_dict().items():
            storage = (tensor.data_ptr(), tuple(tensor.shape))
            if name in self.weight_map or (name.removesuffix(".weight") in {**quantized, **self.modules}
                                          and name.endswith(".weight")) or storage in seen:
                continue  # written with its block; stored as codes; tied weights once
            if tensor.is_meta:
                raise ValueError(f"canonical form: {name} was released before it was written")
            seen.add(storage)
            rest[name] = tensor.detach().cpu().contiguous()
        self.add_block(rest, quantized)
        self._name_shards()
        config = {"format": FORMAT, "modules": self.modules, **(extra or {})}
        (self.path / "quant_config.json").write_text(json.dumps(config, indent=2) + "\n")
        if scales:
            save_file({k: v.detach().float().cpu().contiguous() for k, v in scales.items()},
                      self.path / SCALES_FILE, metadata={"format": FORMAT})
        if folded:
            save_file({f"{k}.weight": v.detach().half().cpu().contiguous() for k, v in folded.items()},
                      self.path / FOLDED_FILE, metadata={"format": FORMAT})
        model.config.save_pretrained(self.path)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(self.path)
        tokenizer.save_pretrained(self.path)

    def _name_shards(self) -> None:
        """Final shard names; the index only when there is more than one."""
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        renamed = dict(zip(self.shards, names))
        for old, new in renamed.items():
            (self.path / old).rename(self.path / new)
        if n > 1:
            index = {"metadata": {"total_size": self.total_size},
                     "weight_map": {k: renamed[v] for k, v in self.weight_map.items()}}
            (self.path / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _encoded(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The stored tensors of quantized Linear `name` (see the module docstring)."""
    if qw.scheme.type == "float":
        scale = qw.scales.float()
        return {f"{name}.weight": qw.codes.to(torch.float8_e4m3fn).contiguous(),
                f"{name}.weight_scale": (scale[:1, 0] if qw.scheme.per_tensor else scale).cpu().contiguous()}
    return {f"{name}.weight_packed": pack(qw.codes.cpu(), qw.scheme.bits),
            f"{name}.weight_scale": qw.scales.float().cpu().contiguous(),
            f"{name}.weight_zero_point": qw.zeros.to(torch.uint8).cpu().contiguous(),
            f"{name}.g_idx": qw.g_idx.to(torch.int32).cpu().contiguous()}


def load_canonical(source: Path) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """Float tensors and quantized weights, exactly as stored."""
    config = read_json_object(source / "quant_config.json")
    if config.get("format") != FORMAT:
        raise ValueError(f"{source}: not a {FORMAT} directory (format={config.get('format')!r})")
    tensors = read_checkpoint(source)
    quantized = {name: _decode(name, info, tensors) for name, info in config["modules"].items()}
    return tensors, quantized


def _scheme(info: dict[str, Any]) -> WeightScheme:
    return WeightScheme(bits=info["bits"], symmetric=info["symmetric"], group_size=info["group_size"],
                        type=info.get("type", "int"), per_tensor=info.get("per_tensor", False))


def _stored_names(name: str, info: dict[str, Any]) -> list[str]:
    """The tensors quantized Linear `name` is stored as."""
    fields = ("weight", "weight_scale") if info.get("type", "int") == "float" else QUANT_FIELDS
    return [f"{name}.{field}" for field in fields]


def _decode(name: str, info: dict[str, Any], tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
    """Quantized Linear `name` from its stored tensors (taken out of `tensors`)."""
    scheme = _scheme(info)
    if scheme.type == "float":
        return _fp8_weight(tensors.pop(f"{name}.weight"), tensors.pop(f"{name}.weight_scale"), scheme)
    return QuantizedWeight(
        codes=unpack(tensors.pop(f"{name}.weight_packed"), scheme.bits, info["shape"][1]),
        scales=tensors.pop(f"{name}.weight_scale"),
        zeros=tensors.pop(f"{name}.weight_zero_point"),
        g_idx=tensors.pop(f"{name}.g_idx"),
        scheme=scheme,
    )


def canonical_model(source: Path, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, CheckpointLayers]:
    """The fake-quant model of a canonical form built like `models.lazy.lazy_model`: the parts
    outside the decoder layers read now, each layer read (its codes dequantized) when loaded.
    Holds the weights `load_fake_quant_model` holds; for evaluating a model larger than host
    memory layer by layer."""
    from transformers import AutoConfig

    modules = load_quant_config(source)["modules"]
    files = checkpoint_files(source)
    wide = compute_dtype(dtype)

    def read(names: list[str], device: torch.device | str) -> dict[str, torch.Tensor]:
        coded = {n: n.removesuffix(".weight") for n in names if n.endswith(".weight") and n[:-7] in modules}
        out = read_tensors(files, [n for n in names if n not in coded], dtype, device)
        for name, linear in coded.items():
            stored = read_tensors(files, _stored_names(linear, modules[linear]), None, device)
            out[name] = _decode(linear, modules[linear], stored).dequantize(wide).to(dtype)
        return out

    model = skeleton(AutoConfig.from_pretrained(source), dtype)
    return model, load_outside_layers(model, read)


def _fp8_weight(codes: torch.Tensor, scale: torch.Tensor, scheme: WeightScheme) -> QuantizedWeight:
    out_f, in_f = codes.shape
    return QuantizedWeight(codes, scale.float().reshape(-1, 1).expand(out_f, 1).contiguous(),
                           torch.zeros(out_f, 1, dtype=torch.uint8), torch.zeros(in_f, dtype=torch.int32), scheme)


def load_quant_config(source: Path) -> dict[str, Any]:
    return read_json_object(source / "quant_config.json")


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
