"""Config sweep for the W4A16 kernel at decode sizes (run on the device machine).

Times every explicit config (no autotuning) of quantlab.kernels.triton_wna16 on the given
shapes and token counts next to bf16 cuBLAS and torch's tinygemm, the same way as
benchmarks/gemm.py (CUDA-graph replays, L2 flushed clean before each), checks each against the
torch reference, and prints the best configs per case; `--out DIR` also writes
`wna16_sweep.json` there. Used to pick CONFIGS in the kernel module:

    python benchmarks/wna16_sweep.py --shapes qwen_up,qwen_down --ms 1,16,64 --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm import GROUP, SHAPES, Case, _import_kernels, bench, graphed, rel_err  # noqa: E402

# (BLOCK_M, BLOCK_N, num_warps, num_stages, U, PF, maxnreg) per M bucket; split-K is swept.
DECODE = [(16, 128, 4, 2, 2, pf, r) for pf in (True, False) for r in (None, 96)] + [
    (16, 128, 4, 3, 2, True, None), (16, 256, 4, 2, 2, True, None), (16, 256, 4, 2, 2, False, None),
    (16, 64, 4, 2, 2, True, None), (16, 128, 4, 2, 1, True, 96)]
SMALL = [(64, 128, 8, 2, 2, pf, None) for pf in (True, False)] + [
    (64, 128, 8, 3, 2, False, None), (64, 64, 4, 3, 2, True, None), (64, 64, 4, 3, 2, False, None),
    (64, 256, 8, 2, 2, False, None), (32, 128, 4, 2, 2, True, None)]
# --deep: deeper software pipelines (more weight bytes in flight per SM) and smaller M tiles.
DEEP_DECODE = [(16, bn, 4, st, u, True, None) for bn in (64, 128) for st in (3, 4) for u in (2, 4)] + [
    # fewer than 4 warps: Triton falls back from wgmma to mma.sync, which takes A from registers
    (16, bn, w, st, 2, pf, None) for bn, w in ((64, 2), (128, 2), (32, 1), (64, 1)) for st in (2, 3)
    for pf in (True, False)]
DEEP_SMALL = [(64, bn, w, st, u, False, None) for bn, w in ((128, 8), (64, 4)) for st in (3, 4)
              for u in (1, 4)] + [(32, 128, 4, 3, 2, False, None), (32, 64, 4, 3, 2, False, None),
                                  (16, 128, 4, 3, 2, True, None), (16, 128, 4, 4, 4, True, None)]
# M > 64: the tensor-core kernel with the tokens as wgmma's N side, against dequantize + cuBLAS
# (the `dequant` row, what `_auto_path` runs there). On an H200 it lost by about 2× (qwen_down
# M = 256: 226 vs 119 µs; M = 1024: 438 vs 249 µs): shared-memory bound, as at M = 64.
LARGE = [(bm, bn, 8, st, u, False, None) for bm, bn in ((128, 128), (256, 128), (128, 256))
         for st in (2, 3, 4) for u in (1, 2)]
SPLITS = (1, 2, 4, 8, 16)
# The M = 1 CUDA-core GEMV: (BLOCK_N, num_warps, PF, DENORM, STAGES); split-K is swept.
GEMV = [(bn, w, pf, dn, 1) for bn, w in ((128, 1), (256, 1), (256, 2), (512, 2), (512, 4), (128, 2))
        for pf, dn in ((True, False), (False, False), (True, True))]
# --deep: the words through the software pipeline (STAGES − 1 blocks in flight per program).
DEEP_GEMV = [(bn, w, True, True, st) for bn, w in ((128, 1), (256, 2), (512, 4))
             for st in (3, 4, 6)]
# 8 columns per thread: each activation a thread loads and scales serves twice the weights.
DEEP_GEMV += [(bn, w, True, True, st) for bn, w in ((256, 1), (512, 2), (1024, 4)) for st in (2, 3, 4)]
# 2 columns per thread: twice the column tiles, so half the split (and its reduction) for the
# same programs on a narrow-N, long-K shape. Lost on an H100 (session 13): qwen_down best 20.0
# µs at split 28 against 19.7 for 128 columns at split 32.
DEEP_GEMV += [(64, 1, True, True, st) for st in (1, 3, 4)]
GEMV_SPLITS = (2, 4, 8, 16, 32)
# The Gluon kernel (sm_90, M ≤ 64; gluon_wna16): (block_n, stages, red, atomic, warps); split-K
# is swept over GLUON_SPLITS and the whole-wave splits. `red` only matters for the ordered sum.
GLUON_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)
GLUON = [(bn, st, red, False, 4) for bn, st, red in ((64, 2, 2), (64, 2, 4), (64, 2, 8), (128, 2, 1),
                                                      (128, 2, 2), (128, 2, 4), (64, 3, 4), (64, 4, 4),
                                                      (128, 3, 4), (128, 4, 4))]
GLUON += [(bn, st, 1, True, 4) for bn in (64, 128) for st in (2, 3)]
# Two warpgroups per 128 columns: on an H200 the 4-warp kernel took about the H100's time at
# M = 16 (qwen_up 19.8 against 20.6 µs), 5–6 µs over the read floor: bound by its latency.
GLUON += [(128, st, red, atomic, 8) for st, red, atomic in ((2, 1, True), (3, 1, True), (2, 2, False))]


def configs(m: int, nblk: int, deep: str | None = None, n: int = 1,
            sms: int = 132) -> list[tuple[str, dict]]:
    """(impl, explicit config) pairs for a token count: the tensor-core kernel's grid, and at
    M = 1 also the GEMV's; `deep` adds DEEP_* (only those with `--deep only`). Split-K: the
    listed powers of 2 and the kernel's whole-wave splits for this shape."""
    from quantlab.kernels.split_k import wave_splits

    def splits(listed, tiles):
        return sorted({*listed, *wave_splits(tiles, sms)})

    out = []
    grid = DECODE if m <= 16 else SMALL if m <= 64 else LARGE
    extra = DEEP_DECODE if m <= 16 else DEEP_SMALL if m <= 64 else []
    grid = {"": grid, "add": grid + extra, "only": extra}[deep or ""]
    for bm, bn, w, st, u, pf, r in grid:
        out += [("fused", dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=sk, U=u, PF=pf, num_warps=w, num_stages=st,
                               maxnreg=r))
                for sk in (splits(SPLITS, -(-n // bn) * -(-m // bm)) if m <= 64 else (1,))
                if sk == 1 or nblk // u >= 2 * sk]
    if m <= 64 and torch.cuda.get_device_capability()[0] == 9:
        out += [("gluon", dict(block_n=bn, split=sk, stages=st, red=red, atomic=atomic, warps=w))
                for bn, st, red, atomic, w in GLUON if n % bn == 0
                for sk in splits(GLUON_SPLITS, n // bn) if sk <= nblk // 2]
    if m == 1:
        gemv = {"": GEMV, "add": GEMV + DEEP_GEMV, "only": DEEP_GEMV}[deep or ""]
        out += [("gemv", dict(BLOCK_N=bn, SPLIT_K=sk, PF=pf, DENORM=dn, STAGES=st, num_warps=w,
                              num_stages=1))
                for bn, w, pf, dn, st in gemv for sk in splits(GEMV_SPLITS, -(-n // bn))
                if nblk >= 2 * sk]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen_up,qwen_down")
    ap.add_argument("--ms", default="1,16,64")
    ap.add_argument("--out", default="")
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--impls", default="", help="only these kernels, e.g. gemv (default: all)")
    ap.add_argument("--gluon-sum", choices=["atomic", "ordered"], default=None,
                    help="only the Gluon configs with this split-K sum (default: both)")
    ap.add_argument("--deep", choices=["add", "only"], default=None,
                    help="also (add) or only (only) the deeper-pipeline configs DEEP_*")
    args = ap.parse_args()
    qk = _import_kernels()
    from quantlab.kernels import reference
    from quantlab.kernels import triton_wna16 as tw
    from quantlab.kernels.triton_wna16 import wna16_matmul

    dev = torch.cuda.get_device_properties(0)
    print(f"# {dev.name}, {dev.multi_processor_count} SMs", flush=True)
    results = []
    t_start = time.time()
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        case = Case(qk, k, n)
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = reference.wna16_mm(x, case.w4)
            case.setup_tinygemm(x, ref)
            base = {"bf16": bench(graphed(lambda: F.linear(x, case.w)))}
            if m > 1 and (not args.impls or "fused" in args.impls):
                # the Triton tensor-core kernel, autotuned (auto may take the Gluon one)
                base["fused"] = bench(graphed(lambda: wna16_matmul(x, case.w4, impl="fused")))
            if m > 64:
                base["dequant"] = bench(graphed(lambda: wna16_matmul(x, case.w4, impl="dequant")))
            if case.tiny is not None:
                packed, sz = case.tiny
                base["tinygemm"] = bench(graphed(
                    lambda: torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, sz)))
            rows = []
            nblk = case.w4.qweight.shape[0] // 8
            for impl, cfg in configs(m, nblk, args.deep, n, dev.multi_processor_count):
                if args.impls and impl not in args.impls.split(","):
                    continue
                if impl == "gluon" and args.gluon_sum and cfg["atomic"] != (args.gluon_sum == "atomic"):
                    continue
                fn = lambda impl=impl, cfg=cfg: wna16_matmul(x, case.w4, impl=impl, config=cfg)  # noqa: E731
                try:
                    err = rel_err(fn(), ref)
                    t = bench(graphed(fn), rep=20)
                except Exception as e:  # noqa: BLE001 — a config that fails is reported
                    print(f"  {impl} {cfg}: {repr(e)[:200]}", flush=True)
                    continue
                rows.append(dict(shape=name, M=m, ms=t, rel_err=err, impl=impl, **cfg))
            rows.sort(key=lambda r: r["ms"])
            results += rows
            # what the autotuner picks for the same call (impl auto), timed the same way
            base["autotuned"] = bench(graphed(lambda: wna16_matmul(x, case.w4)))
            picked = [str(c) for t in tw.TUNERS.values() for key, c in t.cache.items()
                      if key[:3] in ((m if m == 1 else tw._bucket(m), n, k), (n, k, 4))]
            print(f"  autotuned {base['autotuned'] * 1e3:.1f}us: {picked}", flush=True)
            tb = base["bf16"]
            line = "  ".join(f"{kk}={v * 1e3:.1f}us" for kk, v in base.items())
            print(f"\n{name} M={m}: {line}  ({time.time() - t_start:.0f}s)", flush=True)
            for r in rows[: args.top]:
                cfg = " ".join(f"{k}={v}" for k, v in r.items() if k not in ("shape", "M", "ms", "rel_err"))
                print(f"  {r['ms'] * 1e3:6.1f}us  {tb / r['ms']:.2f}x bf16  rel {r['rel_err']:.1e}  {cfg}", flush=True)
            bad = [r for r in rows if not r["rel_err"] < 1e-2]
            if bad:
                print(f"  !! {len(bad)} configs with rel_err >= 1e-2, e.g. {bad[0]}", flush=True)
            results.append(dict(shape=name, M=m, baseline=base))
            if args.out:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                (Path(args.out) / "wna16_sweep.json").write_text(json.dumps(results, indent=1))
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
