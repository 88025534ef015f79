"""What the runner needs to know of a model, read from its transformers config.

One `ModelArgs` describes every family the runner builds; the families differ only in a few
switches (per-head q/k norms, Gemma's norm gain offset, embedding scale and sandwich norms,
GELU vs SiLU, sliding-window layers, routed experts). Anything the runner cannot compute
exactly — logit soft-capping, partial rotary, an unknown RoPE type, dense layers mixed into a
mixture-of-experts model — is a UserError naming the field, never a silent approximation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from quantlab.errors import UserError

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "mixtral", "qwen2_moe", "qwen3_moe")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class RopeArgs:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class MoEArgs:
    """Routed experts: softmax over the router's logits, the top `top_k` experts per token,
    their weights renormalized to sum to 1 when `norm_topk_prob`; Qwen2-MoE adds a shared
    expert scaled by `sigmoid(shared_expert_gate(x))`."""

    num_experts: int
    top_k: int
    norm_topk_prob: bool
    shared_expert: bool = False


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeArgs
    tie_word_embeddings: bool
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # RMSNorms multiply by `norm_offset + weight` (Gemma: 1)
    embed_scale: float = 1.0  # token embeddings are multiplied by it (Gemma: sqrt(hidden))
    sandwich_norms: bool = False  # Gemma: attention and MLP outputs are normed before the residual add
    activation: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    query_scale: float | None = None  # softmax scale of q·k; None: 1 / sqrt(head_dim)
    sliding_window: int | None = None  # keys within this distance, for layers of kind SLIDING
    layer_types: tuple[str, ...] = ()  # FULL / SLIDING per layer; empty: all FULL
    rope_local: RopeArgs | None = None  # RoPE of SLIDING layers when it differs (Gemma 3)
    moe: MoEArgs | None = None

    def layer_type(self, index: int) -> str:
        return self.layer_types[index] if self.layer_types else FULL

    @classmethod
    def from_hf(cls, config: Any) -> "ModelArgs":
        """From a transformers config of a supported family; unsupported features are UserErrors."""
        mt = getattr(config, "model_type", None)
        if mt not in SUPPORTED:
            raise UserError(f"model: the runner supports {', '.join(SUPPORTED)}, got model_type {mt!r}")
        for field in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(config, field, None):
                raise UserError(f"model: {field} is set; the runner has no logit soft-capping")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        gemma = mt == "gemma3_text"
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise UserError(f"model: activation {act!r} is not supported by the runner ({', '.join(ACTIVATIONS)})")
        rope_params = dict(getattr(config, "rope_parameters", None) or {})
        layer_types = _layer_types(config)
        return cls(
            model_type=mt, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
            num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim, rms_norm_eps=config.rms_norm_eps,
            rope=_rope_args(rope_params.get(FULL, rope_params) if gemma else rope_params, config),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qk_norm=mt in ("qwen3", "qwen3_moe", "gemma3_text"),
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=math.sqrt(config.hidden_size) if gemma else 1.0,
            sandwich_norms=gemma,
            activation=ACTIVATIONS[act],
            query_scale=config.query_pre_attn_scalar ** -0.5 if gemma else None,
            sliding_window=getattr(config, "sliding_window", None) if SLIDING in layer_types else None,
            layer_types=layer_types,
            rope_local=_rope_args(rope_params[SLIDING], config) if gemma and SLIDING in rope_params else None,
            moe=_moe_args(config, mt),
        )


def _layer_types(config: Any) -> tuple[str, ...]:
    """FULL / SLIDING per layer: the config's `layer_types` where it has them (Gemma 3, Qwen2/3
    with `use_sliding_window`), else all SLIDING when a window is set (Mistral, Mixtral)."""
    types = getattr(config, "layer_types", None)
    if types:
        unknown = sorted(set(types) - {FULL, SLIDING})
        if unknown:
            raise UserError(f"model: layer_types {unknown} are not supported by the runner ({FULL}, {SLIDING})")
        return tuple(types)
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return (SLIDING,) * config.num_hidden_layers
    return ()


def _moe_args(config: Any, model_type: str) -> MoEArgs | None:
    if model_type == "mixtral":
        return MoEArgs(config.num_local_experts, config.num_experts_per_tok, True)
    if model_type not in ("qwen2_moe", "qwen3_moe"):
        return None
    sparse_step = getattr(config, "decoder_sparse_step", 1) or 1
    if getattr(config, "mlp_only_layers", None) or sparse_step != 1:
        raise UserError(f"model: {model_type} with dense layers (mlp_only_layers / decoder_sparse_step) is not "
                        "supported by the runner; every layer must be a mixture-of-experts block")
    return MoEArgs(config.num_experts, config.num_experts_per_tok, bool(config.norm_topk_prob),
                   shared_expert=model_type == "qwen2_moe")


def _rope_args(params: dict[str, Any], config: Any) -> RopeArgs:
    legacy = getattr(config, "rope_scaling", None) or {}
    params = {**legacy, **params}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3"):
        raise UserError(f"model: RoPE type {kind!r} is not supported by the runner (default, linear, llama3)")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UserError("model: partial rotary embeddings are not supported by the runner")
    return RopeArgs(theta=float(theta), type=kind, factor=float(params.get("factor", 1.0)),
                    low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                    high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                    original_max_position_embeddings=int(params.get(
                        "original_max_position_embeddings", getattr(config, "max_position_embeddings", 8192))))
