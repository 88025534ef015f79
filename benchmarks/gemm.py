"""GEMM benchmark for quantlab.kernels on a CUDA GPU (run on the device machine).

Shapes are Linear layers of Qwen2-7B and Llama-3-8B, written K×N (in × out); M is the token
count. Baselines run in the same process: bf16 F.linear (cuBLAS), torch._int_mm, torch._scaled_mm
(per-row scales) and torch's tinygemm int4 kernel (_weight_int4pack_mm, its own packing); at
M = 1 also the read floors (read_floor.py: a kernel that only reads the W4A16 / bf16 weight's
bytes — the fastest any GEMM over those bytes could be).
Times are medians of CUDA-event timings over CUDA-graph replays of each call (so host launch
overhead is out, as in a graphed decode loop), taken in `--rounds` rounds that interleave the
kinds of a case (after every kind is checked and autotuned; each round starts one kind later),
and the median round kept. `ops.bench_cold` flushes L2 before each run: by
default by reading a buffer far larger than L2, so the lines left behind are clean as in a decode
step; `--flush dirty` writes it instead, as triton's do_bench does, which adds write-back traffic
to every kernel's first reads. Eager times (one Python call per run) are kept in the JSON as
ms_eager. Each quantized case is also checked against its torch reference on the GPU
(rel = ‖y−ref‖/‖ref‖).

    python benchmarks/gemm.py [--ms 1,16,64,256,4096] [--shapes qwen_up,...] [--kinds w4a16,...]

Writes `benchmarks/results/gemm_<device>.json` and `.md` (`--out DIR`; the device's name as
`nvidia_h200`), each target of the W4A16 / W8A8 / FP8 kernels marked met or NOT met.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a bare checkout too

SHAPES = {  # name: (K, N)
    "qwen_up": (3584, 18944), "qwen_down": (18944, 3584), "qwen_qkv": (3584, 3584),
    "qwen_kv": (3584, 512), "llama_qkv": (4096, 4096), "llama_up": (4096, 14336),
    "llama_down": (14336, 4096), "llama_kv": (4096, 1024),
}
GROUP = 128


def _import_kernels():
    try:
        import quantlab.kernels as qk
    except ImportError:  # a checkout without the package installed: map kernels/ by hand
        import importlib.util
        import types

        pkg = types.ModuleType("quantlab")
        pkg.__path__ = [str(REPO / "quantlab")]
        sys.modules.setdefault("quantlab", pkg)
        spec = importlib.util.spec_from_file_location(
            "quantlab.kernels", REPO / "kernels" / "__init__.py",
            submodule_search_locations=[str(REPO / "kernels")])
        qk = importlib.util.module_from_spec(spec)
        sys.modules["quantlab.kernels"] = qk
        spec.loader.exec_module(qk)
    return qk


def bench(fn, rep: int = 30, dirty: bool = False) -> float:
    from quantlab.kernels.ops import bench_cold

    return bench_cold(fn, rep_ms=rep, dirty=dirty)


def graphed(fn):
    """fn (already warmed up and autotuned) as a CUDA-graph replay: timings exclude host launch
    overhead (Python + Triton's launcher), as a decode loop under CUDA graphs would see it;
    the timer still flushes L2 before every replay."""
    from quantlab.kernels.ops import graph_replay

    return graph_replay(fn)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a), rep=100)
    del a, b
    return 2 * nbytes / ms / 1e6


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.float(), ref.float()
    if not torch.isfinite(y).all():
        return float("inf")
    return ((y - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def tinygemm_pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  dtype: torch.dtype, high_first: bool):
    """Canonical codes [N,K] → torch's tinygemm int4 packing; zero = (8 − z)·s (w = (q−8)s + zero)."""
    c = codes.to(torch.uint8)
    if high_first:
        u8 = (c[:, ::2] << 4) | c[:, 1::2]
    else:
        u8 = c[:, ::2] | (c[:, 1::2] << 4)
    packed = torch.ops.aten._convert_weight_to_int4pack(u8.contiguous(), 8)
    s = scales.float()
    zero = (8.0 - zeros.float()) * s
    sz = torch.stack([s.t(), zero.t()], dim=-1).to(dtype).contiguous()  # [groups, N, 2]
    return packed, sz


class Case:
    """One layer shape with every weight format built once."""

    def __init__(self, qk, k: int, n: int):
        from quantlab.quant.primitives import quantize_weight
        from quantlab.quant.scheme import WeightScheme

        g = torch.Generator(device="cuda").manual_seed(k * 7 + n)
        self.k, self.n = k, n
        self.w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        q4 = quantize_weight(self.w.float(), WeightScheme(bits=4, symmetric=False, group_size=GROUP))
        q8 = quantize_weight(self.w.float(), WeightScheme(bits=8, symmetric=True, group_size=None))
        self.q4 = q4
        self.w4 = qk.pack_wna16(q4, torch.bfloat16)
        self.w8 = qk.pack_wna16(q8, torch.bfloat16)
        self.i8 = qk.quantize_int8_weight(self.w)
        self.f8 = qk.quantize_fp8_weight(self.w, per_row=True)
        self.tiny = None
        self.tiny_err = None

    def setup_tinygemm(self, x: torch.Tensor, ref: torch.Tensor) -> None:
        errs = {}
        for high in (True, False):
            try:
                packed, sz = tinygemm_pack(self.q4.codes, self.q4.scales, self.q4.zeros, x.dtype, high)
                y = torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, sz)
                errs[high] = (rel_err(y, ref), packed, sz)
            except Exception as e:  # noqa: BLE001 — report, do not die
                errs[high] = (float("inf"), None, repr(e)[:200])
        best = min(errs.values(), key=lambda t: t[0])
        if best[1] is not None and best[0] < 0.05:
            self.tiny = (best[1], best[2])
        self.tiny_err = {str(h): (e if p is not None else sz) for h, (e, p, sz) in errs.items()}


def weight_bytes(kind: str, k: int, n: int) -> float:
    return {"bf16": 2.0 * k * n, "w4a16": k * n / 2 + 2 * 2 * n * math.ceil(k / GROUP),
            "tinygemm": k * n / 2 + 2 * 2 * n * math.ceil(k / GROUP),
            "w8a16": k * n + 2 * 2 * n, "w8a8": k * n + 4 * n, "int_mm": k * n,
            "fp8": k * n + 4 * n, "scaled_mm": k * n + 4 * n}[kind]


def act_bytes(kind: str, m: int, k: int, n: int) -> float:
    a_el = 1 if kind in ("w8a8", "int_mm", "fp8", "scaled_mm") else 2
    y_el = 4 if kind == "int_mm" else 2
    return m * k * a_el + m * n * y_el


def run(args) -> dict:
    qk = _import_kernels()
    import triton

    from quantlab.kernels import reference
    from quantlab.kernels.ops import interleaved_rounds
    from quantlab.kernels.triton_scaled import fp8_matmul, w8a8_matmul
    from quantlab.kernels.triton_wna16 import wna16_matmul
    from read_floor import read_packed, read_weight_bytes

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    meta = {"device": dev.name, "sms": dev.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "copy_GBps": bw, "flush": args.flush, "python": platform.python_version(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "rounds": args.rounds}
    print(f"# {dev.name}: device copy {bw:.0f} GB/s; torch {torch.__version__}, triton {triton.__version__}",
          flush=True)
    ms_list = [int(v) for v in args.ms.split(",")]
    dirty = args.flush == "dirty"
    names = args.shapes.split(",") if args.shapes else list(SHAPES)
    rows = []
    for name in names:
        k, n = SHAPES[name]
        case = Case(qk, k, n)
        for m in ms_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq8, sx8 = reference.quantize_act_int8(x)
            xf8, sf8 = reference.quantize_act_fp8(x, per_row=True)
            ref4 = reference.wna16_mm(x, case.w4)
            if m == ms_list[0] or case.tiny is None and case.tiny_err is None:
                case.setup_tinygemm(x, ref4)
            # references built on first use, so kinds left out by --kinds cost nothing
            ref_w4 = lambda: ref4  # noqa: E731
            ref_w8 = functools.cache(lambda: reference.wna16_mm(x, case.w8))
            ref_fp8 = functools.cache(lambda: reference.fp8_mm(xf8, sf8, case.f8))
            variants = {
                "bf16": (lambda: F.linear(x, case.w), None),
                "w4a16": (lambda: wna16_matmul(x, case.w4), ref_w4),
                "w8a16": (lambda: wna16_matmul(x, case.w8), ref_w8),
                "w8a8": (lambda: w8a8_matmul(xq8, sx8, case.i8),
                         lambda: reference.w8a8_mm(xq8, sx8, case.i8)),
                "fp8": (lambda: fp8_matmul(xf8, sf8, case.f8), ref_fp8),
                "int_mm": (lambda: torch._int_mm(xq8, case.i8.w.t()), None),
                "scaled_mm": (lambda: torch._scaled_mm(xf8, case.f8.w.t(), scale_a=sf8.reshape(-1, 1),
                                                       scale_b=case.f8.scale.reshape(1, -1),
                                                       out_dtype=torch.bfloat16), ref_fp8),
            }
            if case.tiny is not None:
                packed, sz = case.tiny
                variants["tinygemm"] = (lambda: torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, sz), ref_w4)
            if m == 1:  # the read floors (read_floor.py): no GEMM reading these bytes is faster
                yr = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
                variants["read_w4a16"] = (lambda: read_packed(case.w4, yr), None)
                variants["read_bf16"] = (lambda: read_weight_bytes(case.w, yr), None)
                # both decode paths, forced (auto takes the GEMV)
                for bits, pw in ((4, case.w4), (8, case.w8)):
                    ref = variants[f"w{bits}a16"][1]
                    for impl in ("gemv", "fused"):
                        variants[f"w{bits}a16_{impl}"] = (
                            lambda pw=pw, impl=impl: wna16_matmul(x, pw, impl=impl), ref)
            if 2 <= m <= 16:  # the Triton tensor-core kernel and its Gluon version, forced
                for impl in ("fused", "gluon"):  # (auto picks by weight size; gluon: sm_90 only)
                    variants[f"w4a16_{impl}"] = (
                        lambda impl=impl: wna16_matmul(x, case.w4, impl=impl), variants["w4a16"][1])
            if args.kinds:  # bf16 always: the speed-ups are against it
                keep = {"bf16", *args.kinds.split(",")}
                variants = {kk: v for kk, v in variants.items() if kk in keep}
            times, recs, graphs = {}, {}, {}
            for kind, (fn, ref) in variants.items():  # check, autotune, capture
                rec = recs[kind] = {"shape": name, "K": k, "N": n, "M": m, "kind": kind}
                try:
                    y = fn()
                    torch.cuda.synchronize()
                    if ref is not None:
                        rec["rel_err"] = rel_err(y, ref())
                    elif kind == "int_mm":
                        rec["rel_err"] = rel_err(y.float() * sx8[:, None] * case.i8.scale, reference.w8a8_mm(
                            xq8, sx8, case.i8, torch.float32))
                    rec["ms_eager"] = bench(fn, dirty=dirty)
                    graphs[kind] = graphed(fn)
                except Exception as e:  # noqa: BLE001 — one failing case must not end the run
                    rec["error"] = repr(e)[:300]
            # Timed in interleaved rounds, each starting one kind later, compared by median: the
            # clocks of a GPU under load drift within a run (bf16 llama_up 656–719 µs between
            # rounds on an H100), and kinds timed one after another would carry that drift into
            # their ratios.
            timers = [lambda g=g: bench(g, dirty=dirty) for g in graphs.values()]
            for kind, ts in zip(graphs, interleaved_rounds(timers, args.rounds, rotate=True)):
                if ts:
                    recs[kind]["ms_rounds"] = ts
            for kind, rec in recs.items():
                if "ms_rounds" in rec:
                    t = times[kind] = statistics.median(rec["ms_rounds"])
                    base = (kind.split("_")[0] if kind.startswith(("w4a16", "w8a16")) else
                            kind.removeprefix("read_"))
                    nbytes = weight_bytes(base, k, n) + act_bytes(base, m, k, n)
                    rec.update(ms=t, GBps=nbytes / t / 1e6, TFLOPs=2 * m * n * k / t / 1e9,
                               bw_frac=nbytes / t / 1e6 / bw)
                rows.append(rec)
            for rec in rows[-len(variants):]:
                if "ms" in rec and "bf16" in times:
                    rec["speedup_vs_bf16"] = times["bf16"] / rec["ms"]
            line = "  ".join(f"{kk}={times[kk] * 1e3:.1f}" for kk in times)
            print(f"{name:11s} M={m:5d} us: {line}", flush=True)
        meta.setdefault("tinygemm_check", {})[name] = case.tiny_err
        del case
        torch.cuda.empty_cache()
        meta["autotune"] = autotune_choices()
        save({"meta": meta, "rows": rows}, args)  # partial results survive a time-out
    return {"meta": meta, "rows": rows}


def autotune_choices() -> dict:
    from quantlab.kernels import triton_scaled, triton_wna16

    out = {}
    tuners = [(f"wna16_{label}", t) for label, t in triton_wna16.TUNERS.items()]
    for label, tuner in (*tuners, ("scaled_small", triton_scaled._SMALL),
                         ("scaled_large", triton_scaled._LARGE)):
        out[label] = {str(kk): str(v) for kk, v in getattr(tuner, "cache", {}).items()}
    gluon = triton_scaled._gluon()  # above M = 64 on Hopper: its picks, and which kernel was kept
    out["scaled_gluon"] = {str(kk): str(v) for kk, v in (gluon._TUNED if gluon else {}).items()}
    out["scaled_kept"] = {str(kk): v for kk, v in triton_scaled._FASTER.items()}
    return out


def bars(rows: list[dict]) -> list[str]:
    """The kernels' targets, each with the measured numbers and met / NOT met."""
    t = {(r["shape"], r["M"], r["kind"]): r["ms"] for r in rows if "ms" in r}
    out = []

    def line(ok: bool, text: str) -> None:
        out.append(f"- {'met' if ok else 'NOT met'}: {text}")

    for shape in ("qwen_up", "qwen_down"):
        b, w, tg = t.get((shape, 1, "bf16")), t.get((shape, 1, "w4a16")), t.get((shape, 1, "tinygemm"))
        floor = t.get((shape, 1, "read_w4a16"))
        if b and w:
            line(b / w >= 3.0 and (tg is None or w < tg),
                 f"W4A16 M=1 {shape}: {b / w:.2f}× bf16 (bar 3.0×), {w * 1e3:.1f} µs vs tinygemm "
                 f"{tg * 1e3 if tg else float('nan'):.1f} µs" + (
                     f"; only reading its bytes takes {floor * 1e3:.1f} µs = {b / floor:.2f}× bf16"
                     if floor else ""))
        b, w = t.get((shape, 16, "bf16")), t.get((shape, 16, "w4a16"))
        if b and w:
            line(b / w >= 2.5, f"W4A16 M=16 {shape}: {b / w:.2f}× bf16 (bar 2.5×)")
    slow = [(sh, m, t[(sh, m, "bf16")] / v) for (sh, m, k), v in t.items()
            if k == "w4a16" and m <= 64 and (sh, m, "bf16") in t and v > t[(sh, m, "bf16")]]
    if any(k == "w4a16" and m <= 64 for (_, m, k) in t):
        line(not slow, "W4A16 never slower than bf16 at M ≤ 64" +
             ("" if not slow else ": slower at " + ", ".join(f"{sh} M={m} ({x:.2f}×)" for sh, m, x in slow)))
    for kind, base, bar in (("fp8", "scaled_mm", 1.5), ("w8a8", "int_mm", 1.3)):
        for (sh, m, k), v in sorted(t.items()):
            if k == kind and m == 4096 and (sh, m, "bf16") in t:
                sp, ref = t[(sh, m, "bf16")] / v, t.get((sh, m, base))
                line(sp >= bar and (ref is None or v <= ref),
                     f"{kind} M=4096 {sh}: {sp:.2f}× bf16 (bar {bar}×), {v * 1e3:.0f} µs vs {base} "
                     f"{ref * 1e3 if ref else float('nan'):.0f} µs")
    return out


def markdown(res: dict) -> str:
    meta, rows = res["meta"], res["rows"]
    lines = [f"# GEMM benchmark — {meta['device']}", "",
             f"torch {meta['torch']}, triton {meta['triton']}; measured device copy bandwidth "
             f"{meta['copy_GBps']:.0f} GB/s (read + write). Times: median µs of CUDA-graph replays "
             f"(L2 flushed before each, {meta.get('flush', 'dirty')}: see the module docstring; eager µs in "
             f"parentheses), the median of {meta.get('rounds', 1)} interleaved rounds. "
             "× = speed-up vs bf16 cuBLAS; BW% = achieved bytes/s over the copy bandwidth; rel = "
             "‖y − ref‖/‖ref‖ against the torch reference.", "",
             "| shape (K×N) | M | kind | µs (eager) | × bf16 | GB/s | BW% | TFLOP/s | rel err |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines[4:4] = ["## Bars", "", *bars(rows), "", "## All cases", ""]
    for r in rows:
        shape = f"{r['shape']} {r['K']}×{r['N']}"
        if "error" in r:
            lines.append(f"| {shape} | {r['M']} | {r['kind']} | error: {r['error'][:80]} | | | | | |")
            continue
        rel = f"{r['rel_err']:.1e}" if "rel_err" in r else ""
        flops = "" if r["kind"].startswith("read_") else f"{r['TFLOPs']:.1f}"  # a read does no math
        lines.append(f"| {shape} | {r['M']} | {r['kind']} | {r['ms'] * 1e3:.1f} ({r['ms_eager'] * 1e3:.1f}) | "
                     f"{r.get('speedup_vs_bf16', float('nan')):.2f} | {r['GBps']:.0f} | "
                     f"{100 * r['bw_frac']:.0f}% | {flops} | {rel} |")
    return "\n".join(lines) + "\n"


def save(res: dict, args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = args.tag or res["meta"]["device"].replace(" ", "_").lower()
    (out / f"gemm_{tag}.json").write_text(json.dumps(res, indent=1))
    (out / f"gemm_{tag}.md").write_text(markdown(res))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--ms", default="1,16,64,256,4096")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--tag", default="", help="write gemm_<tag>.{json,md} instead of gemm_<device>")
    ap.add_argument("--kinds", default="", help="only these kinds (and bf16), e.g. w4a16,read_w4a16")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved timing rounds per case; each kind's time is their median")
    ap.add_argument("--flush", choices=("clean", "dirty"), default="clean",
                    help="L2 flush before each timed run: read (clean lines) or write (dirty)")
    args = ap.parse_args()
    res = run(args)
    save(res, args)
    print(markdown(res))


if __name__ == "__main__":
    main()
