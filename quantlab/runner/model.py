"""The runner's decoder in plain PyTorch: llama, mistral, qwen2/3, gemma3 and their MoE kin.

Modelled on gpt-fast: RMSNorm, RoPE from a precomputed table, GQA attention over a static KV
cache, gated MLP (or routed experts, `quantlab.runner.moe`), q/k/v and gate/up each fused into
one GEMM where the backends allow. The family switches (`quantlab.runner.config.ModelArgs`):
per-head q/k norms, Gemma's `1 + weight` norms, scaled embeddings and sandwich norms, GELU,
sliding-window layers (a banded mask over the same static cache, their own RoPE table).
Module names follow transformers (`model.layers.N.self_attn…`) so the canonical form's tensor
names map directly and verification can hook the same layers on both sides.

Batches are left-padded: `pad[b]` leading positions of row b hold no token. Every row's RoPE
positions start at 0 at its first real token and its queries never see the pad keys, so a row
computes the same as it would alone. A forward takes `input_pos [L]` (cache positions shared by
the batch) and attends over the first `attend_len` cache positions (all, under CUDA graphs).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from quantlab.errors import UserError
from quantlab.kernels import ops
from quantlab.kernels.layout import PackedWNA16
from quantlab.kernels.ops import Epilogue
from quantlab.quant.activations import compute_dtype
from quantlab.runner.config import FULL, SLIDING, ModelArgs, RopeArgs
from quantlab.runner.kv import KVCache, KVQuant
from quantlab.runner.linear import WNA16Linear

ATTENTION = ("torch", "triton")


def inv_frequencies(rope: RopeArgs, head_dim: int) -> torch.Tensor:
    """RoPE inverse frequencies; `linear` divides them by the factor, `llama3` (Llama 3.1)
    divides only the long wavelengths and interpolates between its two cut-offs."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if rope.type == "linear":
        return inv / rope.factor
    if rope.type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    """`weight · x / rms(x)`; with an `offset` (Gemma) the gain is `offset + weight`, applied in
    float32 before the cast back, as transformers computes it."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (self.weight.float() + self.offset)).to(x.dtype)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, qkv: nn.Module, o_proj: nn.Module, kv_quant: KVQuant | None,
                 q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None):
        super().__init__()
        self.qkv, self.o_proj = qkv, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm  # per head, before RoPE (Qwen3, Gemma 3)
        self.heads, self.kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        # Attention kernels scale q·k by 1/sqrt(d); another softmax scale is folded into q.
        self.q_factor = 1.0 if args.query_scale is None else args.query_scale * math.sqrt(args.head_dim)
        self.kv_quant = kv_quant
        self.kv_cache: KVCache | None = None
        self.fused_decode = False  # decode steps through kernels/triton_attention (Transformer.set_attention)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                input_pos: torch.Tensor, attend_len: int | None) -> torch.Tensor:
        b, length, _ = x.shape
        d, h, kvh = self.head_dim, self.heads, self.kv_heads
        q, k, v = self.qkv(x).split([h * d, kvh * d, kvh * d], dim=-1)
        q, k = q.view(b, length, h, d), k.view(b, length, kvh, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, length, kvh, d).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if self.q_factor != 1.0:
            q = q * self.q_factor
        if length == 1 and self.fused_decode and ops.decode_attention_ok(q):
            cache = self.kv_cache
            cache.write(input_pos, k, v)
            y = ops.decode_attention(q[:, :, 0], cache.k, cache.v, mask[:, 0, 0], input_pos, *cache.head_scales())
            return self.o_proj(y.reshape(b, 1, h * d))
        k, v = self.kv_cache.update(input_pos, k, v, attend_len)
        y = attend(q, k, v, mask)
        return self.o_proj(y.transpose(1, 2).reshape(b, length, h * d))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked softmax attention, `q [B, H, L, D]`, `k, v [B, KVH, S, D]`, `mask [B, 1, L, S]`.

    Decode (L = 1): the query heads of a KV group are stacked as rows of one matmul, so K and V
    are read once and never repeated per head. Prefill: SDPA with GQA."""
    b, h, length, d = q.shape
    kvh = k.shape[1]
    if length > 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=kvh != h)
    qg = q.reshape(b, kvh, h // kvh, d)  # query head i belongs to KV head i // (h / kvh)
    scores = (qg @ k.transpose(-1, -2)).to(compute_dtype(q.dtype)) * (1.0 / math.sqrt(d))
    scores = scores.masked_fill(~mask, float("-inf"))  # [B, 1, 1, S] broadcasts over the group
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return (probs @ v).reshape(b, h, 1, d)


def activate(gate: torch.Tensor, kind: str) -> torch.Tensor:
    """The gated MLP's activation: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU)."""
    return F.gelu(gate, approximate="tanh") if kind == "gelu_tanh" else F.silu(gate)


class MLP(nn.Module):
    def __init__(self, gate_up: nn.Module, down_proj: nn.Module, activation: str = "silu"):
        super().__init__()
        self.gate_up, self.down_proj, self.activation = gate_up, down_proj, activation
        self.interleaved = False  # gate_up's columns alternate gate, up (`interleave_gate_up`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gate_up(x)
        if self.interleaved:
            gate, up = y[..., 0::2], y[..., 1::2]
        else:
            gate, up = y.chunk(2, dim=-1)
        return self.down_proj(activate(gate, self.activation) * up)

    def interleave_gate_up(self) -> None:
        """Reorder gate_up's output columns to gate₀, up₀, gate₁, up₁, … so that one GEMV tile
        holds both halves of each SwiGLU product (the RMS_SWIGLU epilogue)."""
        if not self.interleaved:
            p = self.gate_up.packed
            half = p.out_features // 2
            order = torch.stack((torch.arange(half), torch.arange(half) + half), 1).flatten().to(p.qweight.device)
            self.gate_up.packed = PackedWNA16(p.qweight[:, order].contiguous(), p.scales[:, order].contiguous(),
                                              p.zeros[:, order].contiguous(), p.bits, p.group_size, p.in_features,
                                              p.out_features, p.perm)
            self.interleaved = True


class Block(nn.Module):
    """A decoder layer. Pre-norm (llama): `post_attention_layernorm` norms the MLP's input.
    Sandwich (Gemma, both extra norms given): it norms the attention's output, and
    `pre_feedforward_layernorm` / `post_feedforward_layernorm` the MLP's input and output."""

    def __init__(self, input_layernorm: RMSNorm, self_attn: Attention, post_attention_layernorm: RMSNorm,
                 mlp: nn.Module, kind: str = FULL, pre_feedforward_layernorm: RMSNorm | None = None,
                 post_feedforward_layernorm: RMSNorm | None = None):
        super().__init__()
        self.input_layernorm, self.self_attn = input_layernorm, self_attn
        self.post_attention_layernorm, self.mlp = post_attention_layernorm, mlp
        self.pre_feedforward_layernorm = pre_feedforward_layernorm
        self.post_feedforward_layernorm = post_feedforward_layernorm
        self.kind = kind  # FULL or SLIDING: which mask and RoPE table the layer takes

    def forward(self, x, cos, sin, mask, input_pos, attend_len):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, mask, input_pos, attend_len)
        if self.pre_feedforward_layernorm is None:
            h = x + attn
            return h + self.mlp(self.post_attention_layernorm(h))
        h = x + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))

    def fused_step(self, x: torch.Tensor, xw: torch.Tensor, next_norm: torch.Tensor | None,
                   rope: tuple[torch.Tensor, torch.Tensor], start: torch.Tensor,
                   input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token through the layer as four epilogue GEMVs and the attention's first launch
        (o_proj's GEMV combines its partials; `Transformer.set_fused_decode`): `x [1, hidden]`
        the residual stream and `xw` its product with this layer's input-norm weight → the same
        pair for the next layer (the second empty after the last). Keys from `start[0]` on."""
        attn, mlp, norm = self.self_attn, self.mlp, self.post_attention_layernorm
        d, heads, kv_heads = attn.head_dim, attn.heads, attn.kv_heads
        cache = attn.kv_cache
        q, _ = ops.wna16_gemv_epilogue(xw, attn.qkv.packed, Epilogue.RMS_ROPE_CACHE, x, attn.qkv.bias,
                                     self.input_layernorm.eps, (*rope, input_pos), (cache.k, cache.v),
                                     heads * d, kv_heads * d)
        parts = ops.attention_partials(q.view(1, heads, d), cache.k, cache.v, input_pos, start)
        h, hw = ops.wna16_gemv_epilogue(parts, attn.o_proj.packed, Epilogue.RESIDUAL, x, norm.weight)
        act, _ = ops.wna16_gemv_epilogue(hw, mlp.gate_up.packed, Epilogue.RMS_SWIGLU, h, eps=norm.eps)
        return ops.wna16_gemv_epilogue(act, mlp.down_proj.packed, Epilogue.RESIDUAL, h, next_norm)

    def fusable(self) -> bool:
        """Whether `fused_step` takes this layer: a llama-style layer (global attention, SwiGLU,
        no q/k norms), W4A16/W8A16 GEMV-able linears without act-order, biases only on q/k/v,
        a compute-dtype KV cache, a power-of-2 head size up to 128."""
        attn, mlp = self.self_attn, self.mlp
        plain = (self.kind == FULL and self.pre_feedforward_layernorm is None and attn.q_norm is None
                 and attn.q_factor == 1.0 and self.input_layernorm.offset == 0.0
                 and isinstance(mlp, MLP) and mlp.activation == "silu")
        if not plain:
            return False
        linears = (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down_proj)
        d = attn.head_dim
        return (all(isinstance(m, WNA16Linear) and m.packed.gemv_ok and m.packed.perm is None for m in linears)
                and all(m.bias is None for m in linears[1:]) and attn.kv_quant is None
                and 16 <= d <= 128 and d & (d - 1) == 0)


def call_layer(layer: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
               input_pos: torch.Tensor, attend_len: int | None) -> torch.Tensor:
    """One decoder layer's forward (`Transformer.forward`'s `run_layer`)."""
    return layer(x, cos, sin, mask, input_pos, attend_len)


class Decoder(nn.Module):
    """`model.*` of a transformers checkpoint: embeddings, the blocks and the final norm."""

    def __init__(self, embed_tokens: nn.Embedding, layers: list[Block], norm: RMSNorm):
        super().__init__()
        self.embed_tokens, self.layers, self.norm = embed_tokens, nn.ModuleList(layers), norm


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, model: Decoder, lm_head: nn.Module):
        super().__init__()
        self.args, self.model, self.lm_head = args, model, lm_head
        self.max_batch, self.max_seq_len = 0, 0
        self.fused_layers = False  # batch-1 decode steps through Block.fused_step

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def set_attention(self, kind: str) -> None:
        """Decode-step attention: "torch" (`attend`: matmuls and a softmax over the cache, C8
        dequantized first) or "triton" (one flash-decoding kernel reading the cache as stored,
        up to the step's position; where Triton runs, else the torch path)."""
        if kind not in ATTENTION:
            raise UserError(f"attention: choose from {', '.join(ATTENTION)}, got {kind!r}")
        for layer in self.model.layers:
            layer.self_attn.fused_decode = kind == "triton"

    def set_fused_decode(self, on: bool) -> bool:
        """Batch-1 decode steps as four epilogue GEMVs and the attention's partials per layer
        (`Block.fused_step`, kernels/gemv_epilogue.py) where every layer takes it and the
        Triton kernels run here; returns whether it is on. Interleaves gate_up's columns."""
        layers = self.model.layers
        self.fused_layers = on and self.dtype in (torch.bfloat16, torch.float16) and \
            ops.use_triton(self.model.embed_tokens.weight) and all(layer.fusable() for layer in layers)
        if self.fused_layers:
            for layer in layers:
                layer.mlp.interleave_gate_up()
        return self.fused_layers

    def setup_caches(self, batch: int, max_seq_len: int) -> None:
        """Allocate the KV caches and the RoPE table; reused while large enough (and the batch
        matches, so a captured CUDA graph stays valid). Left padding is reset to none."""
        if batch != self.max_batch or max_seq_len > self.max_seq_len:
            dev, a = self.device, self.args
            for layer in self.model.layers:
                attn = layer.self_attn
                attn.kv_cache = KVCache(batch, a.num_kv_heads, max_seq_len, a.head_dim, self.dtype, dev, attn.kv_quant)
            for suffix, rope in (("", a.rope), ("_local", a.rope_local)):
                if rope is not None:
                    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float), inv_frequencies(rope, a.head_dim))
                    emb = torch.cat((freqs, freqs), dim=-1)
                    self.register_buffer("rope_cos" + suffix, emb.cos().to(dev), persistent=False)
                    self.register_buffer("rope_sin" + suffix, emb.sin().to(dev), persistent=False)
            self.register_buffer("pad", torch.zeros(batch, dtype=torch.long, device=dev), persistent=False)
            self.max_batch, self.max_seq_len = batch, max_seq_len
        self.pad.zero_()

    def set_padding(self, pad: torch.Tensor) -> None:
        """Leading pad positions per row (copied in place: CUDA graphs keep the buffer)."""
        self.pad.copy_(pad.to(self.pad.device))

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor, attend_len: int | None = None,
                last_only: bool = False, run_layer: Callable[..., torch.Tensor] = call_layer) -> torch.Tensor:
        """Logits `[B, L, vocab]` (`[B, 1, vocab]` with `last_only`) of tokens `idx [B, L]`
        at cache positions `input_pos [L]`; K/V of these tokens are written to the caches.
        `run_layer(layer, x, cos, sin, mask, input_pos, attend_len)` runs each decoder layer
        (the compiled prefill passes one compiled function for all of them)."""
        if self.max_batch == 0:
            raise RuntimeError("call setup_caches(batch, max_seq_len) before the forward pass")
        if self.fused_layers and idx.shape == (1, 1):
            return self._fused_decode_step(idx, input_pos)
        x = self.embed(idx)
        kinds = {layer.kind for layer in self.model.layers}
        masks = {kind: self._mask(input_pos, attend_len or self.max_seq_len, kind) for kind in kinds}
        ropes = {kind: self._rope(input_pos, x.dtype, kind) for kind in kinds}
        for layer in self.model.layers:
            x = run_layer(layer, x, *ropes[layer.kind], masks[layer.kind], input_pos, attend_len)
        x = self.model.norm(x[:, -1:] if last_only else x)
        return self.lm_head(x)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token embeddings, times the family's embedding scale (Gemma: sqrt(hidden), in the
        weights' dtype as transformers rounds it)."""
        x = self.model.embed_tokens(idx)
        scale = self.args.embed_scale
        return x if scale == 1.0 else x * torch.tensor(scale, dtype=x.dtype)

    def _fused_decode_step(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """Logits `[1, 1, vocab]` of one token at batch 1 through `Block.fused_step`: no mask
        to build, the attention sees the keys from the row's first non-pad position on."""
        layers = self.model.layers
        x = self.model.embed_tokens(idx).view(1, -1)
        xw = x * layers[0].input_layernorm.weight
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else None
            x, xw = layer.fused_step(x, xw, next_norm, (self.rope_cos, self.rope_sin), self.pad, input_pos)
        return self.lm_head(self.model.norm(x.view(1, 1, -1)))

    def _rope(self, input_pos: torch.Tensor, dtype: torch.dtype, kind: str = FULL) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[B, 1, L, D]`; sliding-window layers take their own table where the family
        has one (Gemma 3's local RoPE base)."""
        local = kind == SLIDING and self.args.rope_local is not None
        cos, sin = (self.rope_cos_local, self.rope_sin_local) if local else (self.rope_cos, self.rope_sin)
        pos = (input_pos[None, :] - self.pad[:, None]).clamp(min=0)  # [B, L]: 0 at each row's first token
        return cos[pos].to(dtype)[:, None], sin[pos].to(dtype)[:, None]

    def _mask(self, input_pos: torch.Tensor, length: int, kind: str = FULL) -> torch.Tensor:
        """`[B, 1, L, S]`: causal, no pad keys, and for sliding-window layers only keys less than
        the window behind; a position always sees itself (pad queries stay finite, so nothing
        undefined reaches the cache)."""
        keys = torch.arange(length, device=input_pos.device)
        q = input_pos[:, None]
        visible = keys[None, :] <= q
        if kind == SLIDING:
            visible &= keys[None, :] > q - self.args.sliding_window
        mask = visible[None] & (keys[None, None, :] >= self.pad[:, None, None])
        return (mask | (keys[None, :] == q)[None])[:, None]

    @torch.no_grad()
    def full_logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of whole sequences from position 0 (evaluation): the caches are set up to fit."""
        b, length = idx.shape
        if b != self.max_batch or length > self.max_seq_len:
            self.setup_caches(b, length)
        else:
            self.pad.zero_()
        return self(idx.to(self.device), torch.arange(length, device=self.device), attend_len=length)
