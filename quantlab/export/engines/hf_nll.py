"""Score token windows with a Hugging Face checkpoint loaded the way users load it. Runs in
the loader's environment (gptqmodel's for AWQ/GPTQ, ours for compressed-tensors): it imports
torch and transformers (and gptqmodel), never quantlab.

    python hf_nll.py CHECKPOINT WINDOWS.npy OUT.json --loader transformers|gptqmodel --dtype float16
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from importlib.metadata import version

import numpy as np
import torch
import torch.nn.functional as F


def load(path: str, loader: str, dtype: torch.dtype, backend: str) -> torch.nn.Module:
    if loader == "gptqmodel":
        from gptqmodel import BACKEND, GPTQModel

        return GPTQModel.load(path, device="cpu", dtype=dtype, backend=BACKEND[backend]).model
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map="cpu")


def first_linear_class(model: torch.nn.Module) -> str:
    """The class serving the first q_proj: proves the quantized layout was loaded as such."""
    return next(type(m).__name__ for n, m in model.named_modules() if n.endswith("q_proj"))


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("windows")
    p.add_argument("out")
    p.add_argument("--loader", choices=["transformers", "gptqmodel"], default="transformers")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    p.add_argument("--backend", default="AUTO", help="gptqmodel BACKEND member (e.g. GPTQ_TORCH)")
    p.add_argument("--logits", default=None, help="also save every window's logits here (.npy, float32)")
    args = p.parse_args()
    torch.manual_seed(0)
    windows = torch.from_numpy(np.load(args.windows)).long()
    start = time.perf_counter()
    model = load(args.checkpoint, args.loader, getattr(torch, args.dtype), args.backend).eval()
    loaded = time.perf_counter()
    total, kept = 0.0, []
    for row in windows:
        logits = model(row.unsqueeze(0), use_cache=False).logits[0].float()
        total += F.cross_entropy(logits[:-1], row[1:], reduction="sum").item()
        if args.logits:
            kept.append(logits.numpy())
    if args.logits:
        np.save(args.logits, np.stack(kept))
    tokens = windows.shape[0] * (windows.shape[1] - 1)
    packages = {n: version(n) for n in ("torch", "transformers", "gptqmodel", "compressed-tensors")
                if _installed(n)}
    result = {"engine": args.loader, "versions": packages, "dtype": args.dtype, "nll_sum": total, "tokens": tokens,
              "perplexity": math.exp(total / tokens), "windows": int(windows.shape[0]),
              "seq_len": int(windows.shape[1]), "linear_class": first_linear_class(model),
              "load_seconds": round(loaded - start, 2), "score_seconds": round(time.perf_counter() - loaded, 2)}
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps(result), file=sys.stderr)
    return 0


def _installed(name: str) -> bool:
    try:
        version(name)
        return True
    except Exception:
        return False


if __name__ == "__main__":
    sys.exit(main())
