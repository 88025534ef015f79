"""ArchSpec: where a model family keeps its decoder layers and how their Linears relate.

The engine and every algorithm read module names from here instead of guessing. The
`sequential` groups are the true-sequential order inside a layer (inputs of a later group
depend on the quantized outputs of an earlier one); the `scaling` groups say which
preceding op (a norm or a Linear) can absorb a per-input-channel scale for the modules that
consume its output (AWQ, SmoothQuant). A scaling group lists *every* consumer of `prev`
(a fold must rescale all of them), including float-only ones such as a MoE router; only the
Linears in `sequential` are quantized. Adding a family is one entry in `ARCH_SPECS`.

Mixture-of-experts families (`MOE_ARCH_SPECS`) name their experts with an `{e}` pattern,
expanded per expert from the model config (`ArchSpec.expand`, done by `arch_spec_for`);
their fused experts must first be unfused into per-expert Linears (`quantlab.models.moe`).
Exporters map only `ARCH_SPECS`: they refuse MoE model types with a UserError.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import torch

from quantlab.errors import UserError

EXPERT = "{e}"  # placeholder for the expert index in MoE module names


@dataclass(frozen=True)
class ScalingGroup:
    prev: str  # module (relative to the layer) whose output feeds `linears`
    linears: tuple[str, ...]


ATTENTION_SEQUENTIAL = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
)
ATTENTION_SCALING = (
    ScalingGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",)),
)


@dataclass(frozen=True)
class ArchSpec:
    name: str
    layers: str = "model.layers"
    sequential: tuple[tuple[str, ...], ...] = (
        *ATTENTION_SEQUENTIAL,
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    )
    scaling: tuple[ScalingGroup, ...] = (
        *ATTENTION_SCALING,
        ScalingGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ScalingGroup("mlp.up_proj", ("mlp.down_proj",)),
    )
    kv_proj: tuple[str, str] = ("self_attn.k_proj", "self_attn.v_proj")
    qkv_bias: bool = False
    experts: str | None = None  # MoE: the config attribute holding the number of experts
    # RMSNorms multiply by `norm_offset + weight` (Gemma stores the gain minus one); a fold
    # into such a norm must divide the gain, not the stored weight (`fold_scales`).
    norm_offset: float = 0.0
    # Float tensors of each layer an export must carry: norms over the hidden size, per-head
    # norms over head_dim (q/k norms).
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    head_norms: tuple[str, ...] = ()
    # Module names a family's original checkpoints use where ours differ (layer-relative,
    # `{e}` the expert): Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2`, which transformers'
    # and vLLM's loaders expect in an exported checkpoint.
    checkpoint_names: tuple[tuple[str, str], ...] = ()

    def to_checkpoint(self, name: str) -> str:
        """A tensor or module name as the family's checkpoints spell it."""
        return _rename(name, self.checkpoint_names)

    def from_checkpoint(self, name: str) -> str:
        return _rename(name, tuple((theirs, ours) for ours, theirs in self.checkpoint_names))

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(name for group in self.sequential for name in group)

    @property
    def float_linears(self) -> tuple[str, ...]:
        """Linears that read a scaled producer's output but stay in float (MoE routers)."""
        quantized = set(self.linears)
        return tuple(dict.fromkeys(n for g in self.scaling for n in g.linears if n not in quantized))

    @property
    def input_sets(self) -> tuple[tuple[str, ...], ...]:
        """Quantized Linears that read the very same tensor, so one input statistic (GPTQ
        Hessian, AWQ Gram) serves them all: those of a scaling group that sit in the same
        module (q/k/v; gate/up). Experts of one scaling group are separate sets — each reads
        only the tokens routed to it. Every other Linear is a set of its own."""
        quantized = set(self.linears)
        sets: dict[tuple[int, str], list[str]] = {}
        for i, group in enumerate(self.scaling):
            for name in group.linears:
                if name in quantized:
                    sets.setdefault((i, name.rpartition(".")[0]), []).append(name)
        covered = {n for names in sets.values() for n in names}
        return tuple(tuple(names) for names in sets.values()) + tuple((n,) for n in self.linears if n not in covered)

    def expand(self, config: Any) -> ArchSpec:
        """The spec with every `{e}` name repeated for each of the config's experts (a no-op
        for dense families): names in a group expand expert by expert (e0.gate, e0.up, e1.gate,
        …), and a scaling group whose `prev` is an expert's module repeats once per expert."""
        if self.experts is None:
            return self
        n = int(getattr(config, self.experts))
        scaling = tuple(ScalingGroup(prev, _expand(linears, n)) for group in self.scaling
                        for prev, linears in _per_expert(group, n))
        return replace(self, sequential=tuple(_expand(group, n) for group in self.sequential), scaling=scaling)

    def decoder_layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        return model.get_submodule(self.layers)

    @torch.no_grad()
    def fold_scales(self, prev: torch.nn.Module, consumers: list[torch.nn.Module], s: torch.Tensor) -> None:
        """Divide the producer's output channels by `s` (a norm's gain and bias, or a Linear's
        output rows and bias) and multiply the consumers' input columns by `s` (Linears, or a
        MoE router's `[experts, in]` weight): the float function is unchanged (norms are
        elementwise-affine last; attention and gated MLPs are linear in v / up per channel).
        The arithmetic runs in float32 and is rounded once into the parameters' dtype."""
        s = s.float().to(prev.weight.device)
        if isinstance(prev, torch.nn.Linear):
            _assign(prev.weight, prev.weight.float() / s[:, None])
        else:
            gain = prev.weight.float() + self.norm_offset
            _assign(prev.weight, gain / s - self.norm_offset)
        if getattr(prev, "bias", None) is not None:
            _assign(prev.bias, prev.bias.float() / s)
        for linear in consumers:
            _assign(linear.weight, linear.weight.float() * s.to(linear.weight.device)[None, :])

    def require_dense(self, stage: str) -> None:
        """For stages that take one statistic per scaling group or need every Linear to see
        tokens: a MoE expert sees only its routed tokens, possibly none."""
        if self.experts is not None:
            raise UserError(f"{stage}: mixture-of-experts models ({self.name}) are not supported by this stage "
                            "yet; quantize their weights with rtn, gptq or awq")


def _rename(name: str, pairs: tuple[tuple[str, str], ...]) -> str:
    for old, new in pairs:
        pattern = r"(?<=\.)" + re.escape(old).replace(re.escape(EXPERT), r"(\d+)") + r"(?=\.|$)"
        name = re.sub(pattern, new.replace(EXPERT, r"\1"), name)
    return name


def _assign(param: torch.Tensor, value: torch.Tensor) -> None:
    param.copy_(value.to(param.dtype))


def _expand(names: tuple[str, ...], n: int) -> tuple[str, ...]:
    """Fixed names keep their place; the `{e}` names are replaced, where the first of them
    stood, by all of them for expert 0, then for expert 1, …"""
    templates = [name for name in names if EXPERT in name]
    out: list[str] = []
    for name in names:
        if EXPERT not in name:
            out.append(name)
        elif name == templates[0]:
            out += [t.replace(EXPERT, str(e)) for e in range(n) for t in templates]
    return tuple(out)


def _per_expert(group: ScalingGroup, n: int) -> list[tuple[str, tuple[str, ...]]]:
    if EXPERT not in group.prev:
        return [(group.prev, group.linears)]
    return [(group.prev.replace(EXPERT, str(e)), tuple(x.replace(EXPERT, str(e)) for x in group.linears))
            for e in range(n)]


# The output projection as a block of its own, quantized after the last decoder layer when a
# stage says `lm_head: true` (`engine.sequential.quantize_head`); names are the model's.
HEAD_SPEC = ArchSpec("lm_head", layers="", sequential=(("lm_head",),),
                     scaling=(ScalingGroup("model.norm", ("lm_head",)),))

# The fused experts of transformers' Mixtral / Qwen2-MoE become `mlp.experts.{e}.{gate,up,down}_proj`
# Linears (quantlab.models.moe). The router `mlp.gate` and Qwen2-MoE's `mlp.shared_expert_gate`
# read the post-attention norm's output too: they absorb its scales but stay in float.
_EXPERT = f"mlp.experts.{EXPERT}"
QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
_SHARED = "mlp.shared_expert"

ARCH_SPECS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama"),
    "mistral": ArchSpec("mistral"),
    "qwen2": ArchSpec("qwen2", qkv_bias=True),
    # Per-head q_norm / k_norm sit after q_proj / k_proj: input scales on q/k/v still fold exactly.
    "qwen3": ArchSpec("qwen3", head_norms=QK_NORMS),
    # Gemma 3: the attention output and the MLP output are normed again (post_attention_layernorm,
    # post_feedforward_layernorm) before the residual add; those norms feed no Linear. The MLP
    # reads `pre_feedforward_layernorm`; gelu(gate) · up is linear in up per channel, so
    # up_proj → down_proj folds as for SwiGLU.
    "gemma3_text": ArchSpec(
        "gemma3_text",
        scaling=(
            *ATTENTION_SCALING,
            ScalingGroup("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
            ScalingGroup("mlp.up_proj", ("mlp.down_proj",)),
        ),
        norm_offset=1.0,
        norms=("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"),
        head_norms=QK_NORMS,
    ),
}

_ROUTED_MLP_SEQUENTIAL = ((f"{_EXPERT}.gate_proj", f"{_EXPERT}.up_proj"), (f"{_EXPERT}.down_proj",))
_ROUTED_MLP_SCALING = (
    ScalingGroup("post_attention_layernorm", (f"{_EXPERT}.gate_proj", f"{_EXPERT}.up_proj", "mlp.gate")),
    ScalingGroup(f"{_EXPERT}.up_proj", (f"{_EXPERT}.down_proj",)),
)

MOE_ARCH_SPECS: dict[str, ArchSpec] = {
    "mixtral": ArchSpec("mixtral", experts="num_local_experts",
                        sequential=(*ATTENTION_SEQUENTIAL, *_ROUTED_MLP_SEQUENTIAL),
                        scaling=(*ATTENTION_SCALING, *_ROUTED_MLP_SCALING),
                        checkpoint_names=((f"{_EXPERT}.gate_proj", "block_sparse_moe.experts.{e}.w1"),
                                          (f"{_EXPERT}.up_proj", "block_sparse_moe.experts.{e}.w3"),
                                          (f"{_EXPERT}.down_proj", "block_sparse_moe.experts.{e}.w2"),
                                          ("mlp.gate", "block_sparse_moe.gate"))),
    # Qwen3-MoE: Qwen3 attention (q/k norms, no bias), routed experts, no shared expert.
    "qwen3_moe": ArchSpec("qwen3_moe", experts="num_experts", head_norms=QK_NORMS,
                          sequential=(*ATTENTION_SEQUENTIAL, *_ROUTED_MLP_SEQUENTIAL),
                          scaling=(*ATTENTION_SCALING, *_ROUTED_MLP_SCALING)),
    "qwen2_moe": ArchSpec(
        "qwen2_moe",
        experts="num_experts",
        qkv_bias=True,
        sequential=(
            *ATTENTION_SEQUENTIAL,
            (f"{_EXPERT}.gate_proj", f"{_EXPERT}.up_proj", f"{_SHARED}.gate_proj", f"{_SHARED}.up_proj"),
            (f"{_EXPERT}.down_proj", f"{_SHARED}.down_proj"),
        ),
        scaling=(
            *ATTENTION_SCALING,
            ScalingGroup("post_attention_layernorm", (f"{_EXPERT}.gate_proj", f"{_EXPERT}.up_proj",
                                                      f"{_SHARED}.gate_proj", f"{_SHARED}.up_proj",
                                                      "mlp.gate", "mlp.shared_expert_gate")),
            ScalingGroup(f"{_EXPERT}.up_proj", (f"{_EXPERT}.down_proj",)),
            ScalingGroup(f"{_SHARED}.up_proj", (f"{_SHARED}.down_proj",)),
        ),
    ),
}


def n_experts(config: dict[str, Any]) -> int:
    """Routed experts per layer of a saved `config.json` (0: dense); transformers saves the
    count under `num_local_experts` or `num_experts`, depending on family and version."""
    return int(config.get("num_local_experts") or config.get("num_experts") or 0)


def spec_for_config(config: dict[str, Any]) -> ArchSpec | None:
    """The spec (experts expanded) of a saved `config.json`; None for an unknown family."""
    model_type = config.get("model_type")
    if model_type in ARCH_SPECS:
        return ARCH_SPECS[model_type]
    spec = MOE_ARCH_SPECS.get(model_type)
    if spec is None:
        return None
    return spec.expand(SimpleNamespace(**{spec.experts: n_experts(config)}))


def supported_types() -> list[str]:
    return sorted({**ARCH_SPECS, **MOE_ARCH_SPECS})


def arch_spec_for(model: torch.nn.Module) -> ArchSpec:
    """The model's spec, experts expanded; a MoE model must have unfused experts in every layer."""
    model_type = getattr(model.config, "model_type", None)
    if model_type in ARCH_SPECS:
        return ARCH_SPECS[model_type]
    if model_type not in MOE_ARCH_SPECS:
        raise UserError(f"model: architecture {model_type!r} is not supported yet; supported: "
                        f"{', '.join(supported_types())}")
    spec = MOE_ARCH_SPECS[model_type].expand(model.config)
    _check_linears(model, spec)
    return spec


def _check_linears(model: torch.nn.Module, spec: ArchSpec) -> None:
    """Every layer must hold every Linear the spec names: dense layers mixed into a MoE model
    (Qwen2-MoE `mlp_only_layers`) or still-fused experts would otherwise fail mid-run."""
    for i, layer in enumerate(spec.decoder_layers(model)):
        for name in spec.linears:
            try:
                found = isinstance(layer.get_submodule(name), torch.nn.Linear)
            except AttributeError:
                found = False
            if not found:
                raise UserError(f"model: {spec.name} layer {i} has no Linear {name!r}; quantlab quantizes "
                                "MoE models whose every layer is a mixture-of-experts block, with experts "
                                "unfused into Linears (quantlab.models.moe.unfuse_experts)")
