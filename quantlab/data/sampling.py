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


def _too_short(field: str, length: int, have: int) -> UserError:
    return UserError(f"{field}: {length} tokens per sample requested but the data has only {have} tokens")
