"""Scratch: the int8 activation kernel on the GPU — bit-identical to the torch ops? host time?"""
import sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm import _import_kernels
_import_kernels()
from quantlab.runner.codes import InputQuant
from quantlab.kernels.triton_act import quantize_rows_int8

torch.manual_seed(0)
for m, k in ((1, 3584), (16, 18944), (512, 3584), (512, 18944), (8192, 3584), (3, 1500)):
    for static in (False, True):
        x = (torch.randn(m, k, device="cuda") * 3).to(torch.bfloat16)
        x[0, :4] = torch.tensor([0.5, 1.5, -2.5, 127.0])
        act = InputQuant("int8", not static, torch.tensor([5.0], device="cuda") if static else None)
        a = act.quantize_torch(x); b = quantize_rows_int8(x, act.absmax); c = act.quantize(x)
        ok = torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(c[0], b[0])
        def host(fn, n=50):
            fn(); torch.cuda.synchronize(); t = time.perf_counter()
            for _ in range(n): fn()
            th = (time.perf_counter() - t) / n * 1e6; torch.cuda.synchronize()
            return th, (time.perf_counter() - t) / n * 1e6
        print(f"M={m} K={k} static={static}: identical={ok}  host/sync µs torch {host(lambda: act.quantize_torch(x))}  triton {host(lambda: quantize_rows_int8(x, act.absmax))}", flush=True)
