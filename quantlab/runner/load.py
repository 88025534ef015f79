"""Build a runner `Transformer` from a run's canonical form, a float checkpoint directory, or
a transformers model in memory.

Everything goes through `build_runner(config, tensors, quantized, quant_config, scales)`: the
float tensors and quantized weights exactly as `quantlab.quant.canonical.load_canonical`
returns them, plus the `activations` / `kv_cache` entries of quant_config.json and the
calibrated absmax table. Nothing is read from the model code of transformers; its config
object only supplies the shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantlab.errors import UserError
from quantlab.quant.canonical import (
    input_absmax_key, kv_absmax_keys, load_canonical, load_quant_config, load_scales,
)
from quantlab.quant.primitives import QuantizedWeight
from quantlab.quant.scheme import ActivationScheme, KVCacheScheme, scheme_from_entry
from quantlab.runner.codes import InputQuant
from quantlab.runner.kv import KVQuant
from quantlab.runner.linear import Concat, build_linear, fuse
from quantlab.runner.config import ModelArgs
from quantlab.runner.model import MLP, Attention, Block, Decoder, RMSNorm, Transformer
from quantlab.runner.moe import MoE

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def canonical_dir(path: Path) -> Path | None:
    """The canonical directory of a run dir (`RUN/quantized`) or the directory itself."""
    for candidate in (path, path / "quantized"):
        if (candidate / "quant_config.json").is_file():
            return candidate
    return None


def model_dir(path: Path) -> Path:
    """Where config/tokenizer live: the canonical dir of a run, or a float checkpoint dir."""
    found = canonical_dir(path)
    if found is not None:
        return found
    if (path / "config.json").is_file():
        return path
    raise UserError(f"{path}: neither a run directory (no quantized/quant_config.json), a canonical "
                    "directory (no quant_config.json) nor a model directory (no config.json)")


def load_runner(path: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                fused: bool = True) -> Transformer:
    """A runner from a run dir / canonical dir (quantized) or a float safetensors checkpoint dir."""
    from transformers import AutoConfig

    source = model_dir(Path(path))
    config = AutoConfig.from_pretrained(source)
    if canonical_dir(source) is not None:
        tensors, quantized = load_canonical(source)
        return build_runner(config, tensors, quantized, load_quant_config(source), load_scales(source),
                            device, dtype, fused)
    return build_runner(config, _float_tensors(source), {}, {}, {}, device, dtype, fused)


def _float_tensors(source: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise UserError(f"{source}: no *.safetensors weights (the runner reads float checkpoints in safetensors)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors


def from_hf_model(model: nn.Module, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None, fused: bool = True) -> Transformer:
    """A float runner with the weights of a transformers model (for tests and benchmarks)."""
    p = next(model.parameters())
    return build_runner(model.config, dict(model.state_dict()), {}, {}, {}, device or p.device, dtype or p.dtype, fused)


def build_runner(config: Any, tensors: dict[str, torch.Tensor], quantized: dict[str, QuantizedWeight],
                 quant_config: dict[str, Any], scales: dict[str, torch.Tensor],
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 fused: bool = True) -> Transformer:
    args = ModelArgs.from_hf(config)
    device = torch.device(device)
    tensors = unfused_expert_tensors(tensors)
    acts = _input_quant(quant_config, scales)
    kv = _kv_quant(quant_config, scales)
    get = _Tensors(tensors, dtype, device)

    def linear(name: str) -> nn.Module:
        weight = quantized.get(name)
        if weight is None:
            weight = get(f"{name}.weight")
        return build_linear(weight, get.optional(f"{name}.bias"), acts.get(name), dtype, device)

    def group(prefix: str, names: tuple[str, ...]) -> nn.Module:
        parts = [linear(f"{prefix}.{n}") for n in names]
        return fuse(parts) if fused else Concat(parts)

    def norm(name: str) -> RMSNorm:
        return RMSNorm(get(f"{name}.weight"), args.rms_norm_eps, args.norm_offset)

    def mlp(prefix: str) -> MLP:
        return MLP(group(prefix, GATE_UP), linear(f"{prefix}.down_proj"), args.activation)

    def feed_forward(p: str) -> nn.Module:
        if args.moe is None:
            return mlp(f"{p}.mlp")
        shared = args.moe.shared_expert
        return MoE(args.moe, get(f"{p}.mlp.gate.weight"),
                   [mlp(f"{p}.mlp.experts.{e}") for e in range(args.moe.num_experts)],
                   mlp(f"{p}.mlp.shared_expert") if shared else None,
                   linear(f"{p}.mlp.shared_expert_gate") if shared else None)

    blocks = []
    for i in range(args.num_layers):
        p = f"model.layers.{i}"
        qk_norms = (norm(f"{p}.self_attn.q_norm"), norm(f"{p}.self_attn.k_norm")) if args.qk_norm else ()
        attn = Attention(args, group(f"{p}.self_attn", QKV), linear(f"{p}.self_attn.o_proj"),
                         kv.get(f"{p}.self_attn"), *qk_norms)
        sandwich = (norm(f"{p}.pre_feedforward_layernorm"), norm(f"{p}.post_feedforward_layernorm")) \
            if args.sandwich_norms else ()
        blocks.append(Block(norm(f"{p}.input_layernorm"), attn, norm(f"{p}.post_attention_layernorm"),
                            feed_forward(p), args.layer_type(i), *sandwich))
    embed = nn.Embedding.from_pretrained(get("model.embed_tokens.weight"), freeze=True)
    decoder = Decoder(embed, blocks, norm("model.norm"))
    if "lm_head" in quantized or "lm_head.weight" in tensors:
        lm_head = linear("lm_head")
    elif args.tie_word_embeddings:
        lm_head = build_linear(embed.weight, None, acts.get("lm_head"), dtype, device)
        if hasattr(lm_head, "weight"):
            lm_head.weight = embed.weight  # tied: one tensor
    else:
        raise UserError("model: no lm_head.weight and tie_word_embeddings is false")
    return Transformer(args, decoder, lm_head).eval()


def unfused_expert_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` in place of transformers' fused
    `mlp.experts.gate_up_proj [E, 2I, H]` / `mlp.experts.down_proj [E, H, I]` (a float model
    in memory); the canonical form already names experts one by one."""
    fused = [name[: -len(".gate_up_proj")] for name in tensors if name.endswith("mlp.experts.gate_up_proj")]
    if not fused:
        return tensors
    out = dict(tensors)
    for prefix in fused:
        gate_up, down = out.pop(f"{prefix}.gate_up_proj"), out.pop(f"{prefix}.down_proj")
        inter = down.shape[-1]
        for e in range(gate_up.shape[0]):
            out[f"{prefix}.{e}.gate_proj.weight"] = gate_up[e, :inter]
            out[f"{prefix}.{e}.up_proj.weight"] = gate_up[e, inter:]
            out[f"{prefix}.{e}.down_proj.weight"] = down[e]
    return out


class _Tensors:
    """Float tensors by name, moved to the runner's device and dtype on access."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
        self.tensors, self.dtype, self.device = tensors, dtype, device

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise UserError(f"model: tensor {name!r} is missing from the checkpoint")
        return self.tensors[name].to(device=self.device, dtype=self.dtype)

    def optional(self, name: str) -> torch.Tensor | None:
        return self(name) if name in self.tensors else None


def _input_quant(config: dict[str, Any], scales: dict[str, torch.Tensor]) -> dict[str, InputQuant]:
    entry = config.get("activations")
    if not entry:
        return {}
    scheme = scheme_from_entry(entry, ActivationScheme)
    out = {}
    for name in entry["modules"]:
        absmax = None
        if not scheme.dynamic:
            absmax = scales.get(input_absmax_key(name))
            if absmax is None:
                raise UserError(f"scales.safetensors: static activation scheme but no {input_absmax_key(name)}")
        out[name] = InputQuant(scheme.kind, scheme.granularity == "token", absmax)
    return out


def _kv_quant(config: dict[str, Any], scales: dict[str, torch.Tensor]) -> dict[str, KVQuant]:
    entry = config.get("kv_cache")
    if not entry:
        return {}
    scheme = scheme_from_entry(entry, KVCacheScheme)
    out = {}
    for name in entry["modules"]:
        k_key, v_key = kv_absmax_keys(name)
        if k_key not in scales or v_key not in scales:
            raise UserError(f"scales.safetensors: KV cache scheme but no {k_key} / {v_key}")
        out[name] = KVQuant.from_absmax(scheme.kind, scales[k_key], scales[v_key], scheme.granularity == "head")
    return out
