"""Does programmatic dependent launch (PDL) close the gap between the W4A16 GEMV and its read
floor in a decode step?

A decode step at batch 1 is a chain of GEMVs, each reading a weight no earlier kernel touched.
A single call pays a fixed cost (launch, the DRAM pipeline filling, the tail of the last wave:
about 8 µs on an H200 by a scratch fit) that the bytes alone do not explain. With PDL (Hopper)
a kernel may launch while the previous one finishes and load its weights before waiting for
the previous kernel's output, so that cost can overlap.

This script times chains of `--layers` Qwen2-7B-shaped layers' GEMMs (qkv 3584→4608, o
3584→3584, gate_up 3584→37888, down 18944→3584; each output feeding the next GEMM's input, the
attention left out) captured in one CUDA graph, distinct weights everywhere (the chain reads
more than L2 holds, as decode does): bf16 cuBLAS, the W4A16 GEMV with PDL off / trigger after
the loop / trigger at start, and the read floor (`read_floor.py`) with PDL off / on. Each
W4A16 GEMV runs one explicit whole-wave config (no autotuning, the same in every variant), so
PDL's effect is measured alone; the chain outputs with and without PDL must be bit-identical.

    python benchmarks/pdl_chain.py --layers 4 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

HIDDEN, INTER, QKV = 3584, 18944, 4608  # Qwen2-7B: 28 + 2·4 heads of 128
LAYER = (("qkv", HIDDEN, QKV), ("o", HIDDEN, HIDDEN), ("gate_up", HIDDEN, 2 * INTER),
         ("down", INTER, HIDDEN))  # (name, K, N)
GROUP = 128
PROGRAMS = 1024  # about two waves of GEMV programs on 132 SMs


def gemv_config(k: int, n: int, pdl: int) -> dict:
    """One whole-wave GEMV config (DENORM, prefetch) for a shape, as the autotuner tends to pick."""
    warps = 2 if n >= 16384 else 1
    tiles = -(-n // (128 * warps))
    split = max(1, min(64, k // 64 // 2, round(PROGRAMS / tiles)))
    cfg = dict(BLOCK_N=128 * warps, SPLIT_K=split, PF=True, DENORM=True, num_warps=warps,
               num_stages=1)
    if pdl:
        cfg.update(PDL=pdl, launch_pdl=True)
    return cfg


class Weights:
    """One weight per GEMM of the chain, as bf16 and as packed int4 (group 128, asymmetric)."""

    def __init__(self, qk, layers: int, seed: int = 0):
        from quantlab.quant.primitives import quantize_weight
        from quantlab.quant.scheme import WeightScheme

        g = torch.Generator(device="cuda").manual_seed(seed)
        self.gemms = []  # (name, K, N, bf16 [N, K], packed)
        for _ in range(layers):
            for name, k, n in LAYER:
                w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
                q = quantize_weight(w.float(), WeightScheme(bits=4, symmetric=False, group_size=GROUP))
                self.gemms.append((name, k, n, w, qk.pack_wna16(q, torch.bfloat16)))


def chain(weights: Weights, gemm: Callable, x0: torch.Tensor) -> Callable[[], torch.Tensor]:
    """x0 → each GEMM in turn; an output wider than the next input feeds its first K columns."""
    outs = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _, _, n, _, _ in weights.gemms]

    def run() -> torch.Tensor:
        x = x0
        for i, (_, k, n, w, p) in enumerate(weights.gemms):
            gemm(x[:, :k], w, p, outs[i])
            x = outs[i]
        return x

    return run


def time_graph(fn: Callable[[], torch.Tensor], reps: int = 50) -> tuple[float, torch.Tensor]:
    """Median µs of one CUDA-graph replay of fn, and its output."""
    from quantlab.kernels.ops import capture_graph

    graph, out = capture_graph(fn, warmups=2)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2], out.clone()


def variants(qk) -> dict[str, Callable]:
    import triton
    from read_floor import _read_kernel

    from quantlab.kernels.triton_wna16 import wna16_matmul

    def bf16(x, w, p, out):
        torch.mm(x, w.t(), out=out)

    def w4a16(pdl: int):
        def gemm(x, w, p, out):
            wna16_matmul(x, p, impl="gemv", config=gemv_config(p.in_features, p.out_features, pdl),
                         out=out)
        return gemm

    def floor(pdl: bool):
        def gemm(x, w, p, out):
            cfg = gemv_config(p.in_features, p.out_features, 0)
            n, nblk = p.out_features, p.qweight.shape[0] // 8
            grid = (triton.cdiv(n, cfg["BLOCK_N"]), cfg["SPLIT_K"])
            extra = dict(PDL=True, launch_pdl=True) if pdl else {}
            _read_kernel[grid](p.qweight, p.scales, p.zeros, out, 1, n, nblk, p.scales.shape[0],
                               0x5EED1234, cfg["SPLIT_K"], GROUP_BLOCKS=GROUP // 64, HAS_GROUPS=True,
                               BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"], **extra)
        return gemm

    return {"bf16": bf16, "w4a16": w4a16(0), "w4a16_pdl_after_loop": w4a16(1),
            "w4a16_pdl_at_start": w4a16(2), "w4a16_pdl_after_wait": w4a16(3),
            "read_floor": floor(False), "read_floor_pdl": floor(True)}


def gemv_errors(qk, weights: Weights) -> dict[str, float]:
    """Per layer shape, ‖GEMV − x·Wᵀ‖ / ‖x·Wᵀ‖ against the dequantized weight in float32, with
    PDL off and at start (eager launches)."""
    from quantlab.kernels.triton_wna16 import wna16_matmul

    errs = {}
    for name, k, n, _, p in weights.gemms[:len(LAYER)]:
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ qk.dequantize_wna16(p).float().t()
        for pdl in (0, 2):
            y = wna16_matmul(x, p, impl="gemv", config=gemv_config(k, n, pdl))
            errs[f"{name}_pdl{pdl}"] = float(((y.float() - ref).norm() / ref.norm()).item())
    return errs


def run(args) -> dict:
    from gemm import _import_kernels

    qk = _import_kernels()
    weights = Weights(qk, args.layers)
    n_gemms = len(weights.gemms)
    x0 = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16,
                     generator=torch.Generator(device="cuda").manual_seed(1))
    rows, outputs = [], {}
    for name, gemm in variants(qk).items():
        try:
            us, out = time_graph(chain(weights, gemm, x0), args.reps)
        except Exception as e:  # noqa: BLE001 — a variant that fails is reported, not fatal
            rows.append({"variant": name, "error": repr(e)[:300]})
            print(f"{name}: error {e!r}"[:300], flush=True)
            continue
        outputs[name] = out
        rows.append({"variant": name, "chain_us": round(us, 2), "per_layer_us": round(us / args.layers, 2),
                     "per_gemm_us": round(us / n_gemms, 2)})
        print(f"{name}: {us:.1f} µs per chain", flush=True)
    checks = gemv_errors(qk, weights)
    base = next((r["chain_us"] for r in rows if r["variant"] == "bf16" and "chain_us" in r), None)
    for r in rows:
        if base and "chain_us" in r:
            r["x_bf16"] = round(base / r["chain_us"], 3)
    ref = outputs.get("w4a16")
    for r in rows:
        if ref is not None and r["variant"].startswith("w4a16_pdl") and r["variant"] in outputs:
            r["identical_to_w4a16"] = bool(torch.equal(outputs[r["variant"]], ref))
    bytes_layer = {"bf16": sum(k * n * 2 for _, k, n in LAYER),
                   "w4a16": sum(k * n // 2 + 2 * 2 * (k // GROUP) * n for _, k, n in LAYER)}
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "python": platform.python_version(),
            "layers": args.layers, "gemms_per_layer": len(LAYER), "bytes_per_layer": bytes_layer,
            "command": " ".join(sys.argv), "rows": rows, "gemv_rel_err": checks}


def markdown(res: dict) -> str:
    lines = [f"# PDL chain — {res['device']}", "",
             f"{res['layers']} Qwen2-7B-shaped layers' GEMMs (qkv, o, gate_up, down) back to back in one "
             f"CUDA graph, batch 1; median µs of a replay. torch {res['torch']}, triton {res['triton']}. "
             f"Command: `{res['command']}`", "",
             "GEMV vs the dequantized weight (rel err): "
             + ", ".join(f"{k} {v:.1e}" for k, v in res["gemv_rel_err"].items()), "",
             "| variant | µs per chain | µs per layer | × bf16 | bit-identical to w4a16 |",
             "|---|---:|---:|---:|---|"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | error: {r['error'][:120]} | | | |")
            continue
        same = r.get("identical_to_w4a16", "")
        lines.append(f"| {r['variant']} | {r['chain_us']} | {r['per_layer_us']} | {r.get('x_bf16', '')} | {same} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None, help="folder for pdl_chain_<device>.{json,md}")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("pdl_chain.py needs a CUDA GPU")
    res = run(args)
    md = markdown(res)
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        tag = res["device"].lower().replace(" ", "_")
        (args.out / f"pdl_chain_{tag}.json").write_text(json.dumps(res, indent=1))
        (args.out / f"pdl_chain_{tag}.md").write_text(md)


if __name__ == "__main__":
    main()
