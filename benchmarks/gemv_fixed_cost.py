"""Where the M = 1 W4A16 GEMV loses to the read floor: per byte, or once per call? (device machine)

The GEMV and the read floor (`read_floor.py`) run with the same grid (column tiles × split-K,
warps, pipeline stages) on int4 g128 weights of one N and a range of K, so the bytes grow and
everything else stays. Each is timed as gemm.py times it (CUDA-graph replays, L2 flushed clean
before each), alternately in rounds so that clock drift lands on both. A straight line through
time against bytes gives each kernel's streaming rate (the slope) and its cost per call (the
intercept); a graph replay of an empty kernel gives the part of every timing that is launch
latency, common to any GEMM timed this way (cuBLAS included). Writes
`results/gemv_fixed_cost_<tag>.{json,md}`.

    python benchmarks/gemv_fixed_cost.py --n 3584 --ks 4736,9472,18944,37888,75776 \\
        --block-n 128 --split 32 --stages 3 --warps 1 --tag h100

`--launch-only` runs each kernel twice and nothing else, for Nsight Compute's durations
(`ncu --clock-control none --kernel-name regex:"_gemv_kernel|_read_kernel"`).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm import GROUP, _import_kernels, bench, graphed  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def random_weight(k: int, n: int):
    """int4 g128 weights in the kernels' layout with random words, scales and zero points: the
    bytes, not the values, are what is timed here."""
    from quantlab.kernels.layout import PackedWNA16

    g = torch.Generator(device="cuda").manual_seed(k + n)
    words = torch.randint(-2**31, 2**31 - 1, (k // 8, n), device="cuda", dtype=torch.int32,
                          generator=g)
    groups = k // GROUP
    scales = (torch.rand(groups, n, device="cuda", generator=g) * 1e-2).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (groups, n), device="cuda", generator=g).to(torch.bfloat16)
    return PackedWNA16(words, scales, zeros, 4, GROUP, k, n)


def weight_bytes(p) -> int:
    return sum(t.numel() * t.element_size() for t in (p.qweight, p.scales, p.zeros))


def kernels(p, x: torch.Tensor, args) -> dict:
    """The GEMV and the read floor on the same grid, as zero-argument calls."""
    from quantlab.kernels.triton_wna16 import wna16_matmul
    from read_floor import read_packed

    grid = dict(BLOCK_N=args.block_n, SPLIT_K=args.split, STAGES=args.stages, num_warps=args.warps)
    gemv = dict(grid, PF=True, DENORM=True, num_stages=1)
    y = torch.empty(1, p.out_features, device="cuda", dtype=torch.bfloat16)
    return {"gemv": lambda: wna16_matmul(x, p, impl="gemv", config=gemv),
            "floor": lambda: read_packed(p, y, config=grid)}


@triton.jit
def _empty(y_ptr):
    """Nothing: its graph replay times the launch alone."""
    pass


def run(args) -> dict:
    _import_kernels()
    dev = torch.cuda.get_device_properties(0)
    meta = {"device": dev.name, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "n": args.n, "grid": dict(block_n=args.block_n, split=args.split, stages=args.stages,
                                      warps=args.warps), "rounds": args.rounds}
    dummy = torch.zeros(1, device="cuda")
    rows = []
    empty = graphed(lambda: _empty[(1,)](dummy))
    empty()
    meta["empty_graph_us"] = bench(empty) * 1e3
    print(f"# {dev.name}: empty kernel as a graph replay {meta['empty_graph_us']:.2f} µs", flush=True)
    for k in (int(v) for v in args.ks.split(",")):
        p = random_weight(k, args.n)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        calls = kernels(p, x, args)
        if args.launch_only:
            for fn in calls.values():
                fn()
                fn()
            torch.cuda.synchronize()
            continue
        timed = {name: graphed(fn) for name, fn in calls.items()}  # warmed up, then captured
        times = {name: [] for name in timed}
        for r in range(args.rounds):
            for name in (list(timed) if r % 2 == 0 else list(timed)[::-1]):
                times[name].append(bench(timed[name]) * 1e3)
        rec = {"K": k, "MB": weight_bytes(p) / 1e6,
               **{f"{name}_us": statistics.median(v) for name, v in times.items()}}
        rows.append(rec)
        print(f"K={k:6d} {rec['MB']:6.1f} MB  gemv {rec['gemv_us']:6.2f} µs  floor {rec['floor_us']:6.2f} µs"
              f"  gap {rec['gemv_us'] - rec['floor_us']:5.2f} µs", flush=True)
        del p, calls, timed
    if rows:
        mb = [r["MB"] for r in rows]
        for name in ("gemv", "floor"):
            line = statistics.linear_regression(mb, [r[f"{name}_us"] for r in rows])
            meta[f"{name}_fit"] = {"intercept_us": line.intercept, "GBps": 1e3 / line.slope}
    return {"meta": meta, "rows": rows}


def markdown(res: dict) -> str:
    m = res["meta"]
    g = m["grid"]
    lines = [f"# M = 1 GEMV vs read floor as K grows — {m['device']}", "",
             f"torch {m['torch']}, triton {m['triton']}; N = {m['n']}, int4 g128; both kernels on one grid: "
             f"{g['block_n']} columns × split {g['split']}, {g['warps']} warp(s), {g['stages']} stages. "
             f"Median µs of {m['rounds']} CUDA-graph replays each (L2 flushed clean), the two kernels "
             f"alternating. An empty kernel replayed the same way takes {m['empty_graph_us']:.2f} µs.", "",
             "| K | MB | GEMV µs | floor µs | gap µs |", "| ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['K']} | {r['MB']:.1f} | {r['gemv_us']:.2f} | {r['floor_us']:.2f} | "
              f"{r['gemv_us'] - r['floor_us']:.2f} |" for r in res["rows"]]
    if "gemv_fit" in m:
        lines += ["", "Straight line through µs against MB:", ""]
        lines += [f"- {name}: {m[f'{name}_fit']['intercept_us']:.2f} µs per call + bytes at "
                  f"{m[f'{name}_fit']['GBps']:.0f} GB/s" for name in ("gemv", "floor")]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3584)
    ap.add_argument("--ks", default="4736,9472,18944,37888,75776")
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--split", type=int, default=32)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--warps", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--launch-only", action="store_true", help="two launches of each, for ncu")
    args = ap.parse_args()
    res = run(args)
    if args.launch_only:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = args.tag or torch.cuda.get_device_name().replace(" ", "_").lower()
    (out / f"gemv_fixed_cost_{tag}.json").write_text(json.dumps(res, indent=1))
    (out / f"gemv_fixed_cost_{tag}.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
