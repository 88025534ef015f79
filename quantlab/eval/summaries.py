"""Summarization prompts and batched greedy generation for the ROUGE evaluation.

A prompt is the document cut to `max_input_tokens` tokens inside a template: the user turn of
the model's chat template for instruct models, `{document}\\nTL;DR:` for base models. Only the
document is cut; the instruction around it is kept whole, so a long article never loses the
question. Generation is a function `prompts → continuations` (token lists), so the same batching
drives the bundled runner and a transformers model (`hf_generator`, for architectures the runner
does not take and to check the runner against transformers' own `generate`).

Batches are cut from the prompts sorted by length, so left padding wastes little of the prefill;
the outputs come back in the prompts' order.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

CHAT_TEMPLATE = "Summarize this article in a few sentences.\n\n{document}"
PLAIN_TEMPLATE = "{document}\nTL;DR:"

Generator = Callable[[list[list[int]]], list[list[int]]]


@dataclass(frozen=True)
class Prompt:
    index: int  # position in the dataset
    text: str
    ids: list[int]
    reference: str


def pick(count: int, total: int, seed: int | None) -> list[int]:
    """The first `count` records, or a seeded random subset of them in dataset order."""
    if seed is None:
        return list(range(min(count, total)))
    return sorted(random.Random(seed).sample(range(total), min(count, total)))


def prompt_style(requested: str, tokenizer: Any) -> str:
    """`chat` or `plain`: auto is chat when the tokenizer carries a chat template."""
    if requested == "auto":
        return "chat" if getattr(tokenizer, "chat_template", None) else "plain"
    return requested


def build_prompt(document: str, tokenizer: Any, style: str, template: str | None, max_input_tokens: int) -> str:
    ids = tokenizer(document, add_special_tokens=False).input_ids
    if len(ids) > max_input_tokens:
        document = tokenizer.decode(ids[:max_input_tokens])
    if style == "chat":
        content = (template or CHAT_TEMPLATE).replace("{document}", document)
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
    return (template or PLAIN_TEMPLATE).replace("{document}", document)


def build_prompts(pairs: Sequence[tuple[str, str]], indices: Sequence[int], tokenizer: Any, style: str,
                  template: str | None, max_input_tokens: int) -> list[Prompt]:
    prompts = []
    for i in indices:
        document, reference = pairs[i]
        text = build_prompt(document, tokenizer, style, template, max_input_tokens)
        # a chat template already holds the BOS it wants; plain text gets the tokenizer's own
        ids = tokenizer(text, add_special_tokens=style != "chat").input_ids
        prompts.append(Prompt(i, text, ids, reference))
    return prompts


def stop_ids(tokenizer: Any, style: str) -> list[int]:
    """Tokens that end a summary: EOS, and the end-of-turn token of a chat template (`<|im_end|>`,
    `<|eot_id|>`, `<end_of_turn>`) when the chat template is used."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    if style == "chat":
        for token in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"):
            tid = tokenizer.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != tokenizer.unk_token_id:
                ids.add(tid)
    return sorted(ids)


@dataclass
class Generated:
    tokens: list[list[int]]  # continuation per prompt, stop token removed
    seconds: float
    batches: int

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def generate_all(generator: Generator, prompts: Sequence[Prompt], batch_size: int, stop: Sequence[int],
                 on_batch: Callable[[int, int], None] | None = None) -> Generated:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].ids))
    out: list[list[int]] = [[] for _ in prompts]
    batches = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    start = time.perf_counter()
    for n, batch in enumerate(batches):
        for i, tokens in zip(batch, generator([prompts[i].ids for i in batch])):
            out[i] = cut_at_stop(tokens, stop)
        if on_batch:
            on_batch(n + 1, len(batches))
    return Generated(out, time.perf_counter() - start, len(batches))


def cut_at_stop(tokens: Sequence[int], stop: Sequence[int]) -> list[int]:
    for j, t in enumerate(tokens):
        if t in stop:
            return list(tokens[:j])
    return list(tokens)


def hf_generator(model: torch.nn.Module, max_new_tokens: int, stop: Sequence[int], pad_id: int) -> Generator:
    """Greedy transformers `generate` on left-padded batches (the reference the runner is checked against)."""

    @torch.no_grad()
    def run(batch: list[list[int]]) -> list[list[int]]:
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(batch):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        device = next(model.parameters()).device
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=list(stop), pad_token_id=pad_id,
                             temperature=None, top_p=None, top_k=None)
        return [row[width:].tolist() for row in out.cpu()]

    return run


def jsonl(meta: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    """A summaries file: one `{"meta": …}` line (model, generator, settings, mean scores), then one
    line per sample (prompt, reference, summary, scores)."""
    lines = [json.dumps({"meta": meta}, ensure_ascii=False)] + [json.dumps(r, ensure_ascii=False) for r in rows]
    return "\n".join(lines) + "\n"


def read_jsonl(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The meta line and the per-sample rows of a summaries file."""
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return lines[0]["meta"], lines[1:]
