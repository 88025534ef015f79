"""Probe: how well the large-M autotuner's own timings rank the int8 / FP8 configs, against the
same configs timed again in interleaved rounds on a busy GPU (run on the device machine).

At M = 4096 on an H200 (session 26) the autotuned FP8 call tied `torch._scaled_mm` on
qwen_down, llama_up and llama_down, while `scaled_sweep.py` found configs 6–12% faster than it
on all three. The autotuner times each config once, in turn, on a GPU that has been idle; the
benchmark and real prefill run it hot. This prints, per shape, every config's autotuner time
and rank next to its median over `--rounds` interleaved rounds, and what each way of choosing
(the autotuner's pick, `retime_top` over its k fastest, over those within x% of its fastest)
would have kept, at what hot time against the hot best and torch's own kernel.

    python benchmarks/autotune_rank.py --shapes qwen_down,llama_up,llama_down --kinds fp8 --out DIR

Writes `autotune_rank.json` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm import SHAPES, _import_kernels, bench, graphed  # noqa: E402
from scaled_sweep import problem  # noqa: E402

RULES = [("top", 3), ("top", 6), ("top", 10), ("within", 0.05), ("within", 0.10)]


def candidates(cool: dict, rule: tuple[str, float]) -> list:
    """The configs a re-timing rule would look at, from the autotuner's timings `cool`
    (`ops.autotuner_ranking`: fastest first)."""
    ranked = list(cool)
    how, v = rule
    if how == "top":
        return ranked[: int(v)]
    return [c for c in ranked if cool[c] <= cool[ranked[0]] * (1 + v)]


def label(c) -> str:
    kw = c.kwargs
    walk = "persistent" if kw.get("PERSISTENT") else "tile"
    extra = "".join([" tail" if kw.get("SPLIT_TAIL") else "", " tma" if kw.get("TMA_STORE") else ""])
    return (f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} w{c.num_warps} s{c.num_stages} "
            f"g{kw['GROUP_M']} {walk}{extra}")


def rank_shape(kind: str, name: str, m: int, rounds: int) -> dict:
    from quantlab.kernels import triton_scaled
    from quantlab.kernels.ops import autotuner_ranking, interleaved_rounds

    k, n = SHAPES[name]
    mm, xq, sx, p, ref, baseline = problem(kind, m, k, n)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    tuner = triton_scaled._LARGE
    mm(xq, sx, p, torch.bfloat16, out=out, impl="triton")  # autotunes, then retime_top
    kept = tuner.cache[next(reversed(tuner.cache))]
    cool = autotuner_ranking(tuner)
    configs = list(cool)
    runs = [graphed(lambda c=c: mm(xq, sx, p, torch.bfloat16, config=triton_scaled._config_dict(c), out=out,
                                   impl="triton")) for c in configs]
    times = interleaved_rounds([lambda g=g: bench(g) for g in [baseline, *runs]], rounds, rotate=True)
    base = statistics.median(times[0]) * 1e3
    hot = {c: statistics.median(ts) * 1e3 for c, ts in zip(configs, times[1:])}
    best = min(hot.values())
    picks = {"autotuner": configs[0], "retime_top (kept)": kept}
    picks |= {f"{how} {v}": min(candidates(cool, (how, v)), key=hot.get) for how, v in RULES}
    rows = [dict(config=label(c), cool_us=cool[c] * 1e3, cool_rank=i + 1, hot_us=hot[c],
                 hot_rounds_us=[t * 1e3 for t in ts])
            for i, (c, ts) in enumerate(zip(configs, times[1:]))]
    rows.sort(key=lambda r: r["hot_us"])
    print(f"\n{name} M={m} {kind}: torch {base:.1f} µs, hot best {best:.1f} ({base / best:.3f}× torch)")
    for rule, c in picks.items():
        print(f"  {rule:>18}: {label(c):<44} hot {hot[c]:7.1f} µs  {hot[c] / best:.3f}× best  "
              f"{base / hot[c]:.3f}× torch  (autotuner rank {configs.index(c) + 1})")
    for r in rows[:8]:
        print(f"    {r['config']:<44} hot {r['hot_us']:7.1f}  autotuner {r['cool_us']:7.1f} (#{r['cool_rank']})")
    return dict(shape=name, m=m, kind=kind, torch_us=base, rows=rows,
                picks={rule: label(c) for rule, c in picks.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen_down,llama_up,llama_down")
    ap.add_argument("--kinds", default="fp8")
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    _import_kernels()
    print(f"# {torch.cuda.get_device_name()}", flush=True)
    res = [rank_shape(kind, name, args.m, args.rounds)
           for kind in args.kinds.split(",") for name in args.shapes.split(",")]
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "autotune_rank.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
