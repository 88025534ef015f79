"""Calibration sampling: documents → a fixed `[num_samples, seq_len]` tensor of token ids.

Strategies:
  * `random_windows` — concatenate all documents (joined by "\\n\\n") and take windows at
    seeded random offsets (the GPTQ reference's way of sampling wikitext/c4);
  * `concat_chunk` — concatenate, cut into consecutive non-overlapping windows and keep a
    seeded random subset of them (no token used twice);
  * `per_document` — one window from the start of each document long enough, a seeded
    random subset of those documents (keeps document boundaries, e.g. for chat data).
Every sample has exactly `seq_len` tokens, so the engine can batch them without padding.
A model whose tokenizer starts every text with a BOS token (Gemma, Llama 3) gets it as the
first token of every window (`bos_prefix`): a window without it is not an input the model was
trained on, and the first position's activations (the attention sink) would be off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from quantlab.errors import UserError
from quantlab.recipe import CalibrationSpec


@dataclass
class CalibrationSet:
    input_ids: torch.Tensor  # int64 [num_samples, seq_len]
    source_tokens: int  # tokens available in the source, for the record


def bos_prefix(tokenizer: Any) -> int | None:
    """The BOS id when the tokenizer puts it before encoded text by default, else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a").input_ids
    return bos if ids and ids[0] == bos else None


def with_bos(windows: torch.Tensor, bos: int | None) -> torch.Tensor:
    """`[n, L]` windows as `[n, L + 1]` with `bos` first (unchanged when `bos` is None)."""
    if bos is None:
        return windows
    return torch.cat([torch.full((windows.shape[0], 1), bos, dtype=windows.dtype), windows], dim=1)


def tokenize_joined(docs: list[str], tokenizer: Any) -> torch.Tensor:
    ids = tokenizer("\n\n".join(docs), return_tensors="pt", add_special_tokens=False).input_ids[0]
    return ids.to(torch.int64)


def sample(docs: list[str], tokenizer: Any, spec: CalibrationSpec, seed: int) -> CalibrationSet:
    gen = torch.Generator().manual_seed(seed)
    bos = bos_prefix(tokenizer)
    n, length = spec.num_samples, spec.seq_len - (bos is not None)
    if spec.strategy == "per_document":
        calib = _per_document(docs, tokenizer, n, length, gen)
        return CalibrationSet(with_bos(calib.input_ids, bos), calib.source_tokens)
    stream = tokenize_joined(docs, tokenizer)
    if spec.strategy == "random_windows":
        if stream.numel() <= length:
            raise _too_short("calibration.seq_len", length, stream.numel())
        if n * length > stream.numel():
            _warn_overlap(n, length, stream.numel())
        starts = torch.randint(0, stream.numel() - length, (n,), generator=gen)
    else:  # concat_chunk
        chunks = stream.numel() // length
        if chunks < n:
            raise UserError(f"calibration.num_samples: {n} windows of {length} tokens requested but the "
                            f"data has {stream.numel()} tokens ({chunks} windows); lower num_samples or "
                            f"seq_len, or use strategy random_windows")
        starts = torch.randperm(chunks, generator=gen)[:n].sort().values * length
    windows = torch.stack([stream[s : s + length] for s in starts.tolist()])
    return CalibrationSet(with_bos(windows, bos), stream.numel())


def _per_document(docs: list[str], tokenizer: Any, n: int, length: int, gen: torch.Generator) -> CalibrationSet:
    long_enough = []
    total = 0
    for doc in docs:
        ids = tokenizer(doc, add_special_tokens=False).input_ids
        total += len(ids)
        if len(ids) >= length:
            long_enough.append(torch.tensor(ids[:length], dtype=torch.int64))
    if len(long_enough) < n:
        raise UserError(f"calibration.num_samples: {n} documents of at least {length} tokens requested "
                        f"but only {len(long_enough)} qualify; lower num_samples or seq_len, or use "
                        f"strategy concat_chunk")
    pick = torch.randperm(len(long_enough), generator=gen)[:n].sort().values
    return CalibrationSet(torch.stack([long_enough[i] for i in pick.tolist()]), total)


def _warn_overlap(n: int, length: int, have: int) -> None:
    """Random windows from too little data must overlap: the repeated tokens weigh more in the
    calibration statistics than the rest. Allowed (results stay what they were), but said."""
    from quantlab.progress import console

    console.print(f"warning: calibration: {n} samples × {length} tokens need {n * length} tokens but the data "
                  f"has {have}, so the windows overlap; add data or lower calibration.num_samples or seq_len",
                  soft_wrap=True, markup=False, highlight=False)


@dataclass(frozen=True)
class TokenDemand:
    """What one reader of a data source needs: at least `tokens` tokens of the joined stream
    (`tokenize_joined`); `what` and `advice` make the one-line refusal."""

    field: str
    tokens: int
    what: str
    advice: str

    def check(self, source: str, have: int) -> None:
        if have < self.tokens:
            raise UserError(f"{self.field}: {source!r} has {have} tokens, fewer than {self.what}; {self.advice}")


def calibration_demand(spec: CalibrationSpec, bos: bool) -> TokenDemand:
    """The tokens `sample` needs for `spec` (`bos`: the tokenizer prefixes BOS): enough for the
    window strategies; for per_document only the necessary one document's worth."""
    length = spec.seq_len - bos
    if spec.strategy == "concat_chunk":
        return TokenDemand("calibration.num_samples", spec.num_samples * length,
                           f"{spec.num_samples} windows of {length} tokens",
                           "lower num_samples or seq_len, or use strategy random_windows")
    if spec.strategy == "random_windows":
        return TokenDemand("calibration.seq_len", length + 1, f"one sample of {length} tokens plus one",
                           "lower seq_len or use more data")
    return TokenDemand("calibration.seq_len", length, f"one document of {length} tokens",
                       "lower seq_len or use more data")


PREFIX_MARGIN = 64  # tokens: a prefix's count may differ from the whole text's near the cut


def tokens_at_least(docs: list[str], tokenizer: Any, need: int) -> int:
    """The token count of the joined documents when it is below `need`, else some count of at
    least `need`: a growing prefix of the text is tokenized and the count stops there, so a
    preflight check on a large file costs milliseconds instead of tokenizing all of it."""
    text = "\n\n".join(docs)
    chars = 8 * (need + PREFIX_MARGIN)
    while chars < len(text):
        count = len(tokenizer(text[:chars], add_special_tokens=False).input_ids)
        if count >= need + PREFIX_MARGIN:
            return count
        chars *= 4
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def _too_short(field: str, length: int, have: int) -> UserError:
    return UserError(f"{field}: {length} tokens per sample requested but the data has only {have} tokens")
