"""Score token windows with llama.cpp (llama-cpp-python), or quantize a GGUF with llama.cpp's
own quantizer. Runs in the llama-cpp tool environment: no quantlab, no torch.

    python gguf_nll.py score MODEL.gguf WINDOWS.npy OUT.json [--threads N] [--logits LOGITS.npy]
    python gguf_nll.py quantize IN.gguf OUT.gguf q4_0
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import sys
import time
from importlib.metadata import version

import numpy as np


def nll_of(logits: np.ndarray, ids: np.ndarray) -> float:
    """Summed NLL of ids[1:] given logits[:-1] (float64 log-softmax)."""
    x = logits[:-1].astype(np.float64)
    peak = x.max(axis=1, keepdims=True)
    lse = np.log(np.exp(x - peak).sum(axis=1)) + peak[:, 0]
    return float((lse - x[np.arange(len(x)), ids[1:]]).sum())


def score(args: argparse.Namespace) -> dict:
    from llama_cpp import Llama

    windows = np.load(args.windows)
    seq = windows.shape[1]
    start = time.perf_counter()
    llm = Llama(model_path=args.model, n_ctx=seq, n_batch=seq, n_ubatch=seq, logits_all=True,
                n_threads=args.threads, verbose=False)
    loaded = time.perf_counter()
    total, logits = 0.0, []
    for row in windows:
        llm.reset()
        llm.eval(row.tolist())
        scores = np.asarray(llm.scores[:seq])
        total += nll_of(scores, row)
        if args.logits:  # kept only when asked: 8 windows of SmolLM2 are ~800 MB
            logits.append(scores.astype(np.float32, copy=True))
    if args.logits:  # [windows, seq, vocab]
        np.save(args.logits, np.stack(logits))
    tokens = windows.shape[0] * (seq - 1)
    return {"engine": "llama.cpp", "llama_cpp_python": version("llama-cpp-python"), "nll_sum": total,
            "tokens": tokens, "perplexity": math.exp(total / tokens), "windows": int(windows.shape[0]),
            "seq_len": int(seq), "load_seconds": round(loaded - start, 2),
            "score_seconds": round(time.perf_counter() - loaded, 2)}


def quantize(args: argparse.Namespace) -> dict:
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{args.type.upper()}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = os.cpu_count() or 1
    status = llama_cpp.llama_model_quantize(args.src.encode(), args.dst.encode(), ctypes.byref(params))
    if status != 0:
        raise SystemExit(f"llama_model_quantize returned {status}")
    return {"engine": "llama.cpp quantize", "type": args.type, "bytes": os.path.getsize(args.dst)}


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("score")
    s.add_argument("model")
    s.add_argument("windows")
    s.add_argument("out")
    s.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1),
                   help="llama.cpp threads (default: $OMP_NUM_THREADS, else every core)")
    s.add_argument("--logits", help="also save every window's logits here (.npy)")
    q = sub.add_parser("quantize")
    q.add_argument("src")
    q.add_argument("dst")
    q.add_argument("type")
    q.add_argument("--out")
    args = p.parse_args()
    result = score(args) if args.command == "score" else quantize(args)
    out = args.out
    if out:
        with open(out, "w") as fh:
            json.dump(result, fh, indent=2)
    print(json.dumps(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
