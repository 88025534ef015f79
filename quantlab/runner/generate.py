"""Generation with the runner: prefill, then one token per decode step (gpt-fast's loop).

* Prompts of different lengths are **left-padded** into one batch (the model masks the pad
  keys and starts each row's RoPE positions at its first token), so row b of a batch generates
  what prompt b alone would.
* Greedy when `temperature` is 0; else softmax(logits / T) restricted to the `top_k` largest,
  sampled with the exponential-race trick (argmax p/q, q ~ Exp(1)) from a seeded generator on
  the model's device: the same seed gives the same tokens.
* `on_token(tokens [B])` is called after every step (streaming).
* Decode steps run eagerly, under a captured CUDA graph (`decode="graphs"`: the whole step is
  one replay, no Python or launch overhead), or through `torch.compile(mode="reduce-overhead")`
  (`decode="compile"`: Inductor fuses the norms, RoPE and SwiGLU around our GEMM kernels, then
  replays CUDA graphs). `"auto"` is compile on a GPU — on an H200 the 7B-shaped W4A16 model
  decoded 363 tok/s compiled against 216 graphed (`benchmarks/decode.py --decode`) —
  falling back to graphs if compiling fails, and eager on the CPU.
* The prefill runs eagerly or compiled (`prefill="compile"`, `Prefill`): each decoder layer
  goes through one torch.compile'd function with dynamic shapes — regional compilation: the
  layers share one graph (their weights are its inputs), so compiling costs one layer's time
  whatever the depth, and every prompt length reuses it. Inductor fuses the norms, RoPE, SwiGLU
  and residual adds between the GEMMs, and the host launches a fraction of the eager kernels:
  an eager 512-token prefill at batch 1 waits on the host for about half its wall time
  (`benchmarks/decode.py --profile-prefill`). `"auto"` is compile on a GPU, falling back to
  eager if compiling fails, and eager on the CPU.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import torch

from quantlab.kernels import ops
from quantlab.kernels.ops import capture_graph
from quantlab.runner.model import Transformer, call_layer

DecodeMode = Literal["auto", "eager", "graphs", "compile"]
PrefillMode = Literal["auto", "eager", "compile"]


@dataclass
class Generation:
    tokens: torch.Tensor  # [B, N] generated ids; after a row's EOS, the pad id
    lengths: list[int]  # tokens generated per row, its EOS included
    prompt_len: int  # padded prompt length
    prefill_seconds: float
    decode_seconds: float
    steps: int = 0  # decode steps run (tokens after the first, per row)
    stats: dict = field(default_factory=dict)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.tokens.shape[0] * self.prompt_len / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.tokens.shape[0] * self.steps / max(self.decode_seconds, 1e-9)


def left_pad(prompts: Sequence[Sequence[int]] | torch.Tensor, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists → `ids [B, L]` right-aligned and the pad count per row `[B]`."""
    if isinstance(prompts, torch.Tensor):
        ids = prompts if prompts.dim() == 2 else prompts[None]
        return ids.long(), torch.zeros(ids.shape[0], dtype=torch.long)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, length - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
    return ids, torch.tensor([length - len(p) for p in prompts], dtype=torch.long)


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens `[B]` from logits `[B, V]`."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / race).argmax(dim=-1)


def compile_options() -> dict[str, bool]:
    """Inductor options of the compiled decode step: mode "reduce-overhead" (CUDA graphs), and
    with QUANTLAB_PDL=1 Inductor's own kernels use programmatic dependent launch too, so the
    glue around the GEMVs and attention lets them launch early."""
    return {"triton.cudagraphs": True, **({"triton.enable_pdl": True} if ops.pdl_requested() else {})}


def compile_failed(error: Exception, fallback: bool, instead: str) -> None:
    """A compiled step failed: re-raise unless its mode was "auto", else warn what runs instead."""
    if not fallback:
        raise error
    warnings.warn(f"torch.compile failed ({type(error).__name__}: {str(error)[:200]}); {instead} instead",
                  stacklevel=3)


class DecodeStep:
    """`step(tokens [B], pos: int) -> logits [B, V]`: one decode step, eager, graphed or compiled."""

    def __init__(self, model: Transformer, mode: DecodeMode = "auto"):
        self.fallback = mode == "auto"  # compile failures fall back to graphs
        if mode == "auto":
            mode = "compile" if model.device.type == "cuda" else "eager"
        if mode == "graphs" and model.device.type != "cuda":
            raise ValueError(f"decode='graphs' needs a CUDA device, the model is on {model.device}")
        self.model, self.mode = model, mode
        dev = model.device
        self.tok = torch.zeros(model.max_batch, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None
        self._compiled = None
        if mode == "compile":
            ops.register_compiled_ops()
            self._compiled = torch.compile(self._forward, fullgraph=False, options=compile_options())

    def _forward(self) -> torch.Tensor:
        return self.model(self.tok, self.pos)[:, -1]

    def __call__(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        self.tok.copy_(tokens.view(-1, 1))
        self.pos.fill_(pos)
        if self.mode == "eager":
            return self.model(self.tok, self.pos, attend_len=pos + 1)[:, -1]
        if self.mode == "compile":
            if self._logits is None:
                # one eager step first: kernel autotuning and the split-K workspace allocate in
                # the normal allocator, not inside the compiled CUDA-graph pool (which refuses
                # buffers that outlive a replay)
                self._logits = self._forward()
            try:
                return self._compiled().clone()
            except Exception as e:  # noqa: BLE001 — Inductor or its toolchain can be missing
                compile_failed(e, self.fallback, "decoding with CUDA graphs")
                self.mode, self._compiled = "graphs", None
                return self(tokens, pos)
        if self._graph is None:
            self._capture()
        self._graph.replay()
        return self._logits

    def _capture(self) -> None:
        """Warm up (autotuning, allocator) on a side stream, then record one step. Warm-up and
        capture write K/V at this step's position, which the real replay rewrites."""
        self._graph, self._logits = capture_graph(self._forward, warmups=2)


class Prefill:
    """`prefill(ids [B, L]) -> logits [B, V]` of each row's last position, K/V written at
    positions 0…L−1: eager, or each layer through one compiled function (dynamic shapes)."""

    def __init__(self, model: Transformer, mode: PrefillMode = "auto"):
        self.fallback = mode == "auto"  # compile failures fall back to eager
        if mode == "auto":
            mode = "compile" if model.device.type == "cuda" else "eager"
        self.model, self.mode = model, mode
        self._layer = None
        if mode == "compile":
            ops.register_compiled_ops()
            self._layer = torch.compile(call_layer, dynamic=True)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self._layer is not None:
            try:
                return self._logits(ids, self._layer)
            except Exception as e:  # noqa: BLE001 — Inductor or its toolchain can be missing
                compile_failed(e, self.fallback, "prefilling eagerly")
                self.mode, self._layer = "eager", None
        return self._logits(ids, call_layer)

    def _logits(self, ids: torch.Tensor, run_layer: Callable[..., torch.Tensor]) -> torch.Tensor:
        length = ids.shape[1]
        pos = torch.arange(length, device=ids.device)
        return self.model(ids, pos, attend_len=length, last_only=True, run_layer=run_layer)[:, -1]


def prefill_step(model: Transformer, mode: PrefillMode = "auto") -> Prefill:
    """The model's prefill for `mode`, kept so that its compiled graphs are reused."""
    steps = getattr(model, "_prefill_steps", None) or {}
    if mode not in steps:
        steps[mode] = Prefill(model, mode)
    model._prefill_steps = steps
    return steps[mode]


def decode_step(model: Transformer, mode: DecodeMode = "auto") -> DecodeStep:
    """The model's decode step for its current caches (and fused or not: the captured graph
    holds one path), kept so a captured graph is reused."""
    key = (model.max_batch, model.max_seq_len, mode, model.fused_layers)
    cached = getattr(model, "_decode_step", None)
    if cached is None or cached[0] != key:
        model._decode_step = (key, DecodeStep(model, mode))
    return model._decode_step[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(model: Transformer, prompts: Sequence[Sequence[int]] | torch.Tensor, max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int | None = None, seed: int | None = None,
             eos_token_id: int | Sequence[int] | None = None, pad_token_id: int = 0,
             on_token: Callable[[torch.Tensor], None] | None = None, decode: DecodeMode = "auto",
             prefill: PrefillMode = "auto", max_seq_len: int | None = None) -> Generation:
    """Generate up to `max_new_tokens` per prompt; stops early once every row has hit EOS."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    dev = model.device
    ids, pad = left_pad(prompts)  # pad positions hold token 0: masked, any valid id would do
    b, length = ids.shape
    model.setup_caches(b, max(length + max_new_tokens, max_seq_len or 0))
    model.set_padding(pad)
    first = prefill_step(model, prefill)
    step = decode_step(model, decode) if max_new_tokens > 1 else None
    gen = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
    eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or []),
                       dtype=torch.long, device=dev)
    out = torch.full((b, max_new_tokens), pad_token_id, dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)

    _sync(dev)
    start = time.perf_counter()
    tok = sample(first(ids.to(dev)), temperature, top_k, gen)
    _sync(dev)
    prefill_seconds = time.perf_counter() - start

    steps = 0
    start = time.perf_counter()
    for i in range(max_new_tokens):
        if i:
            tok = sample(step(tok, length + i - 1), temperature, top_k, gen)
            steps += 1
        out[:, i] = torch.where(done, pad_token_id, tok)
        if on_token is not None:
            on_token(out[:, i])
        if eos.numel():
            done |= torch.isin(tok, eos)
            if bool(done.all()):
                break
    _sync(dev)
    decode_seconds = time.perf_counter() - start
    lengths = _lengths(out[:, : i + 1], eos)
    return Generation(out[:, : i + 1], lengths, length, prefill_seconds, decode_seconds, steps,
                      {"decode": step.mode if step else "none", "prefill": first.mode, "batch": b})


def _lengths(tokens: torch.Tensor, eos: torch.Tensor) -> list[int]:
    n = tokens.shape[1]
    if not eos.numel():
        return [n] * tokens.shape[0]
    hit = torch.isin(tokens, eos)
    first = torch.where(hit.any(1), hit.float().argmax(1) + 1, torch.full_like(hit[:, 0], n, dtype=torch.long))
    return [int(x) for x in first.tolist()]


def continuations(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  stop: Sequence[int] = (), pad_token_id: int = 0, max_seq_len: int | None = None) -> list[list[int]]:
    """Greedy continuation of each prompt as a token list, up to and including its stop token.
    `max_seq_len` sizes the caches for every batch to come, so they (and a captured decode
    step) are made once, not again for each longer batch."""
    out = generate(model, prompts, max_new_tokens, eos_token_id=list(stop), pad_token_id=pad_token_id,
                   max_seq_len=max_seq_len)
    return [row[:n].tolist() for row, n in zip(out.tokens.cpu(), out.lengths)]
