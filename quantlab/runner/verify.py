"""Verification: does the runner compute what the fake-quant model (the evaluated numbers)
computes?

* Greedy generation with the runner (one left-padded batch), then, per prompt, one forward of
  prompt + generated tokens through both models with hooks on every decoder layer: per-layer
  max / mean absolute error of the hidden states, the final logits' relative error
  ‖runner − fq‖ / ‖fq‖, and greedy agreement — the share of generated positions where the
  fake-quant model's argmax, given the same context, is the runner's token (teacher forcing:
  one near-tie flips one position instead of derailing the rest of the comparison).
* The reference's own floor: the fake-quant model run again in float64 on the same sequences,
  its argmax agreement with the working-precision fake-quant model. Schemes that round
  activations (per-token int8, FP8, int8 KV) turn a last-bit difference into a different code
  and, layers later, a different logit: two computations of the very same scheme then disagree
  where the top two logits are close. The floor says how much disagreement that alone makes,
  so a runner below 100 % can be told apart from a runner that computes something else.
* Perplexity of both models on the same windows (the wikitext protocol of
  `quantlab.eval.perplexity`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Sequence

import torch
from torch import nn

from quantlab.eval.perplexity import perplexity
from quantlab.runner.generate import generate
from quantlab.runner.model import Transformer


class RunnerLM(nn.Module):
    """The runner behind a transformers-like call (`model(ids).logits`) for `perplexity`."""

    def __init__(self, runner: Transformer):
        super().__init__()
        # not a submodule: `perplexity` calls .to(device), which cannot move packed weights
        self.__dict__["runner"] = runner

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        return SimpleNamespace(logits=self.runner.full_logits(input_ids))


@dataclass
class _LayerStats:
    max_abs: float = 0.0
    abs_sum: float = 0.0
    count: int = 0
    diff_sq: float = 0.0
    ref_sq: float = 0.0

    def add(self, ours: torch.Tensor, ref: torch.Tensor) -> None:
        d = (ours.float() - ref.float())
        self.max_abs = max(self.max_abs, d.abs().max().item())
        self.abs_sum += d.abs().sum().item()
        self.count += d.numel()
        self.diff_sq += d.pow(2).sum().item()
        self.ref_sq += ref.float().pow(2).sum().item()

    def row(self) -> dict[str, float]:
        return {"max_abs": self.max_abs, "mean_abs": self.abs_sum / max(self.count, 1),
                "rel": (self.diff_sq / max(self.ref_sq, 1e-30)) ** 0.5}


@dataclass
class _Captured:
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)

    def attach(self, layers: nn.ModuleList) -> "_Captured":
        for i, layer in enumerate(layers):
            def hook(_m, _a, out, i=i):
                self.outputs[i] = (out[0] if isinstance(out, tuple) else out).detach()
            self.handles.append(layer.register_forward_hook(hook))
        return self

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def compare(runner: Transformer, reference: nn.Module, prompts: Sequence[Sequence[int]],
            max_new_tokens: int = 64, floor: bool = True) -> dict[str, Any]:
    """Layer errors, logit error and greedy agreement of `runner` against `reference` (a
    transformers model, e.g. `load_fake_quant_model` with `apply_fake_quant`); with `floor`,
    the reference's agreement with its own float64 copy (module docstring)."""
    start = time.perf_counter()
    gen = generate(runner, prompts, max_new_tokens)
    layers = [_LayerStats() for _ in runner.model.layers]
    logits, floor_logits = _LayerStats(), _LayerStats()
    agree, floor_agree, first_miss = 0, 0, []
    ref_dev = next(reference.parameters()).device
    ref64 = copy.deepcopy(reference).double() if floor else None
    for i, prompt in enumerate(prompts):
        new = gen.tokens[i].cpu()
        seq = torch.cat([torch.as_tensor(list(prompt), dtype=torch.long), new])[None]
        ours_cap = _Captured().attach(runner.model.layers)
        ref_cap = _Captured().attach(reference.model.layers)
        try:
            ours = runner.full_logits(seq)
            ref = reference(seq.to(ref_dev), use_cache=False).logits
        finally:
            ours_cap.remove()
            ref_cap.remove()
        for j, stats in enumerate(layers):
            stats.add(ours_cap.outputs[j].cpu(), ref_cap.outputs[j].cpu())
        ref = ref.cpu()
        logits.add(ours.cpu(), ref)
        generated = slice(len(prompt) - 1, len(prompt) - 1 + new.numel())  # logits predicting `new`
        ref_next = ref[0, generated].argmax(-1)
        hits = ref_next == new
        agree += int(hits.sum())
        if ref64 is not None:
            exact = ref64(seq.to(ref_dev), use_cache=False).logits.cpu()
            floor_logits.add(ref, exact)
            floor_agree += int((exact[0, generated].argmax(-1) == ref_next).sum())
        first_miss.append(int(hits.numel() if hits.all() else (~hits).float().argmax()))
    total = gen.tokens.numel()
    return {
        "prompts": len(prompts), "prompt_tokens": _span(prompts),
        "max_new_tokens": max_new_tokens,
        "greedy_agreement": agree / max(total, 1), "tokens_compared": total,
        "prompts_fully_agreeing": sum(m == gen.tokens.shape[1] for m in first_miss),
        "first_disagreement": first_miss,
        "logits": logits.row(),
        "reference_floor": None if ref64 is None else {
            "greedy_agreement": floor_agree / max(total, 1), "logits_rel": floor_logits.row()["rel"],
            "what": "fake-quant model vs its float64 copy at the same positions"},
        "layers": [{"layer": j, **s.row()} for j, s in enumerate(layers)],
        "runner_decode_tokens_per_s": round(gen.decode_tokens_per_s, 2),
        "seconds": round(time.perf_counter() - start, 2),
    }


def _span(prompts: Sequence[Sequence[int]]) -> list[int]:
    lengths = [len(p) for p in prompts]
    return [min(lengths), max(lengths)]


def perplexity_pair(runner: Transformer, reference: nn.Module, stream: torch.Tensor, seq_len: int,
                    windows: int, device: torch.device, bos: int | None = None) -> dict[str, Any]:
    """Perplexity of runner and reference on the same first `windows` windows of `stream`."""
    ours = perplexity(RunnerLM(runner), stream, seq_len, windows, device, bos=bos)
    ref = perplexity(reference, stream, seq_len, windows, device, bos=bos)
    return {"runner": ours.to_dict(), "fake_quant": ref.to_dict(),
            "rel_diff_pct": 100 * (ours.perplexity / ref.perplexity - 1)}


def prompts_from_stream(stream: torch.Tensor, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens, evenly spaced over the token stream."""
    from quantlab.errors import UserError

    if stream.numel() < count * length:
        raise UserError(f"verify: the dataset has {stream.numel()} tokens, fewer than num_prompts × "
                        f"prompt_tokens = {count} × {length}; lower them or use more text")
    stride = (stream.numel() - length) // max(count - 1, 1) if count > 1 else 0
    return [stream[i * stride: i * stride + length].tolist() for i in range(count)]
