"""Probe: the M = 1 W4A16 GEMV with its split-K sum in distributed shared memory
(`cluster_gemv.cu`, CUDA C++ compiled at run time by NVRTC) against the Triton GEMV it would
replace, bf16 cuBLAS and the read floor, in one run on one GPU (Hopper: thread-block clusters).

Bar 1 of issue 6 wants qwen_down (18944×3584) at M = 1 ≥ 3.0× bf16; the Triton GEMV sits at
2.81–2.85×, about 1 µs over what the bar needs, and session 20 put about that much in its
global finish (atomic adds, the arrival counter, the last program's read of the sums). Here the
partials never leave the chip. Each variant is checked against the torch reference and for
bit-identical repeats before it is timed; times are `gemm.py`'s (CUDA-graph replays, L2
flushed clean before each, median of interleaved rounds).

    python benchmarks/cluster_gemv.py [--shapes qwen_down,qwen_up] [--variants 4x8,2x8] --out DIR

Variants are NWxCL: NW warps per CTA, CL CTAs per cluster (NW·CL K ranges per 128 columns);
NWxCLn is the same kernel without the cluster's sum (each CTA stores its own partial: a wrong y,
timed only), which prices the on-chip finish.
Prints a table and writes `cluster_gemv_<tag>.{json,md}`.

On an H200 (session 26) every variant was slower than the Triton GEMV: the best, 8x8, took 17.95
µs on qwen_down against 16.70, and without its sum it was still slower (the on-chip finish cost
0.6 µs; the loop is what loses). benchmarks/README.md has the table.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import math
import site
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gemm import SHAPES, Case, _import_kernels, bench, graphed, rel_err  # noqa: E402

SOURCE = HERE / "cluster_gemv.cu"
KERNEL = "w4_gemv_cluster"
MAX_STAGED_BLOCKS = 80  # MAXB in the source: 64-k blocks of activations one CTA stages


def nvrtc() -> ctypes.CDLL:
    """The NVRTC that CUDA wheels of torch install (nvidia/*/lib), or the system's."""
    names = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    for d in site.getsitepackages():
        names += [f for f in sorted(glob.glob(f"{d}/nvidia/**/libnvrtc.so*", recursive=True))
                  if "builtins" not in f and ".alt." not in f]
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("no NVRTC library found (pip install nvidia-cuda-nvrtc)")


def compile_cubin(source: str, options: list[str], arch: str = "sm_90a") -> tuple[bytes, str]:
    """cubin and ptxas log of `source`; raises with NVRTC's log when it does not compile."""
    lib = nvrtc()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"cluster_gemv.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}", "-default-device", "--ptxas-options=-v", *options]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    status = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if status:
        raise RuntimeError(log.value.decode())
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw, log.value.decode()


def load(nw: int, cl: int, half: bool, finish: bool = True):
    """The compiled kernel (torch's loader of NVRTC modules) and its ptxas resource line."""
    from torch.cuda._utils import _cuda_load_module

    defines = {"NW": nw, "CL": cl, "HALF": int(half), "FINISH": int(finish)}
    cubin, log = compile_cubin(SOURCE.read_text(), [f"-D{k}={v}" for k, v in defines.items()])
    usage = next((ln.split(":", 1)[1].strip() for ln in log.splitlines() if "registers" in ln), "")
    return _cuda_load_module(cubin, [KERNEL])[KERNEL], usage


def launcher(kern, x: torch.Tensor, p, y: torch.Tensor, nw: int, cl: int):
    """A no-argument call of the kernel on the packed weight `p` (PackedWNA16, int4)."""
    if x.data_ptr() % 16 or not x.is_contiguous():
        raise ValueError("x must be contiguous and 16-byte aligned (the kernel loads 8 activations at a time)")
    nblk = p.qweight.shape[0] // 8
    bpg = p.group_size // 64 if p.group_size else nblk
    args = [x, p.qweight, p.scales, p.zeros, y, p.out_features, p.in_features, nblk, bpg, p.scales.shape[0]]
    grid = ((p.out_features + 127) // 128, cl, 1)
    return lambda: kern(grid=grid, block=(nw * 32, 1, 1), args=args)


def fits(k: int, n: int, cl: int) -> bool:
    """Whether one CTA's share of the 64-k blocks (K padded to 128) fits its staging buffer, and
    the 4-column vector loads stay aligned."""
    blocks = 2 * math.ceil(k / 128)
    return n % 4 == 0 and math.ceil(blocks / cl) <= MAX_STAGED_BLOCKS


def run(args) -> dict:
    qk = _import_kernels()
    from quantlab.kernels import reference, triton_wna16
    from quantlab.kernels.ops import interleaved_rounds
    from read_floor import read_packed

    variants = [(*map(int, v.rstrip("n").split("x")), not v.endswith("n")) for v in args.variants.split(",")]
    rows = []
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        case = Case(qk, k, n)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = reference.wna16_mm(x, case.w4).float()
        floor_out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        triton = lambda: triton_wna16.wna16_matmul(x, case.w4, impl="gemv")  # noqa: E731
        runs = {"bf16": lambda: F.linear(x, case.w), "read floor": lambda: read_packed(case.w4, floor_out),
                "triton GEMV": triton}
        checks = {"triton GEMV": {"rel": rel_err(triton(), ref)}}
        for nw, cl, finish in variants:
            if not fits(k, n, cl):
                continue
            kern, usage = load(nw, cl, half=False, finish=finish)
            y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
            fn = launcher(kern, x, case.w4, y, nw, cl)
            fn()
            first = y.clone()
            fn()
            label = f"cluster {nw}x{cl}" + ("" if finish else " no sum (timing only)")
            checks[label] = {"rel": rel_err(y, ref), "repeat_identical": torch.equal(first, y), "ptxas": usage}
            if finish and checks[label]["rel"] > 1e-2:
                raise SystemExit(f"{label} on {name}: rel error {checks[label]['rel']:.2e} against the reference")
            runs[label] = fn
        labels = list(runs)
        graphs = [graphed(runs[label]) for label in labels]
        times = interleaved_rounds([lambda g=g: bench(g) * 1e3 for g in graphs], args.rounds, rotate=True)
        med = {label: statistics.median(t) for label, t in zip(labels, times)}
        for label, t in zip(labels, times):
            rows.append({"shape": name, "k": k, "n": n, "kind": label, "us": med[label], "rounds_us": t,
                         "x_bf16": med["bf16"] / med[label], **checks.get(label, {})})
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": args.rounds,
            "rows": rows}


def markdown(res: dict) -> str:
    lines = [f"# Cluster GEMV probe, M = 1 — {res['device']} (torch {res['torch']})", "",
             f"Median of {res['rounds']} interleaved rounds of CUDA-graph replays, L2 flushed clean.", "",
             "| shape | kind | µs | × bf16 | rel err | repeats identical | ptxas |", "|---|---|---:|---:|---:|---|---|"]
    for r in res["rows"]:
        rel = f"{r['rel']:.1e}" if "rel" in r else ""
        lines.append(f"| {r['shape']} | {r['kind']} | {r['us']:.2f} | {r['x_bf16']:.2f} | {rel} | "
                     f"{r.get('repeat_identical', '')} | {r.get('ptxas', '')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen_down,qwen_up")
    ap.add_argument("--variants", default="4x8,4x8n,2x8,8x8,8x4,4x4,4x2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    res = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = args.tag or res["device"].replace(" ", "_").lower()
    (out / f"cluster_gemv_{tag}.json").write_text(json.dumps(res, indent=1))
    (out / f"cluster_gemv_{tag}.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
