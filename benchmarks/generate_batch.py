"""Batched generation for evaluation: articles per second of the ROUGE stage's generator at
batch 1 and batch 16, on a Qwen2-7B-shaped model with random weights (run on the device machine).

The generator is the one `evaluate.rouge` uses (`quantlab.eval.summaries.generate_all` over
`quantlab.runner.generate.continuations`: prompts sorted by length, left-padded batches, greedy,
KV cache sized once for the longest prompt). Random weights are fine for speed: every article
runs the full `--new-tokens` (no EOS is ever drawn), over prompts of CNN/DailyMail length
(uniform in 450–650 tokens, seeded). Each batch size gets one warm-up pass (compilation, graph
capture) on the same prompts before the timed one.

    python benchmarks/generate_batch.py                 # the GPU run: W4A16 and bf16, 32 articles
    python benchmarks/generate_batch.py --tiny          # CPU smoke test, seconds

Writes `benchmarks/results/generate_batch_<device>.json` and `.md` (`_tiny` suffix with --tiny).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode  # noqa: E402  (benchmarks/: the Qwen2-7B shape and the random quantized runner)

from quantlab.eval.summaries import Prompt, generate_all  # noqa: E402
from quantlab.runner.generate import continuations  # noqa: E402
from quantlab.runner.load import from_hf_model  # noqa: E402

BAR = 4.0  # batch 16 over batch 1, articles/s


def prompts_of(count: int, vocab: int, low: int, high: int, seed: int = 0) -> list[Prompt]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    return [Prompt(i, "", torch.randint(3, vocab, (n,), generator=gen).tolist(), "") for i, n in enumerate(lengths)]


def measure(model, prompts: list[Prompt], batch: int, new_tokens: int) -> dict[str, Any]:
    longest = max(len(p.ids) for p in prompts) + new_tokens

    def generator(b: list[list[int]]) -> list[list[int]]:
        return continuations(model, b, new_tokens, stop=[], max_seq_len=longest)

    generate_all(generator, prompts[:batch], batch, stop=[])  # warm-up: compile, capture
    decode.sync(model.device)
    start = time.perf_counter()
    done = generate_all(generator, prompts, batch, stop=[])
    decode.sync(model.device)
    seconds = time.perf_counter() - start
    return {"batch": batch, "articles": len(prompts), "seconds": round(seconds, 3),
            "articles_per_s": round(len(prompts) / seconds, 4), "new_tokens": done.new_tokens,
            "tokens_per_s": round(done.new_tokens / seconds, 1)}


def build(scheme: str, config, device: torch.device, dtype: torch.dtype):
    if scheme == "bf16":
        return from_hf_model(decode.hf_model(config, device, dtype), device, dtype)
    model = decode.quantized_runner(config, scheme, device, dtype)
    model.set_attention("triton")
    return model


def markdown(res: dict[str, Any]) -> str:
    lines = [f"# Batched generation for evaluation — {res['device']}", "",
             f"{res['shape']}; {res['articles']} articles of {res['prompt_tokens'][0]}–{res['prompt_tokens'][1]} "
             f"prompt tokens, {res['new_tokens']} new tokens each (greedy, no EOS), the ROUGE stage's generator. "
             f"{res['versions']}.", "",
             "| scheme | batch | seconds | articles/s | new tokens/s | × batch 1 |", "|---|---:|---:|---:|---:|---:|"]
    for scheme, rows in res["schemes"].items():
        base = rows[0]["articles_per_s"]
        for r in rows:
            lines.append(f"| {scheme} | {r['batch']} | {r['seconds']} | {r['articles_per_s']} | {r['tokens_per_s']} | "
                         f"{r['articles_per_s'] / base:.2f}× |")
    lines += ["", "## Bars", ""]
    for scheme, ratio in res["ratios"].items():
        lines.append(f"- {'met' if ratio >= BAR else 'NOT met'}: {scheme} batch {res['batches'][-1]} vs batch "
                     f"{res['batches'][0]}: {ratio:.2f}× articles/s (bar {BAR}×)")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--articles", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=100)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--schemes", nargs="+", default=["w4a16", "bf16"])
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = decode.qwen2_config(argparse.Namespace(tiny=args.tiny, layers=args.layers))
    low, high = (450, 650) if not args.tiny else (20, 40)
    prompts = prompts_of(args.articles, config.vocab_size, low, high)
    res: dict[str, Any] = {"device": decode.device_name(device), "articles": args.articles, "new_tokens": args.new_tokens,
                           "prompt_tokens": [low, high], "batches": args.batches, "schemes": {}, "ratios": {},
                           "shape": f"Qwen2-7B-shaped ({config.num_hidden_layers} layers, hidden {config.hidden_size})"
                           if not args.tiny else "tiny Qwen2 shape",
                           "versions": ", ".join(f"{k} {v}" for k, v in decode.versions().items())}
    for scheme in args.schemes:
        model = build(scheme, config, device, dtype)
        rows = [measure(model, prompts, b, args.new_tokens) for b in args.batches]
        res["schemes"][scheme] = rows
        res["ratios"][scheme] = round(rows[-1]["articles_per_s"] / rows[0]["articles_per_s"], 3)
        print(json.dumps({scheme: rows}), flush=True)
        del model
        decode.free(device)
    name = "generate_batch_" + ("tiny" if args.tiny else res["device"].lower().replace(" ", "_"))
    out = args.out or Path(__file__).resolve().parent / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
