"""Perplexity with the wikitext-2 protocol used by GPTQ, AWQ and the peers.

Join the documents with "\\n\\n", tokenize once, cut into non-overlapping windows of
`seq_len` tokens (the tail shorter than a window is dropped), score every token after the
first of each window, and report exp(mean NLL) with the window and token counts so results
are comparable across tools. `max_windows` evaluates the first k windows only. For a model
whose tokenizer starts texts with BOS (`bos`), each window is BOS + `seq_len − 1` tokens of
the stream, all of them scored (llama.cpp's perplexity does the same).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from quantlab.data.sampling import with_bos
from quantlab.engine.sequential import Head, LayerStore, final_hidden_states
from quantlab.models.arch import HEAD_SPEC, arch_spec_for
from quantlab.errors import UserError


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float
    windows: int
    windows_available: int
    seq_len: int
    tokens_scored: int
    tokens_total: int
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, mean_nll: float, windows: int, stream: torch.Tensor, seq_len: int, seconds: float,
           bos: int | None = None) -> "PerplexityResult":
        """The result of `windows` windows of `stream` whose scored tokens averaged `mean_nll`."""
        return cls(perplexity=math.exp(mean_nll), mean_nll=mean_nll, windows=windows,
                   windows_available=stream.numel() // (seq_len - (bos is not None)), seq_len=seq_len,
                   tokens_scored=windows * (seq_len - 1), tokens_total=stream.numel(), seconds=round(seconds, 2))


def windows_of(stream: torch.Tensor, seq_len: int, max_windows: int | None, bos: int | None = None) -> torch.Tensor:
    """`[count, seq_len]` consecutive windows of the stream (BOS first in each when given)."""
    step = seq_len - (bos is not None)
    available = stream.numel() // step
    if available == 0:
        # Bad input, not a bug: one line naming the field, no traceback (UserError).
        raise UserError(f"evaluate.perplexity.seq_len: the evaluation data has {stream.numel()} tokens, "
                        f"fewer than one window of {seq_len}; lower seq_len or use a larger dataset")
    count = min(available, max_windows) if max_windows else available
    return with_bos(stream[: count * step].view(count, step), bos)


def window_logits(model: torch.nn.Module, windows: torch.Tensor, device: torch.device,
                  layers: LayerStore | None = None) -> Callable[[int], torch.Tensor]:
    """Logits `[seq_len − 1, V]` of window `i` at every position but the last (the positions
    perplexity scores): one forward of the whole model per window, or, with `layers` (a lazily
    read checkpoint, `quantlab.models.lazy`), every window through decoder layer i before layer
    i + 1 is read, then the final norm and lm_head per window. Host memory then holds one
    layer and the windows' last hidden states (40 × 512 × 8192 in bf16: 0.3 GB for a 72B
    model), never the whole model; the arithmetic per window is the same (tests/test_lazy.py)."""
    if layers is None:
        model.to(device)
        return lambda i: model(windows[i : i + 1].to(device), use_cache=False).logits[0, :-1]
    hidden = final_hidden_states(model, arch_spec_for(model), windows, 1, device, layers)
    head = Head(model.get_submodule(HEAD_SPEC.scaling[0].prev), model.get_output_embeddings()).to(device)
    return lambda i: head(hidden[i])[0, :-1]


@torch.no_grad()
def perplexity(
    model: torch.nn.Module,
    stream: torch.Tensor,
    seq_len: int,
    max_windows: int | None = None,
    device: torch.device = torch.device("cpu"),
    on_window: Callable[[int, int], None] | None = None,
    bos: int | None = None,
    layers: LayerStore | None = None,
) -> PerplexityResult:
    """`layers`: the decoder layers come from this store, one at a time (`window_logits`)."""
    start = time.perf_counter()
    windows = windows_of(stream, seq_len, max_windows, bos)
    logits_of = window_logits(model, windows, device, layers)
    total_nll = 0.0
    for i, window in enumerate(windows):
        logits = logits_of(i).float()
        total_nll += F.cross_entropy(logits, window[1:].to(device), reduction="sum").item()
        if on_window:
            on_window(i + 1, len(windows))
    mean = total_nll / (len(windows) * (seq_len - 1))
    return PerplexityResult.of(mean, len(windows), stream, seq_len, time.perf_counter() - start, bos)
