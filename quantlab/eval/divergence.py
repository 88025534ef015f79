"""How far the quantized model's next-token distribution moves from the float model's, on the
perplexity windows: KL divergence KL(float ‖ quantized) per scored token (mean, 99th percentile,
max) and top-1 agreement, the share of positions where both models' argmax token is the same.

Perplexity averages the log-probability of the one reference token, so a model can keep its
perplexity while its distribution over the other tokens drifts; llama.cpp's `llama-perplexity
--kl-divergence` reports these two figures for that reason. Both models run window by window:
only one window's logits of each are in memory at a time, plus one float per scored token;
models larger than host memory run layer by layer (`perplexity.window_logits`).
The candidate's log-probabilities also give its perplexity on the same windows
(`candidate_mean_nll`), so a run evaluates the quantized model once for both.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from quantlab.engine.sequential import LayerStore
from quantlab.eval.perplexity import window_logits, windows_of


@dataclass
class DivergenceResult:
    mean_kld: float
    p99_kld: float
    max_kld: float
    top1_agreement: float
    windows: int
    seq_len: int
    tokens_scored: int
    seconds: float
    candidate_mean_nll: float  # the candidate's mean NLL of the next tokens (its perplexity's log)

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def divergence(
    reference: torch.nn.Module,
    candidate: torch.nn.Module,
    stream: torch.Tensor,
    seq_len: int,
    max_windows: int | None = None,
    device: torch.device = torch.device("cpu"),
    on_window: Callable[[int, int], None] | None = None,
    bos: int | None = None,
    reference_layers: LayerStore | None = None,
    candidate_layers: LayerStore | None = None,
) -> DivergenceResult:
    """`*_layers`: that model's decoder layers come from the store, one at a time (models
    larger than host memory; `perplexity.window_logits`)."""
    start = time.perf_counter()
    windows = windows_of(stream, seq_len, max_windows, bos)
    reference_logits = window_logits(reference, windows, device, reference_layers)
    candidate_logits = window_logits(candidate, windows, device, candidate_layers)
    per_token: list[torch.Tensor] = []
    agree, nll = 0, 0.0
    for i, window in enumerate(windows):
        targets = window[1:].to(device)
        ref = F.log_softmax(reference_logits(i).float(), dim=-1)
        cand = F.log_softmax(candidate_logits(i).float(), dim=-1)
        per_token.append((ref.exp() * (ref - cand)).sum(dim=-1).double().cpu())
        agree += int((ref.argmax(dim=-1) == cand.argmax(dim=-1)).sum())
        nll -= float(cand.gather(-1, targets[:, None]).double().sum())
        if on_window:
            on_window(i + 1, len(windows))
    kld = torch.cat(per_token)
    return DivergenceResult(
        mean_kld=float(kld.mean()), p99_kld=float(torch.quantile(kld, 0.99)), max_kld=float(kld.max()),
        top1_agreement=agree / kld.numel(), windows=len(windows), seq_len=seq_len, tokens_scored=kld.numel(),
        seconds=round(time.perf_counter() - start, 2), candidate_mean_nll=nll / kld.numel(),
    )
