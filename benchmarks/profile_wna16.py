"""Run one WNA16 kernel launch per variant with fixed configs (no autotuning), for Nsight Compute:

    ncu --clock-control none --kernel-name regex:wna16 --launch-skip 1 --launch-count 1 \\
        --section ... python benchmarks/profile_wna16.py --which m1

`--which bf16` runs the bf16 F.linear (cuBLAS) instead, and `--config '{...}'` replaces the
variant's config. The three launches sit between `cudaProfilerStart` and `Stop`, so
`ncu --profile-from-start off` sees them and not the weight's quantization.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm import GROUP, _import_kernels, tinygemm_pack  # noqa: E402

VARIANTS = {  # name: (M, config); "gemv" is the M = 1 CUDA-core path
    "gemv": (1, dict(BLOCK_N=256, SPLIT_K=8, PF=True, num_warps=2, num_stages=1)),
    "m1": (1, dict(BLOCK_M=16, BLOCK_N=128, SPLIT_K=8, U=2, num_warps=4,
                   num_stages=2)),
    "m16": (16, dict(BLOCK_M=16, BLOCK_N=128, SPLIT_K=4, U=2, num_warps=4,
                     num_stages=2)),
    "m64": (64, dict(BLOCK_M=64, BLOCK_N=128, SPLIT_K=4, U=2, num_warps=8,
                     num_stages=3)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--which", default="m1", choices=[*VARIANTS, "tinygemm", "bf16"])
    ap.add_argument("--config", default="", help="JSON meta-parameters replacing the variant's")
    ap.add_argument("--k", type=int, default=3584)
    ap.add_argument("--n", type=int, default=18944)
    args = ap.parse_args()
    qk = _import_kernels()
    from quantlab.kernels.triton_wna16 import wna16_matmul
    from quantlab.quant.primitives import quantize_weight
    from quantlab.quant.scheme import WeightScheme

    w = torch.randn(args.n, args.k, device="cuda") * 0.02
    q4 = quantize_weight(w, WeightScheme(bits=4, symmetric=False, group_size=GROUP))
    m, cfg = VARIANTS.get(args.which, (1, None))
    x = torch.randn(m, args.k, device="cuda", dtype=torch.bfloat16)
    if args.which == "tinygemm":
        packed, sz = tinygemm_pack(q4.codes, q4.scales, q4.zeros, x.dtype, True)
        call = lambda: torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, sz)  # noqa: E731
    elif args.which == "bf16":
        wb = w.to(torch.bfloat16)
        call = lambda: torch.nn.functional.linear(x, wb)  # noqa: E731
    else:
        cfg = json.loads(args.config) if args.config else cfg
        p = qk.pack_wna16(q4, torch.bfloat16)
        impl = "gemv" if args.which == "gemv" else "fused"
        call = lambda: wna16_matmul(x, p, impl=impl, config=cfg)  # noqa: E731
    call()  # compile outside the profiled range
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
