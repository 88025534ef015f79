"""ArchSpec: where a model family keeps its decoder layers and how their Linears relate.

The engine and every algorithm read module names from here instead of guessing. The
`sequential` groups are the true-sequential order inside a layer (inputs of a later group
depend on the quantized outputs of an earlier one); the `scaling` groups say which
preceding op (a norm or a Linear) can absorb a per-input-channel scale for the Linears that
consume its output (AWQ, SmoothQuant). Adding a family is one entry in `ARCH_SPECS`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantlab.errors import UserError


@dataclass(frozen=True)
class ScalingGroup:
    prev: str  # module (relative to the layer) whose output feeds `linears`
    linears: tuple[str, ...]


@dataclass(frozen=True)
class ArchSpec:
    name: str
    layers: str = "model.layers"
    sequential: tuple[tuple[str, ...], ...] = (
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    )
    scaling: tuple[ScalingGroup, ...] = (
        ScalingGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",)),
        ScalingGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ScalingGroup("mlp.up_proj", ("mlp.down_proj",)),
    )
    kv_proj: tuple[str, str] = ("self_attn.k_proj", "self_attn.v_proj")
    qkv_bias: bool = False

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(name for group in self.sequential for name in group)

    def decoder_layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        return model.get_submodule(self.layers)


ARCH_SPECS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama"),
    "mistral": ArchSpec("mistral"),
    "qwen2": ArchSpec("qwen2", qkv_bias=True),
}


def arch_spec_for(model: torch.nn.Module) -> ArchSpec:
    model_type = getattr(model.config, "model_type", None)
    if model_type not in ARCH_SPECS:
        raise UserError(f"model: architecture {model_type!r} is not supported yet; supported: "
                        f"{', '.join(sorted(ARCH_SPECS))}")
    return ARCH_SPECS[model_type]
