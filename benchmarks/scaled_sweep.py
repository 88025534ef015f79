"""Config sweep for the int8 / FP8 scaled GEMM at prefill sizes (run on the device machine).

Times every candidate config of quantlab.kernels.triton_scaled and, with `--impls
triton,gluon`, of quantlab.kernels.gluon_scaled (no autotuning) on the given
shapes next to `torch._scaled_mm` / `torch._int_mm` (CUDA-graph replays, L2 flushed, as
benchmarks/gemm.py times them; `--rounds N`: N interleaved rounds, the median kept), checks
each against the torch reference and prints the best per case; `--out DIR` writes
`scaled_sweep.json`. Used to pick LARGE_M_CONFIGS:

    python benchmarks/scaled_sweep.py --kinds fp8 --ms 4096 --out DIR
    python benchmarks/scaled_sweep.py --kinds fp8 --shapes qwen_down --tiles 128x256x128x8x3 --groups 8,16 --rounds 5

(the second: one program per tile, persistent, and persistent with the last wave split, side
by side).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm import SHAPES, _import_kernels, bench, graphed  # noqa: E402

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
TILES = [(64, 64, 256, 4, 3), (64, 128, 256, 4, 3), (128, 64, 128, 8, 4),
         (128, 256, 128, 8, 3), (128, 256, 128, 8, 4), (256, 128, 128, 8, 3), (256, 128, 128, 8, 4),
         (128, 128, 128, 8, 4), (128, 128, 128, 4, 4), (128, 128, 128, 8, 5), (128, 128, 256, 8, 3),
         (128, 64, 128, 4, 4), (64, 128, 128, 4, 4), (128, 64, 256, 4, 3), (64, 64, 256, 4, 4)]
GROUPS = (4, 8, 16)


# How the programs walk the tiles and store them: (PERSISTENT, SPLIT_TAIL, TMA_STORE), see
# triton_scaled._scaled_mm_kernel (a TMA store that does not fit shared memory fails its check).
WALKS = ((False, False, False), (True, False, False), (True, True, False), (True, False, True))


def candidates(tiles=TILES, groups=GROUPS, walks=WALKS) -> list[dict]:
    return [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st, GROUP_M=g, PERSISTENT=p,
                 SPLIT_TAIL=t, TMA_STORE=s)
            for (bm, bn, bk, w, st), g, (p, t, s) in itertools.product(tiles, groups, walks)]


def gluon_candidates(tiles: list[tuple[int, ...]] | None = None, groups=GROUPS) -> list[dict]:
    """gluon_scaled's fitting configs (or `tiles`, whose warps are ignored: 4 per 64 rows),
    each in L2 groups of `groups` row tiles."""
    from dataclasses import asdict

    from quantlab.kernels import gluon_scaled
    configs = (gluon_scaled.fitting(torch.bfloat16) if tiles is None
               else [gluon_scaled.Config(bm, bn, bk, st) for bm, bn, bk, _, st in tiles])
    return [dict(asdict(c), group_m=g, impl="gluon") for c in configs for g in groups]


def parse_tiles(text: str) -> list[tuple[int, ...]]:
    """`128x256x128x8x3,...` (BLOCK_M x BLOCK_N x BLOCK_K x warps x stages); empty: TILES."""
    return [tuple(int(v) for v in t.split("x")) for t in text.split(",")] if text else TILES


def problem(kind: str, m: int, k: int, n: int):
    """One prefill GEMM on random data: (the kernel's matmul, quantized activations, their
    scales, the packed weight, the torch reference, torch's own kernel as a graph replay)."""
    from quantlab.kernels import layout, reference
    from quantlab.kernels.triton_scaled import fp8_matmul, w8a8_matmul
    from quantlab.quant.activations import quantize_int8_weight

    x = torch.randn(m, k, device="cuda")
    w = torch.randn(n, k, device="cuda")
    if kind == "fp8":
        p = layout.quantize_fp8_weight(w, True)
        xq, sx = reference.quantize_act_fp8(x, True)
        ref = reference.fp8_mm(xq, sx, p, torch.bfloat16)
        baseline = graphed(lambda: torch._scaled_mm(xq, p.w.t(), scale_a=sx.reshape(-1, 1),
                                                    scale_b=p.scale.reshape(1, -1), out_dtype=torch.bfloat16))
        return fp8_matmul, xq, sx, p, ref, baseline
    qw, scale = quantize_int8_weight(w)
    p = layout.PackedW8A8(qw, scale.reshape(-1), None)
    xq, sx = reference.quantize_act_int8(x)
    ref = reference.w8a8_mm(xq, sx, p, torch.bfloat16)
    return w8a8_matmul, xq, sx, p, ref, graphed(lambda: torch._int_mm(xq, qw.t()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default="4096")
    ap.add_argument("--kinds", default="fp8,int8")
    ap.add_argument("--top", type=int, default=4)
    ap.add_argument("--out", default="")
    ap.add_argument("--tiles", default="", help="tiles to sweep (default: TILES), see parse_tiles")
    ap.add_argument("--impls", default="triton", help="triton, gluon or both (comma-separated)")
    ap.add_argument("--gluon-tiles", default="", help="gluon tiles as --tiles (default: gluon_scaled.fitting)")
    ap.add_argument("--groups", default=",".join(map(str, GROUPS)), help="GROUP_M values")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved timing rounds (median kept)")
    args = ap.parse_args()
    _import_kernels()
    from quantlab.kernels.ops import interleaved_rounds

    print(f"# {torch.cuda.get_device_name()}", flush=True)
    groups = [int(g) for g in args.groups.split(",")]
    configs = candidates(parse_tiles(args.tiles), groups) if "triton" in args.impls else []
    if "gluon" in args.impls:
        configs += gluon_candidates(parse_tiles(args.gluon_tiles) if args.gluon_tiles else None, groups)
    results = []
    for name, m, kind in itertools.product(args.shapes.split(","), [int(v) for v in args.ms.split(",")],
                                           args.kinds.split(",")):
        k, n = SHAPES[name]
        mm, xq, sx, p, ref, baseline = problem(kind, m, k, n)
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")  # one output: the graphs stay small
        run = lambda cfg: mm(xq, sx, p, torch.bfloat16, config={k: v for k, v in cfg.items() if k != "impl"},  # noqa: E731
                             out=out, impl=cfg.get("impl", "triton"))
        checked = []
        for cfg in configs:
            try:
                err = float((run(cfg).float() - ref.float()).norm() / ref.float().norm())
                checked.append((cfg, err, graphed(lambda cfg=cfg: run(cfg))))
            except Exception as e:  # noqa: BLE001 — a config that does not fit is reported
                print(f"  {cfg}: {repr(e)[:120]}", flush=True)
        # the baseline and every config timed once per round, rounds interleaved (gemm.py's
        # protocol: the clocks of a loaded GPU drift within a run)
        timers = [lambda g=g: bench(g) for g in [baseline] + [g for _, _, g in checked]]
        times = interleaved_rounds(timers, args.rounds, rotate=True)
        base = statistics.median(times[0])
        rows = [dict(shape=name, M=m, kind=kind, ms=statistics.median(ts), ms_rounds=ts, rel_err=err, **cfg)
                for (cfg, err, _), ts in zip(checked, times[1:])]
        rows.sort(key=lambda r: r["ms"])
        print(f"\n{name} M={m} {kind}: baseline {base * 1e3:.1f}us", flush=True)
        for r in rows[: args.top]:
            cfg = " ".join(f"{k}={v}" for k, v in r.items()
                           if k not in ("shape", "M", "kind", "ms", "ms_rounds", "rel_err"))
            print(f"  {r['ms'] * 1e3:7.1f}us  {base / r['ms']:.3f}x baseline  rel {r['rel_err']:.1e}  {cfg}", flush=True)
        results += rows + [dict(shape=name, M=m, kind=kind, baseline_ms=base)]
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "scaled_sweep.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
