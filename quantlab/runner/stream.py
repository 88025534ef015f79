"""`quantlab generate`: load a runner and its tokenizer, stream the continuation to stdout.

Text is printed as soon as it decodes cleanly: the decoded continuation is re-decoded after
each token and only its new, complete suffix is written (a byte-level BPE token can end in
the middle of a UTF-8 character, which decodes to U+FFFD until the next token completes it).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, TextIO, get_args

import torch

from quantlab.errors import UserError


class TextStream:
    def __init__(self, tokenizer: Any, out: TextIO):
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, tokens: torch.Tensor) -> None:
        self.ids.append(int(tokens[0]))
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)


def check_args(prompt: str, max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    if not prompt:
        raise UserError("--prompt: empty; give the text to continue")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens: got {max_new_tokens}; must be at least 1")
    if temperature < 0:
        raise UserError(f"--temperature: got {temperature}; must be >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise UserError(f"--top-k: got {top_k}; must be at least 1")


def run_generate(path: Path, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int | None = None, seed: int = 0, device: str = "auto", chat: bool = False,
                 out: TextIO | None = None, decode: str = "auto", attention: str = "triton",
                 fused_decode: bool | None = None) -> None:
    """Stream a greedy or sampled continuation of `prompt` from the run's model. By default
    the decode steps take the fastest path the model and device allow: the attention kernel
    and, for a W4A16/W8A16 model at batch 1 on a GPU, the fused step (`fused_decode=None`;
    True says so when it cannot apply, False keeps the unfused step)."""
    from transformers import AutoTokenizer

    from quantlab.context import pick_device
    from quantlab.runner.generate import DecodeMode, generate
    from quantlab.runner.load import load_runner, model_dir
    from quantlab.runner.model import ATTENTION

    check_args(prompt, max_new_tokens, temperature, top_k)
    if device not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device: got {device!r}; one of auto, cpu, cuda")
    dev = pick_device(device)
    if decode not in get_args(DecodeMode):
        raise UserError(f"--decode: got {decode!r}; one of {', '.join(get_args(DecodeMode))}")
    if decode == "graphs" and dev.type != "cuda":
        raise UserError(f"--decode graphs needs a CUDA device; the model runs on {dev.type}")
    if attention not in ATTENTION:
        raise UserError(f"--attention: got {attention!r}; one of {', '.join(ATTENTION)}")
    source = model_dir(Path(path))
    tokenizer = AutoTokenizer.from_pretrained(source)
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"--chat: the tokenizer in {source} has no chat template")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt).input_ids
    if not ids:
        raise UserError("--prompt: tokenizes to no tokens")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = load_runner(source, dev, dtype)
    model.set_attention(attention)
    if fused_decode is not False:
        fused = model.set_fused_decode(True)
        if fused_decode and not fused:
            print("[--fused-decode: this model or device does not take it; decoding unfused]", file=sys.stderr)
    stream = TextStream(tokenizer, out or sys.stdout)
    start = time.perf_counter()
    result = generate(model, [ids], max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                      eos_token_id=tokenizer.eos_token_id, on_token=stream, decode=decode)
    stream.out.write("\n")
    seconds = time.perf_counter() - start
    print(f"[{result.lengths[0]} tokens in {seconds:.2f} s; prefill {result.prefill_tokens_per_s:.1f} tok/s, "
          f"decode {result.decode_tokens_per_s:.1f} tok/s on {dev.type}]", file=sys.stderr)
