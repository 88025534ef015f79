"""GEMM kernels (quantlab.kernels) against their torch references.

The Triton kernels run on the CPU through the Triton interpreter (TRITON_INTERPRET=1, set
below before any triton import; CI has no GPU), at small odd shapes: M, N and K are not tile
multiples (K is any size for WNA16 — the packed weight pads K to 128 — and a multiple of 16 for
the TMA-based W8A8/FP8 kernels). They need the `triton` package (dev extra); without it those
tests are reported as skipped with that reason, and the reference/layout tests still run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from quantlab.kernels import common, layout, ops, reference  # noqa: E402
from quantlab.quant.primitives import QuantizedWeight, quantize_weight  # noqa: E402
from quantlab.quant.scheme import WeightScheme  # noqa: E402

# The interpreter implements the kernels' uint32 bitcast with a numpy cast that warns on wrap.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

needs_triton = pytest.mark.skipif(
    not ops.triton_installed(),
    reason="triton is not installed (add it to the dev extra): Triton kernels untested here")

# ‖y − ref‖/‖ref‖ bounds. Both sides are rounded to the output dtype, and the interpreter
# rounds f32→bf16 by truncation, so bf16 gets ~2 ulps; fp16 outputs are rounded to nearest.
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "non-finite output (unwritten element?)"
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def canonical(n: int, k: int, bits: int, group: int | None, symmetric: bool = False,
              seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    return quantize_weight(w, WeightScheme(bits=bits, symmetric=symmetric, group_size=group))


def act_order(qw: QuantizedWeight, seed: int = 1) -> QuantizedWeight:
    """The same weight with its input columns shuffled: g_idx becomes a permutation of i // G."""
    perm = torch.randperm(qw.codes.shape[1], generator=torch.Generator().manual_seed(seed))
    return QuantizedWeight(qw.codes[:, perm], qw.scales, qw.zeros, qw.g_idx[perm], qw.scheme)


# ------------------------------------------------------------------------------------------
# Layout and reference paths (no triton needed)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_kn_roundtrip(bits):
    codes = torch.randint(0, 2**bits, (256, 40), dtype=torch.uint8)
    words = layout.pack_kn(codes, bits)
    assert words.shape == (256 * bits // 32, 40) and words.dtype == torch.int32
    assert torch.equal(layout.unpack_kn(words, bits), codes)
    # word row r, column n holds k = r·P … r·P + P−1, lowest bits first
    p = 32 // bits
    assert (words[0, 3].item() & (2**bits - 1)) == codes[0, 3].item()
    assert ((words[0, 3].item() >> bits) & (2**bits - 1)) == codes[1, 3].item()
    assert ((words[1, 3].item()) & (2**bits - 1)) == codes[p, 3].item()


@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_k_order_pairs_codes_for_the_mma_fragment(bits):
    """Within each block of 8 words, word j's slots d and d + P/2 hold k = 16d + 2j and
    16d + 2j + 1 (the two halves of one MMA register after `(w >> d·bits) & mask`)."""
    per = 32 // bits
    order = layout.kernel_k_order(256, bits)
    assert torch.equal(order.sort().values, torch.arange(256))
    block = order[: 8 * per].reshape(8, per)  # [word j, slot s]
    for j in range(8):
        for d in range(per // 2):
            assert block[j, d] == 16 * d + 2 * j
            assert block[j, d + per // 2] == 16 * d + 2 * j + 1
    assert torch.equal(order[8 * per: 16 * per], order[: 8 * per] + 8 * per)


@pytest.mark.parametrize("bits,group,symmetric", [(4, 128, False), (4, 32, True), (4, None, False),
                                                  (8, None, True), (8, 64, False)])
def test_dequantize_matches_canonical(bits, group, symmetric):
    qw = canonical(24, 300, bits, group, symmetric)  # 300: K pad and a short tail group
    exact = layout.pack_wna16(qw, torch.bfloat16, scale_dtype=torch.float32)
    assert exact.qweight.shape == (384 * bits // 32, 24)
    assert torch.allclose(layout.dequantize_wna16(exact), qw.dequantize(), rtol=0, atol=1e-6)
    rounded = layout.pack_wna16(qw, torch.bfloat16)  # bf16 scales: one rounding per scale
    assert rel_err(layout.dequantize_wna16(rounded), qw.dequantize()) < 4e-3


def test_act_order_is_repacked_as_a_column_gather():
    qw = act_order(canonical(16, 256, 4, 64))
    p = layout.pack_wna16(qw, torch.float16, scale_dtype=torch.float32)
    assert p.perm is not None
    assert torch.allclose(layout.dequantize_wna16(p), qw.dequantize(), atol=1e-6)
    x = torch.randn(3, 256).half()
    assert rel_err(reference.wna16_mm(x, p), x.float() @ qw.dequantize().t()) < 2e-3


def test_act_order_rejects_non_permutation_gidx():
    qw = canonical(8, 256, 4, 64)
    bad = qw.g_idx.clone()
    bad[:70] = 0  # group 0 now has 70 members
    with pytest.raises(ValueError, match="g_idx"):
        layout.pack_wna16(QuantizedWeight(qw.codes, qw.scales, qw.zeros, bad, qw.scheme))


@pytest.mark.parametrize("symmetric", [True, False])
def test_w8a8_reference_is_exact_integer_math(symmetric):
    qw = canonical(24, 96, 8, None, symmetric)
    p = layout.pack_w8a8(qw)
    assert (p.zc is None) == symmetric
    x = torch.randn(5, 96)
    xq, sx = reference.quantize_act_int8(x)
    assert xq.dtype == torch.int8 and xq.abs().max() <= 127
    expect = (xq.double() * sx.double()[:, None]) @ qw.dequantize().double().t()
    y = reference.w8a8_mm(xq, sx, p, torch.float32)
    assert torch.allclose(y.double(), expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("per_row", [True, False])
def test_fp8_reference(per_row):
    w = torch.randn(24, 64)
    p = layout.quantize_fp8_weight(w, per_row)
    assert p.scale.numel() == (24 if per_row else 1)
    x = torch.randn(5, 64)
    xq, sx = reference.quantize_act_fp8(x, per_row)
    y = reference.fp8_mm(xq, sx, p, torch.float32)
    expect = (xq.float() * (sx[:, None] if per_row else sx)) @ (p.w.float() * p.scale.reshape(-1, 1)).t()
    assert torch.allclose(y, expect, rtol=1e-5, atol=1e-5)
    assert rel_err(y, x @ w.t()) < 0.08  # e4m3 keeps 3 mantissa bits per operand


def test_pack_fp8_from_canonical():
    w = torch.randn(16, 64)
    for scheme in (WeightScheme(type="float", bits=8, group_size=None),
                   WeightScheme(type="float", bits=8, group_size=None, per_tensor=True)):
        qw = quantize_weight(w, scheme)
        p = layout.pack_fp8(qw)
        assert p.scale.numel() == (1 if scheme.per_tensor else 16)
        assert torch.allclose(p.w.float() * p.scale.reshape(-1, 1), qw.dequantize(), atol=1e-6)


def test_dispatch_and_runner_import_no_triton():
    """`quantlab.kernels.ops` and the runner load no triton at import (the kernels import it
    when first run, `register_compiled_ops` before a compile): quantlab loads where triton is
    absent, and this file's TRITON_INTERPRET, set when it is collected, still applies to a
    triton the earlier test files did not import."""
    code = "import sys, quantlab.kernels.ops, quantlab.runner; assert 'triton' not in sys.modules"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_dispatch_falls_back_to_reference_without_triton(monkeypatch):
    qw = canonical(40, 200, 4, 64)
    p = layout.pack_wna16(qw, torch.float16)
    x = torch.randn(2, 3, 200).half()
    bias = torch.randn(40).half()
    monkeypatch.setattr(ops, "use_triton", lambda *a, **k: False)
    y = ops.wna16_linear(x, p, bias)
    assert y.shape == (2, 3, 40)
    ref = reference.wna16_mm(x.reshape(6, 200), p).reshape(2, 3, 40) + bias
    assert torch.equal(y, ref)


# ------------------------------------------------------------------------------------------
# Triton kernels: through the interpreter on a CPU, compiled where a GPU is present

DEV = "cuda" if torch.cuda.is_available() else "cpu"

WNA16_CASES = [  # bits, group, M, impl, config (None = the interpreter default), dtype
    # M = 1: the GEMV (stored-order activations), per-channel or groups of whole blocks
    (4, 128, 1, "auto", None, torch.bfloat16),
    (8, None, 1, "auto", None, torch.float16),
    (8, 64, 1, "auto", dict(BLOCK_N=64, SPLIT_K=4, PF=False), torch.bfloat16),
    (4, 64, 1, "gemv", dict(BLOCK_N=32, SPLIT_K=3, PF=True), torch.float16),  # split ≠ 2^n
    (4, None, 3, "gemv", None, torch.float16),  # one grid row per token
    # the denormal-code GEMV (the interpreter default above) and the magic-number one
    (4, 128, 2, "gemv", dict(BLOCK_N=32, SPLIT_K=3, PF=False, DENORM=True), torch.bfloat16),
    (8, None, 1, "gemv", dict(BLOCK_N=64, SPLIT_K=2, PF=True, DENORM=True), torch.float16),
    (4, 128, 1, "gemv", dict(BLOCK_N=64, SPLIT_K=2, PF=True, DENORM=False), torch.bfloat16),
    # the words through the software pipeline (cp.async on a GPU; plain loads in the interpreter)
    (4, 128, 1, "gemv", dict(BLOCK_N=32, SPLIT_K=3, PF=True, DENORM=True, STAGES=3), torch.bfloat16),
    (8, None, 2, "gemv", dict(BLOCK_N=64, SPLIT_K=2, PF=False, DENORM=False, STAGES=4), torch.float16),
    # tensor cores, default JOIN: whole-iteration operand (int8 under bf16 on a GPU; every
    # case in the interpreter, where FAST — int4 on a GPU — cannot run)
    (4, 32, 1, "auto", dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=1, U=2, PF=False), torch.bfloat16),
    (4, 128, 3, "auto", dict(BLOCK_M=16, BLOCK_N=32, SPLIT_K=3, U=2, PF=True), torch.bfloat16),
    (4, None, 3, "auto", None, torch.float16),
    (8, 256, 37, "auto", None, torch.bfloat16),
    (8, None, 16, "fused", dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=4, U=2, PF=False), torch.bfloat16),
    # tensor cores, JOIN=False: per K = 16 slice (FAST on a GPU for int4; the interpreter runs
    # the same slicing with float32 codes)
    (4, 64, 3, "auto", dict(BLOCK_M=16, BLOCK_N=32, SPLIT_K=2, U=2, PF=False, JOIN=False),
     torch.float16),
    (4, 128, 1, "fused", dict(BLOCK_M=16, BLOCK_N=32, SPLIT_K=2, U=2, PF=True, JOIN=False),
     torch.bfloat16),
    (8, None, 5, "fused", dict(BLOCK_M=16, BLOCK_N=32, SPLIT_K=1, U=1, JOIN=False), torch.bfloat16),
    (8, 64, 37, "auto", dict(BLOCK_M=32, BLOCK_N=32, SPLIT_K=1, U=2, PF=True, JOIN=False),
     torch.float16),
    # ... with the words through TMA descriptors (N past the last tile zero-filled by the copy)
    (4, 128, 3, "fused", dict(BLOCK_M=16, BLOCK_N=32, SPLIT_K=2, U=2, PF=True, JOIN=False, TMA=True),
     torch.bfloat16),
    (8, 64, 37, "auto", dict(BLOCK_M=32, BLOCK_N=64, SPLIT_K=3, U=1, JOIN=False, TMA=True),
     torch.float16),
    # M > 64: dequantize + matmul
    (4, 128, 70, "auto", None, torch.float16),
    (4, 16, 70, "dequant", None, torch.bfloat16),
    (8, None, 5, "dequant", None, torch.float16),
]


@needs_triton
@pytest.mark.parametrize("bits,group,m,impl,config,dtype", WNA16_CASES)
def test_wna16_kernel_matches_reference(bits, group, m, impl, config, dtype):
    from quantlab.kernels.triton_wna16 import wna16_matmul

    qw = canonical(72, 300, bits, group, seed=bits + (group or 0))  # N, K: no tile multiples
    p = layout.pack_wna16(qw, dtype).to(DEV)
    x = torch.randn(m, 300).to(dtype).to(DEV)
    out = torch.full((m, 72), float("nan"), dtype=dtype, device=DEV)
    y = wna16_matmul(x, p, impl=impl, config=config, out=out)
    assert y is out
    assert rel_err(y, reference.wna16_mm(x, p)) < TOL[dtype]


@needs_triton
def test_wna16_tma_words_only_where_a_descriptor_exists():
    """Word rows that are not 16-byte aligned (N = 30) get no TMA descriptor: an explicit
    TMA config is refused with the reason, and the autotuner's prune drops its TMA configs."""
    import types

    from quantlab.kernels import triton_wna16 as tw

    p = layout.pack_wna16(canonical(30, 128, 4, 64, seed=1), torch.bfloat16).to(DEV)
    x = torch.randn(3, 128).to(torch.bfloat16).to(DEV)
    with pytest.raises(ValueError, match="N a multiple of 4"):
        tw.wna16_matmul(x, p, impl="fused", config=dict(BLOCK_M=16, BLOCK_N=32, SPLIT_K=1, U=1,
                                                        JOIN=False, TMA=True))
    args = dict(N=30, NBLK=2, M=3, y_ptr=types.SimpleNamespace(device=torch.device(DEV)))
    assert any(c.kwargs["TMA"] for c in tw.CONFIGS[16])
    for w_desc, tma_kept in ((None, False), (object(), True)):
        kept = tw._prune(tw.CONFIGS[16], dict(args, w_desc=w_desc))
        assert kept and any(c.kwargs["TMA"] for c in kept) == tma_kept


# The Gluon kernel (gluon_wna16: int4 g128 at M ≤ 64 on Hopper) cannot run in the
# interpreter: CPUs compile it for sm_90 (its operand layouts are checked at compile time),
# GPUs also run it.
_GLUON_PTX = """
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon import language as gl
from quantlab.kernels import gluon_wna16 as g
half, bn, bm, atomic, warps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
t = {"bfloat16": "bf16", "float16": "fp16"}[half]
wl = gl.NVMMASharedLayout.get_default_for([16, bn], gl.int32)
xl = gl.NVMMASharedLayout.get_default_for([bm, g.GROUP], getattr(gl, half))
sig = {"w_desc": f"tensordesc<i32[16, {bn}],{wl!r}>",
       "x_desc": f"tensordesc<{t}[{bm}, {g.GROUP}],{xl!r}>",
       "s_ptr": f"*{t}", "z_ptr": f"*{t}", "y_ptr": f"*{t}", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
       "M": "i32", "N": "i32", "NG": "i32", "STAGES": "constexpr", "RED": "constexpr",
       "ATOMIC": "constexpr", "num_warps": "constexpr"}
aligned = {(i,): [["tt.divisibility", 16]] for i in (2, 3, 4, 5, 6, 8)}  # as the JIT sees them
src = GluonASTSource(g._w4_kernel, sig, attrs=aligned,
                     constexprs={"STAGES": 2, "RED": 4, "ATOMIC": atomic, "num_warps": warps})
print(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"])
"""


def compiled_in_subprocess(script: str, *args: str) -> str:
    """What `script` prints, run with `args` by this Python outside the interpreter mode (it
    compiles kernels for sm_90, no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


@needs_triton
@pytest.mark.parametrize("half,bn,bm,atomic,warps", [
    ("bfloat16", 128, 16, False, 4), ("float16", 128, 16, True, 4), ("bfloat16", 64, 32, True, 4),
    ("float16", 128, 64, False, 4), ("bfloat16", 64, 64, True, 4), ("bfloat16", 128, 16, True, 8),
    ("float16", 128, 32, False, 8)])
def test_gluon_w4_kernel_compiles_with_register_operands(half, bn, bm, atomic, warps):
    """Compiled for sm_90: each group is 2 blocks × 4 K = 8 slices, one wgmma per slice and
    64-column row tile, whose weight operand comes from registers. The word halves → operand
    step is a renaming (the kernel asserts it); no operand goes through shared memory: every
    shared store comes after the last wgmma (the epilogue's layout change and the split
    counter's broadcast). The split-K partials move 16 bytes at a time: stored and loaded
    back, or added by vector atomics (`red/atom ... add.v4.f32`, one per 4 columns) whose sum is
    loaded once. With 8 warps each warpgroup takes 64 of the 128 columns: one wgmma a slice."""
    ptx = compiled_in_subprocess(_GLUON_PTX, half, str(bn), str(bm), str(int(atomic)), str(warps))
    assert ptx.count("wgmma.mma_async") == 8 * bn // (16 * warps)
    assert f"n{bm}k16" in ptx  # the token tile is wgmma's N
    assert ptx.count("cp.async.bulk.tensor") >= 2
    assert ptx.rfind("wgmma.mma_async") < ptx.find("st.shared")
    assert "ld.global.cg.v4" in ptx and "ld.local" not in ptx
    vector_adds = len(re.findall(r"(?:red|atom)\.global\S*\.add\.v4\.f32", ptx))  # atom: Triton 3.6
    assert vector_adds == (bn * bm // (4 * 32 * warps) if atomic else 0)  # 4 columns a thread


@needs_triton
def test_gluon_w4_path_only_where_it_applies():
    """The auto path takes the Gluon kernel only for int4 g128 at M ≤ 64 on sm_90 CUDA
    tensors; asking for it elsewhere says what it needs."""
    from quantlab.kernels import triton_wna16 as tw

    p = layout.pack_wna16(canonical(128, 256, 4, 128), torch.bfloat16)
    x = torch.randn(4, 256).bfloat16()
    g = tw._gluon()
    assert g is not None and not g.supports(x, p)  # a CPU tensor
    if DEV == "cpu":
        with pytest.raises(ValueError, match="groups of 128"):
            tw.wna16_matmul(x, p, impl="gluon")


@needs_triton
def test_gluon_w4_plan_picks_tiles_that_fit():
    """The token tile is the smallest that holds M; the partials are added atomically unless
    torch is in deterministic mode; 128 columns where they still give enough programs, the
    split for about 3 programs per SM within its cap; a forced column tile must divide N."""
    g = pytest.importorskip("quantlab.kernels.gluon_wna16")

    def grid(pl):
        return pl.block_n, pl.block_m, pl.split

    assert g.plan(1, 256, 8, 132).block_m == 16 and g.plan(17, 256, 8, 132).block_m == 32
    assert g.plan(64, 256, 8, 132).block_m == 64
    assert g.plan(16, 256, 8, 132).atomic
    torch.use_deterministic_algorithms(True)
    try:
        assert not g.plan(16, 256, 8, 132).atomic
    finally:
        torch.use_deterministic_algorithms(False)
    # qwen_down (K = 18944: 148 groups): 28 tiles of 128 × 14 = 392 programs, 3 per SM
    assert g.plan(16, 3584, 148, 132, atomic=True) == g.Plan(128, 16, 14, 2, 4, True)
    assert g.plan(64, 3584, 148, 132, atomic=True) == g.Plan(64, 64, 7, 2, 2, True)
    assert g.plan(16, 18944, 28, 132, atomic=True).split == 3  # qwen_up: 148 tiles × 3
    # 4 tiles of 128 would give 4 × 14 programs: 64 columns; the split at 2 groups each
    assert grid(g.plan(16, 512, 28, 132, atomic=True)) == (64, 16, 14)
    # the ordered sum: at least 3 groups a split at M ≤ 16, 64 columns from 32 tokens
    assert grid(g.plan(16, 3584, 28, 132, atomic=False)) == (64, 16, 8)
    assert g.plan(32, 3584, 148, 132, atomic=False).block_n == 64
    assert g.plan(16, 192, 8, 132).block_n == 64  # N not a multiple of 128
    with pytest.raises(ValueError, match="block_n 128 must divide N = 192"):
        g.plan(16, 192, 8, 132, block_n=128)
    # two warpgroups split 128 columns (16 a warp): 64-column tiles cannot take them
    assert g.plan(16, 3584, 148, 132, atomic=True, warps=8) == g.Plan(128, 16, 14, 2, 4, True, 8)
    with pytest.raises(ValueError, match="8 warps need block_n 128"):
        g.plan(16, 3584, 148, 132, block_n=64, warps=8)
    with pytest.raises(ValueError, match="warps must be 4 or 8"):
        g.plan(16, 3584, 148, 132, warps=2)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="runs on an sm_90 GPU (compiled for sm_90 on every machine above)")
@pytest.mark.parametrize("m,dtype,config", [
    (2, torch.bfloat16, None), (7, torch.float16, {"split": 3, "atomic": False}),
    (16, torch.bfloat16, {"split": 2}), (16, torch.float16, {"split": 1}),
    (1, torch.bfloat16, {"block_n": 64, "red": 8, "atomic": False}),
    (23, torch.bfloat16, {"block_n": 64, "split": 4, "stages": 3}),
    (64, torch.float16, {"split": 5, "atomic": False}), (64, torch.bfloat16, {"split": 5}),
    (16, torch.bfloat16, {"warps": 8, "split": 2}), (40, torch.float16, {"warps": 8, "split": 3, "atomic": False})])
def test_gluon_w4_kernel_matches_reference(m, dtype, config):
    """Against the torch reference and the Triton tensor-core kernel: 256 columns, K = 600
    (padded to 640: the last group reads x's missing columns as zeros), odd token counts in
    16-, 32- and 64-token tiles, splits that leave a program without groups (5 groups over
    3 splits of 2), partials summed in order or added atomically — whose accumulators the
    call leaves zero for the next."""
    from quantlab.kernels import split_k, triton_wna16 as tw

    p = layout.pack_wna16(canonical(256, 600, 4, 128, seed=m), dtype).to(DEV)
    x = torch.randn(m, 600).to(dtype).to(DEV)
    assert tw._gluon().supports(x, p) and tw._auto_path(x, p) != "gluon"  # a small weight
    y = tw.wna16_matmul(x, p, impl="gluon", config=config)
    assert rel_err(y, reference.wna16_mm(x, p)) < TOL[dtype]
    assert rel_err(y, tw.wna16_matmul(x, p, impl="fused")) < TOL[dtype]
    sums = split_k.workspace(x.device, 1, torch.float32, "sums")
    assert not sums.any()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="runs on an sm_90 GPU (compiled for sm_90 on every machine above)")
def test_gluon_w4_kernel_is_deterministic_when_torch_asks():
    """Under `torch.use_deterministic_algorithms(True)` the split-K partials are summed in
    split order: repeated calls agree bit for bit (the atomic adds need not), and with the
    atomic ones up to float32 rounding."""
    from quantlab.kernels import triton_wna16 as tw

    p = layout.pack_wna16(canonical(512, 4096, 4, 128, seed=5), torch.bfloat16).to(DEV)
    x = torch.randn(16, 4096).bfloat16().to(DEV)
    config = {"split": 16}
    torch.use_deterministic_algorithms(True)
    try:
        ys = [tw.wna16_matmul(x, p, impl="gluon", config=config) for _ in range(5)]
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(ys[0], y) for y in ys[1:])
    y_atomic = tw.wna16_matmul(x, p, impl="gluon", config=config)
    assert rel_err(y_atomic, ys[0]) < 1e-3


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="runs on an sm_90 GPU (compiled for sm_90 on every machine above)")
def test_gluon_w4_kernel_is_the_auto_path_for_large_weights():
    """A weight of MIN_WEIGHTS (4096 × 8192) at M = 16 goes through the Gluon kernel by
    default, with its automatic split."""
    from quantlab.kernels import gluon_wna16, triton_wna16 as tw

    p = layout.pack_wna16(canonical(4096, 8192, 4, 128, seed=3), torch.bfloat16).to(DEV)
    x = torch.randn(16, 8192).bfloat16().to(DEV)
    assert p.out_features * p.in_features >= gluon_wna16.MIN_WEIGHTS
    assert tw._auto_path(x, p) == "gluon"
    assert rel_err(tw.wna16_matmul(x, p), reference.wna16_mm(x, p)) < TOL[torch.bfloat16]


def _epilogue_case(n: int, k: int, seed: int):
    """A packed int4 g64 weight `[n, k]`, one bf16 token row and its float32 plain product."""
    p = layout.pack_wna16(canonical(n, k, 4, 64, seed=seed), torch.bfloat16).to(DEV)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16).to(DEV)
    return p, x, reference.wna16_mm(x, p).float(), g


@needs_triton
def test_gemv_epilogue_adds_the_residual_and_weights_the_next_norm():
    """RESIDUAL: `y = x·Wᵀ + residual` and `y·w` (the next RMSNorm's input before its 1/rms),
    each one bf16 rounding away from the float32 math; without w only y is written."""
    from quantlab.kernels import gemv_epilogue as epi
    from quantlab.kernels.triton_wna16 import wna16_gemv_epilogue

    p, x, plain, g = _epilogue_case(200, 300, 3)
    res = torch.randn(1, 200, generator=g).to(torch.bfloat16).to(DEV)
    w = (1 + torch.rand(200, generator=g)).to(torch.bfloat16).to(DEV)
    y, y2 = (torch.full((1, 200), float("nan"), dtype=torch.bfloat16, device=DEV) for _ in range(2))
    wna16_gemv_epilogue(x, p, y, dict(EPI=epi.RESIDUAL, e_row_ptr=res, e_w_ptr=w, e_y2_ptr=y2))
    ref = plain + res.float()
    assert rel_err(y, ref) < TOL[torch.bfloat16] and rel_err(y2, ref * w.float()) < TOL[torch.bfloat16]
    y3 = torch.full((1, 200), float("nan"), dtype=torch.bfloat16, device=DEV)
    wna16_gemv_epilogue(x, p, y3, dict(EPI=epi.RESIDUAL, e_row_ptr=res))
    assert torch.equal(y3, y)


@needs_triton
def test_gemv_epilogue_scales_by_the_rms_and_forms_swiglu():
    """RMS_SWIGLU: the product scaled by 1/rms of another row (RMSNorm's factor, applied after
    the GEMV), then silu(gate)·up of the interleaved column pairs (2j gate, 2j + 1 up)."""
    from quantlab.kernels import gemv_epilogue as epi
    from quantlab.kernels.triton_wna16 import wna16_gemv_epilogue

    p, x, plain, g = _epilogue_case(200, 300, 4)
    row = (5 * torch.randn(1, 300, generator=g)).to(torch.bfloat16).to(DEV)
    out = torch.full((1, 100), float("nan"), dtype=torch.bfloat16, device=DEV)
    wna16_gemv_epilogue(x, p, out, dict(EPI=epi.RMS_SWIGLU, e_row_ptr=row, e_eps=1e-6))
    v = plain * torch.rsqrt(row.float().pow(2).mean() + 1e-6)
    ref = torch.nn.functional.silu(v[:, 0::2]) * v[:, 1::2]
    assert rel_err(out, ref) < TOL[torch.bfloat16], rel_err(out, ref)


@needs_triton
def test_gemv_epilogue_ropes_q_and_k_into_the_cache():
    """RMS_ROPE_CACHE on `[q (3 heads) | k (2) | v (2)]` of 64: the 1/rms factor and the bias,
    rotate-half RoPE on q and k at the position read from the device, q to the output, k and v
    into that position of the caches and nowhere else."""
    from quantlab.kernels import gemv_epilogue as epi
    from quantlab.kernels.triton_wna16 import wna16_gemv_epilogue
    from quantlab.runner.model import RopeArgs, inv_frequencies, rotate_half

    d, hq, hkv, s, pos = 64, 3, 2, 9, 5
    n = d * (hq + 2 * hkv)
    p, x, plain, g = _epilogue_case(n, 300, 6)
    row = torch.randn(1, 300, generator=g).to(torch.bfloat16).to(DEV)
    bias = torch.randn(n, generator=g).to(torch.bfloat16).to(DEV)
    freqs = torch.outer(torch.arange(s, dtype=torch.float), inv_frequencies(RopeArgs(), d))
    cos, sin = torch.cat((freqs, freqs), -1).cos().to(DEV), torch.cat((freqs, freqs), -1).sin().to(DEV)
    kc, vc = (torch.zeros(1, hkv, s, d, dtype=torch.bfloat16, device=DEV) for _ in range(2))
    q = torch.full((1, hq * d), float("nan"), dtype=torch.bfloat16, device=DEV)
    wna16_gemv_epilogue(x, p, q, dict(
        EPI=epi.RMS_ROPE_CACHE, HEAD_D=d, e_row_ptr=row, e_w_ptr=bias, e_eps=1e-5, e_cos_ptr=cos,
        e_sin_ptr=sin, e_pos_ptr=torch.tensor([pos], device=DEV), e_kc_ptr=kc, e_vc_ptr=vc,
        e_nq=hq * d, e_nkv=hkv * d, e_cache_s=s))
    v = plain * torch.rsqrt(row.float().pow(2).mean() + 1e-5) + bias.float()
    qr, kr, vr = v.view(-1, d).split([hq, hkv, hkv])
    rope = lambda t: t * cos[pos] + rotate_half(t) * sin[pos]  # noqa: E731
    tol = TOL[torch.bfloat16]
    assert rel_err(q.view(hq, d), rope(qr)) < tol
    assert rel_err(kc[0, :, pos], rope(kr)) < tol and rel_err(vc[0, :, pos], vr) < tol
    others = [i for i in range(s) if i != pos]
    assert not kc[0, :, others].any() and not vc[0, :, others].any()


def _w4a16_qwen2():
    """A tiny W4A16 qwen2 runner (q/k/v biases, non-unit norm weights), a 6-token prompt and
    the next token."""
    from conftest import tiny_model
    from quantlab.runner.load import build_runner

    hf = tiny_model("qwen2", seed=2, hidden_size=128, intermediate_size=160)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    for name, t in state.items():
        if name.endswith("norm.weight"):
            t.copy_(0.5 + torch.rand(t.shape, generator=g))
    quantized = {name[:-len(".weight")]: quantize_weight(t, WeightScheme(bits=4, group_size=64))
                 for name, t in state.items() if name.endswith("_proj.weight")}
    model = build_runner(hf.config, state, quantized, {}, {}, DEV, torch.bfloat16)
    return model, torch.randint(0, 512, (1, 6), generator=g).to(DEV), torch.tensor([[7]], device=DEV)


@needs_triton
def test_fused_decode_step_matches_the_unfused_one():
    """`set_fused_decode`: a batch-1 decode step of a W4A16 qwen2 (q/k/v biases, non-unit norm
    weights) as four epilogue GEMVs and the attention's partials per layer gives the unfused
    step's logits and writes the same K/V into the cache; its interleaved gate_up leaves the
    prefill (the unfused path) as it was."""
    model, prompt, nxt = _w4a16_qwen2()

    def run(fused: bool):
        model.setup_caches(1, 12)
        model.fused_layers = False
        pre = model(prompt, torch.arange(6, device=DEV))
        model.fused_layers = fused
        step = model(nxt, torch.tensor([6], device=DEV))
        caches = [(layer.self_attn.kv_cache.k.clone(), layer.self_attn.kv_cache.v.clone()) for layer in model.model.layers]
        return pre, step, caches

    pre_u, step_u, caches_u = run(False)
    assert model.set_fused_decode(True) and all(layer.mlp.interleaved for layer in model.model.layers)
    pre_i, step_u2, _ = run(False)
    assert torch.equal(pre_i, pre_u) and torch.equal(step_u2, step_u)
    pre_f, step_f, caches_f = run(True)
    assert torch.equal(pre_f, pre_u)
    tol = TOL[torch.bfloat16]
    assert 0 < rel_err(step_f, step_u) < tol, rel_err(step_f, step_u)  # one rounding per op fewer
    for (ku, vu), (kf, vf) in zip(caches_u, caches_f):
        assert torch.equal(kf[:, :, :6], ku[:, :, :6]) and rel_err(kf[:, :, 6], ku[:, :, 6]) < tol
        assert rel_err(vf[:, :, 6], vu[:, :, 6]) < tol


@needs_triton
def test_fused_decode_step_traces_as_one_graph():
    """Under torch.compile the fused step is one graph of custom ops (the epilogue GEMVs, whose
    cache writes are declared, and the attention's partials, whose shapes the fake op gives)
    with the eager step's logits."""
    model, prompt, nxt = _w4a16_qwen2()
    model.setup_caches(1, 12)
    model(prompt, torch.arange(6, device=DEV))
    assert model.set_fused_decode(True)
    pos = torch.tensor([6], device=DEV)
    eager = model(nxt, pos)
    traced = torch.compile(lambda: model(nxt, pos), backend="aot_eager", fullgraph=True)()
    assert torch.equal(traced, eager)


if ops.triton_installed():
    import triton
    import triton.language as tl

    from quantlab.kernels import triton_wna16

    @triton.jit
    def _stored_k_probe(out_ptr, BITS: tl.constexpr, N: tl.constexpr):
        pos = tl.arange(0, N)
        tl.store(out_ptr + pos, triton_wna16._stored_k(pos, BITS))


@needs_triton
@pytest.mark.parametrize("bits", [4, 8])
def test_stored_k_is_the_layout_order(bits):
    """The kernels' in-register inverse of the packing (stored position → source k), which
    the GEMV and JOIN use to gather activations in stored order."""
    out = torch.empty(256, dtype=torch.int32, device=DEV)
    _stored_k_probe[(1,)](out, BITS=bits, N=256)
    assert torch.equal(out.cpu().long(), layout.kernel_k_order(256, bits))


@needs_triton
@pytest.mark.parametrize("magnitude,dtype", [(1e-12, torch.bfloat16), (1.0, torch.float16),
                                             (3e4, torch.bfloat16)])
@pytest.mark.parametrize("bits", [4, 8])
def test_gemv_denormal_codes_over_activation_magnitudes(bits, magnitude, dtype):
    """The denormal-code GEMV (codes as float32 denormals, activations scaled by 2^(64 − sh))
    is as accurate as the magic-number one for tiny and large activations: no product falls
    into the denormal range or overflows."""
    from quantlab.kernels.triton_wna16 import wna16_matmul

    p = layout.pack_wna16(canonical(72, 300, bits, 64, seed=7), dtype).to(DEV)
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(1, 300, dtype=torch.float64, generator=g) * magnitude).to(dtype).to(DEV)
    ref = reference.wna16_mm(x, p)
    errs = [rel_err(wna16_matmul(x, p, impl="gemv", config=dict(BLOCK_N=64, SPLIT_K=2, DENORM=d)),
                    ref) for d in (False, True)]
    assert errs[1] < TOL[dtype] and errs[1] <= 1.5 * errs[0] + 1e-6, f"(magic, denormal): {errs}"


# Compiled ahead of time for sm_90 in a child process: under TRITON_INTERPRET=1 (set above)
# `triton.jit` gives interpreter functions, which cannot be compiled.
_PTX = """
import importlib, json, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, kernel, sig, consts, options = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(module), kernel)
src = ASTSource(fn, {**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
print(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"])
"""


def sm90_ptx(module: str, kernel: str, sig: dict, consts: dict, **options) -> list[str]:
    """The kernel's PTX for an H100 (no GPU needed), as stripped lines."""
    import json

    ptx = compiled_in_subprocess(_PTX, json.dumps([module, kernel, sig, consts, options]))
    return [ln.strip() for ln in ptx.splitlines()]


def _first(lines: list[str], prefix: str) -> int:
    return next(i for i, ln in enumerate(lines) if ln.startswith(prefix))


GEMV_SIG = {**{n: "*bf16" for n in ("x_ptr", "s_ptr", "z_ptr", "y_ptr")}, "qw_ptr": "*i32", "ws_ptr": "*fp32",
            "cnt_ptr": "*i32", **{n: "i32" for n in ("M", "N", "K", "NBLK", "NG", "stride_xm", "stride_ym",
                                                      "magic32", "SPLIT_K")}}
# The epilogue inputs at their defaults (no epilogue), as constexprs.
GEMV_PLAIN = {"EPI": 0, "HEAD_D": 128, "ATOMIC": False, "e_eps": 0.0, "e_nq": 0, "e_nkv": 0, "e_cache_s": 0,
              **{f"e_{n}_ptr": None for n in ("row", "w", "y2", "cos", "sin", "pos", "kc", "vc")},
              **{f"c_{n}_ptr": None for n in ("m", "l", "acc")}, "c_nsplit": 1, "c_group": 1, "C_BLOCK_G": 16,
              "C_NSPLIT_P2": 1}


@needs_triton
@pytest.mark.parametrize("stages,epi,trigger,atomic", [(1, 0, 2, False), (3, 0, 2, True), (3, 2, 2, False),
                                                      (1, 2, 3, False), (1, 1, 3, False)])
def test_gemv_pdl_waits_before_reading_activations(stages, epi, trigger, atomic):
    """With PDL (QUANTLAB_PDL=1, `benchmarks/decode.py --pdl`) the GEMV may start while the kernel
    that writes its activations is still running: compiled for sm_90 (on the CPU, no GPU
    needed), it lets the next kernel launch before any load, and every 16-bit load
    (activations, scales, zeros) and workspace atomic comes after `griddepcontrol.wait`. The
    register-prefetch GEMV (STAGES = 1) loads weight words before the wait; the staged one
    copies them into shared memory with cp.async (Triton's software pipeline). Without PDL no
    grid-dependency instruction is emitted. The RMS_SWIGLU epilogue (epi 2) reads its normed
    row after the wait too. With the trigger after the wait (3) the next kernel launches only
    once the wait is over. o_proj's RESIDUAL GEMV (epi 1) combines the attention's partials
    into its input after the wait. So do the atomic adds of the partials (ATOMIC): the
    previous GEMV's last splits zero the accumulators before it completes."""
    consts = dict(BITS=4, GROUP=128, BLOCK_N=128, SPLIT_P2=8, PF=True, DENORM=True,
                  STAGES=stages, **{**GEMV_PLAIN, "EPI": epi, "ATOMIC": atomic})
    sig = dict(GEMV_SIG)
    if epi:
        del consts["e_row_ptr"], consts["e_eps"]
        sig.update(e_row_ptr="*bf16", e_eps="fp32")
    if epi == 1:
        for n in ("c_m_ptr", "c_l_ptr", "c_acc_ptr", "c_nsplit", "c_group"):
            del consts[n]
        sig.update(c_m_ptr="*fp32", c_l_ptr="*fp32", c_acc_ptr="*fp32", c_nsplit="i32", c_group="i32")
        consts.update(C_BLOCK_G=16, C_NSPLIT_P2=32)
    mod = "quantlab.kernels.triton_wna16"
    if not epi:  # the build without PDL, once per stage count (the epilogues change no launch)
        plain = sm90_ptx(mod, "_gemv_kernel", sig, {**consts, "PDL": 0}, num_warps=1, num_stages=1)
        assert not any("griddepcontrol" in ln for ln in plain)
        assert any("cp.async" in ln for ln in plain) == (stages > 1)
    lines = sm90_ptx(mod, "_gemv_kernel", sig, {**consts, "PDL": trigger}, num_warps=1, num_stages=1,
                     launch_pdl=True)
    wait, launch = _first(lines, "griddepcontrol.wait"), _first(lines, "griddepcontrol.launch_dependents")
    reads = [i for i, ln in enumerate(lines) if "ld.global" in ln or "cp.async.c" in ln]
    assert launch < reads[0] if trigger == 2 else wait < launch
    halves = [i for i in reads if ".b16" in lines[i] or ".u16" in lines[i] or ", 0x2" in lines[i]]
    assert halves and all(i > wait for i in halves)
    atomics = [i for i, ln in enumerate(lines) if re.search(r"\b(atom|red)\.global", ln)]
    assert atomics and all(i > wait for i in atomics)
    assert any(".add.v4.f32" in lines[i] or ".add.f32" in lines[i] for i in atomics) == atomic
    if stages == 1:
        assert any("ld.global.b32" in lines[i] or "ld.global.v" in lines[i] for i in reads if i < wait)
    else:
        assert any("cp.async" in lines[i] and ", 0x4" in lines[i] for i in reads)


@needs_triton
def test_attention_pdl_waits_before_every_load():
    """Everything the attention kernels read (q, the cache, the mask, the partials) comes from
    earlier kernels: under PDL each waits before its first global load, and lets the next
    kernel launch before or after that wait as the trigger says."""
    mod = "quantlab.kernels.triton_attention"
    partial_sig = {**{n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr")},
                   **{n: "*fp32" for n in ("ks_ptr", "vs_ptr", "m_ptr", "l_ptr", "acc_ptr")},
                   "mask_ptr": "*i8", "start_ptr": "*i64", "pos_ptr": "*i64", "sm_scale": "fp32",
                   **{n: "i32" for n in ("S", "KVH", "CHUNK", "stride_qb", "stride_qh", "stride_kb", "stride_kh",
                                         "stride_ks", "stride_vb", "stride_vh", "stride_vs", "stride_mb")}}
    combine_sig = {**{n: "*fp32" for n in ("m_ptr", "l_ptr", "acc_ptr")}, "out_ptr": "*bf16",
                   **{n: "i32" for n in ("NSPLIT", "KVH", "stride_ob", "stride_oh")}}
    for kernel, sig, consts in (
            ("_partial_kernel", partial_sig, dict(GROUP=7, BLOCK_G=16, D=128, BLOCK_S=32, CODES=False, UPCAST=False)),
            ("_combine_kernel", combine_sig, dict(GROUP=7, BLOCK_G=16, D=128, NSPLIT_P2=32))):
        for trigger in (ops.PdlTrigger.START, ops.PdlTrigger.AFTER_WAIT):
            lines = sm90_ptx(mod, kernel, sig, {**consts, "PDL": int(trigger)}, num_warps=4, launch_pdl=True)
            wait, launch = _first(lines, "griddepcontrol.wait"), _first(lines, "griddepcontrol.launch_dependents")
            assert wait < min(i for i, ln in enumerate(lines) if "ld.global" in ln), kernel
            assert (launch < wait) == (trigger == ops.PdlTrigger.START), (kernel, trigger)


@needs_triton
def test_pdl_is_requested_only_on_hopper_launches(monkeypatch):
    """QUANTLAB_PDL=1 adds the PDL launch options to GEMV launches where `pdl_on` holds (sm_90+,
    compiled), never under the interpreter, with the trigger QUANTLAB_PDL_TRIGGER names (after
    the wait by default); the compiled decode step asks Inductor for PDL."""
    from quantlab.kernels import triton_wna16
    from quantlab.runner.generate import compile_options

    monkeypatch.delenv("QUANTLAB_PDL_TRIGGER", raising=False)
    assert compile_options() == {"triton.cudagraphs": True}
    monkeypatch.setenv("QUANTLAB_PDL", "1")
    assert compile_options() == {"triton.cudagraphs": True, "triton.enable_pdl": True}
    assert not ops.pdl_on(torch.zeros(1, device=DEV)) or DEV == "cuda"
    seen: dict = {}

    class Launch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.update(kwargs)

    monkeypatch.setattr(triton_wna16, "_gemv_kernel", Launch())
    monkeypatch.setattr(common, "pdl_on", lambda t: True)
    p = layout.pack_wna16(canonical(16, 128, 4, 64), torch.bfloat16).to(DEV)
    x = torch.randn(1, 128).bfloat16().to(DEV)
    for trigger, mode in ((None, ops.PdlTrigger.AFTER_WAIT), ("start", ops.PdlTrigger.START),
                          ("wait", ops.PdlTrigger.AFTER_WAIT)):
        if trigger:
            monkeypatch.setenv("QUANTLAB_PDL_TRIGGER", trigger)
        triton_wna16.wna16_matmul(x, p, impl="gemv", config=dict(BLOCK_N=64, SPLIT_K=2))
        assert seen["PDL"] == mode and seen["launch_pdl"] is True
    monkeypatch.setenv("QUANTLAB_PDL_TRIGGER", "end")
    with pytest.raises(ValueError, match="QUANTLAB_PDL_TRIGGER"):
        triton_wna16.wna16_matmul(x, p, impl="gemv", config=dict(BLOCK_N=64, SPLIT_K=2))


def _attention_case(dtype, cache: str, seed: int = 0):
    """q, the cache (float or 8-bit codes with per-head scales), a left-padded mask and the
    step's position; the torch decode path (`runner.model.attend` over `codes.decode`) as the
    reference. S = 45 is no multiple of the kernel's 32-key block; 3 query heads per KV head."""
    from quantlab.runner.codes import decode, encode
    from quantlab.runner.model import attend

    g = torch.Generator().manual_seed(seed)
    b, h, kvh, s, d = 2, 6, 2, 45, 16
    q = torch.randn(b, h, d, generator=g).to(dtype)
    k, v = (torch.randn(b, kvh, s, d, generator=g) for _ in range(2))
    pos, pad = 37, torch.tensor([0, 5])
    keys = torch.arange(s)
    mask = (keys[None, :] <= pos) & (keys[None, :] >= pad[:, None])
    scales = (None, None)
    if cache != "float":
        scales = tuple(torch.rand(kvh, generator=g) * 0.05 + 0.01 for _ in range(2))
        k, v = (encode(t, sc.view(1, -1, 1, 1), cache) for t, sc in zip((k, v), scales))
        k_ref, v_ref = (decode(t, sc.view(1, -1, 1, 1), dtype) for t, sc in zip((k, v), scales))
    else:
        k, v = k.to(dtype), v.to(dtype)
        k_ref, v_ref = k, v
    ref = attend(q[:, :, None], k_ref, v_ref, mask[:, None, None, :])[:, :, 0]
    if cache != "float":  # the exact cache values, not rounded to the compute dtype
        k_ref, v_ref = (decode(t, sc.view(1, -1, 1, 1), torch.float64) for t, sc in zip((k, v), scales))
    truth = attend(q[:, :, None].double(), k_ref.double(), v_ref.double(), mask[:, None, None, :])[:, :, 0]
    return (q, k, v, mask, torch.tensor([pos]), *scales), ref, truth


@needs_triton
@pytest.mark.parametrize("cache", ["float", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_the_torch_path(dtype, cache):
    """Flash-decoding over the static cache, as stored (C8 codes dequantized per key block),
    against the runner's torch decode path: float32 agrees to rounding. In bf16 the two round
    differently (the kernel keeps float32 scores; the interpreter truncates f32 → bf16, also
    where it dequantizes codes), so each is checked against float64: the kernel's error stays
    within 3× the torch path's own."""
    from quantlab.kernels.triton_attention import decode_attention

    args, ref, truth = _attention_case(dtype, cache)
    out = decode_attention(*(a.to(DEV) if a is not None else None for a in args)).cpu()
    assert out.dtype == dtype and out.shape == ref.shape
    if dtype == torch.float32:
        assert rel_err(out, ref) < 1e-5, rel_err(out, ref)
    else:
        assert rel_err(out, truth) < 3 * rel_err(ref, truth), (rel_err(out, truth), rel_err(ref, truth))


@needs_triton
def test_decode_attention_never_reads_past_the_step():
    """Keys after the step's position are not read even where the mask allows them (a captured
    graph attends over the whole cache): NaNs stored there change nothing."""
    from quantlab.kernels.triton_attention import decode_attention

    (q, k, v, mask, pos, *_), ref, _ = _attention_case(torch.float32, "float", seed=3)
    k[:, :, 38:], v[:, :, 38:] = float("nan"), float("nan")
    out = decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), torch.ones_like(mask).to(DEV), pos.to(DEV)).cpu()
    assert torch.isfinite(out).all()
    dense = decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), mask.to(DEV), pos.to(DEV)).cpu()
    assert rel_err(dense, ref) < 1e-5


@needs_triton
def test_attention_from_the_rows_first_positions_equals_the_masked_one():
    """Without a mask each row sees the keys from its first non-pad position (`start`) to the
    step's: the same keys as the left-padded mask, so the same bits."""
    from quantlab.kernels.triton_attention import attention_partials, combine, decode_attention

    (q, k, v, mask, pos, *_), ref, _ = _attention_case(torch.float32, "float", seed=5)
    q, k, v, mask, pos = (t.to(DEV) for t in (q, k, v, mask, pos))
    masked = decode_attention(q, k, v, mask, pos)
    from_start = combine(attention_partials(q, k, v, None, pos, torch.tensor([0, 5], device=DEV)), q)
    assert torch.equal(from_start, masked) and rel_err(masked.cpu(), ref) < 1e-5


@needs_triton
def test_gemv_combines_the_attention_partials_in_its_prologue():
    """o_proj's GEMV forming its input from the attention's partials (`combine_heads`) gives
    the bits of the GEMV on the two-launch attention's output, whatever K range each split
    covers (split 3 of 4 heads of 64: ranges that end inside a head)."""
    from quantlab.kernels import gemv_epilogue as epi
    from quantlab.kernels.triton_attention import attention_partials, combine, prologue_args
    from quantlab.kernels.triton_wna16 import wna16_gemv_epilogue

    g = torch.Generator().manual_seed(4)
    h, kvh, s, d, n = 4, 2, 40, 64, 96
    q = torch.randn(1, h, d, generator=g).bfloat16().to(DEV)
    k, v = (torch.randn(1, kvh, s, d, generator=g).bfloat16().to(DEV) for _ in range(2))
    parts = attention_partials(q, k, v, None, torch.tensor([33], device=DEV), torch.zeros(1, dtype=torch.long, device=DEV))
    y = combine(parts, q).view(1, h * d)
    p = layout.pack_wna16(canonical(n, h * d, 4, 64, seed=2), torch.bfloat16).to(DEV)
    res = torch.randn(1, n, generator=g).bfloat16().to(DEV)
    want = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    config = dict(BLOCK_N=64, SPLIT_K=3, PF=True, DENORM=True)
    wna16_gemv_epilogue(y, p, want, dict(EPI=epi.RESIDUAL, e_row_ptr=res), config)
    row = torch.full((1, h * d), float("nan"), dtype=torch.bfloat16, device=DEV)
    got = torch.full_like(want, float("nan"))
    wna16_gemv_epilogue(row, p, got, dict(EPI=epi.RESIDUAL, e_row_ptr=res, **prologue_args(parts, h)),
                        config)
    assert torch.equal(row, y) and torch.equal(got, want)


@needs_triton
@pytest.mark.parametrize("cache", ["float", "int8", "fp8"])
def test_runner_decodes_through_the_attention_kernel(monkeypatch, cache):
    """`Transformer.set_attention("triton")`: every decode step's attention goes through the
    kernel, reading the cache as stored (C8 codes too), with a left-padded row and the whole
    cache attended (as under CUDA graphs); logits match the torch path's."""
    from conftest import tiny_model
    from quantlab.errors import UserError
    from quantlab.runner import from_hf_model
    from quantlab.runner.kv import KVQuant

    calls = []
    direct = ops._decode_attention_direct
    monkeypatch.setattr(ops, "_decode_attention_direct", lambda *a: calls.append(1) or direct(*a))
    runner = from_hf_model(tiny_model("llama", seed=2)).to(DEV)
    if cache != "float":
        absmax = torch.tensor([3.0, 4.0])  # per KV head; K/V of the tiny model stay within
        for layer in runner.model.layers:
            layer.self_attn.kv_quant = KVQuant.from_absmax(cache, absmax, absmax * 0.5, per_head=True)
        runner.max_batch = 0  # rebuild the caches with codes
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(7)).to(DEV)

    def decode_logits() -> torch.Tensor:
        runner.setup_caches(2, 24)
        runner.set_padding(torch.tensor([0, 3]))  # row 1: three leading pad positions
        out = [runner(ids[:, :6], torch.arange(6, device=DEV))]
        out += [runner(ids[:, t:t + 1], torch.tensor([t], device=DEV)) for t in range(6, 16)]
        return torch.cat(out, 1).cpu()

    ref = decode_logits()
    runner.set_attention("triton")
    got = decode_logits()
    assert len(calls) == 10 * len(runner.model.layers)  # every decode step, every layer
    assert (got - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
    if cache != "float":
        assert runner.model.layers[0].self_attn.kv_cache.k.dtype != torch.float32
    with pytest.raises(UserError, match="attention: choose from torch, triton"):
        runner.set_attention("flash")


@needs_triton
def test_wna16_gemv_rejects_groups_smaller_than_a_block():
    from quantlab.kernels.triton_wna16 import wna16_matmul

    p = layout.pack_wna16(canonical(16, 128, 4, 32), torch.float16).to(DEV)
    assert not p.gemv_ok
    x = torch.randn(1, 128).half().to(DEV)
    with pytest.raises(ValueError, match="GEMV"):
        wna16_matmul(x, p, impl="gemv")
    with pytest.raises(ValueError, match="impl"):
        wna16_matmul(x, p, impl="nope")


@needs_triton
def test_split_k_candidates_fill_whole_waves():
    """Per shape the autotuner also gets the splits that put W programs on each SM: for the
    Qwen2-7B up projection's GEMV (74 tiles of 256 columns, 132 SMs) that includes split 7 =
    518 programs, one full wave at 4 resident programs per SM, which no power of 2 gives."""
    from quantlab.kernels import triton_wna16 as tw

    base = [c for c in tw.GEMV_CONFIGS if c.num_warps == 2 and c.kwargs["SPLIT_K"] == 8]
    cands = tw._split_candidates(base, lambda c: 74, 132)
    splits = {c.kwargs["SPLIT_K"]: c.kwargs["SPLIT_P2"] for c in cands}
    assert splits[7] == 8 and splits[8] == 8 and splits[2] == 2
    assert len(cands) == len({(tuple(sorted(c.kwargs.items())), c.maxnreg) for c in cands})


@needs_triton
@pytest.mark.parametrize("impl,cfg", [
    ("fused", dict(BLOCK_M=16, BLOCK_N=32, SPLIT_K=3, U=1, PF=True)),
    ("gemv", dict(BLOCK_N=32, SPLIT_K=4, PF=True)),
    ("gemv", dict(BLOCK_N=32, SPLIT_K=2, PF=False)),
    ("gemv", dict(BLOCK_N=32, SPLIT_K=5, PF=True)),
    ("gemv", dict(BLOCK_N=32, SPLIT_K=3, PF=True, ATOMIC=False)),
])
def test_wna16_split_k_counters_are_left_clean(impl, cfg):
    """The last split resets its tile counter (and the GEMV's, adding its partials atomically,
    its accumulators): a second call (other data, same buffers) must be right too, and the
    counters and accumulators must be zero afterwards."""
    from quantlab.kernels import split_k, triton_wna16 as tw

    qw = canonical(40, 384, 4, 128)
    p = layout.pack_wna16(qw, torch.float16).to(DEV)
    for seed in (0, 1):
        x = torch.randn(2, 384, generator=torch.Generator().manual_seed(seed)).half().to(DEV)
        y = tw.wna16_matmul(x, p, impl=impl, config=cfg)
        assert rel_err(y, reference.wna16_mm(x, p)) < TOL[torch.float16]
    assert not split_k._WORKSPACE[(str(x.device), torch.int32, "partials")].any()
    assert not split_k.workspace(x.device, 1, torch.float32, "sums").any()


@needs_triton
def test_wna16_gemv_sums_in_split_order_when_torch_asks():
    """Under torch's deterministic mode the GEMV stores its partials and the last split sums
    them in split order (a dirty accumulator buffer would show if it added them atomically);
    otherwise it adds them into the accumulators. Both match the reference."""
    from quantlab.kernels import split_k, triton_wna16 as tw

    p = layout.pack_wna16(canonical(64, 512, 4, 128, seed=4), torch.float16).to(DEV)
    x = torch.randn(1, 512).half().to(DEV)
    cfg = dict(BLOCK_N=32, SPLIT_K=4, PF=True)
    ref = reference.wna16_mm(x, p)
    sums = split_k.split_accumulators(x.device, 1, 64)[0]
    sums.fill_(1.0)
    torch.use_deterministic_algorithms(True)
    try:
        assert rel_err(tw.wna16_matmul(x, p, impl="gemv", config=cfg), ref) < TOL[torch.float16]
    finally:
        torch.use_deterministic_algorithms(False)
    sums.zero_()
    assert split_k.atomic_sums()
    assert rel_err(tw.wna16_matmul(x, p, impl="gemv", config=cfg), ref) < TOL[torch.float16]
    assert not sums.any()


@needs_triton
@pytest.mark.parametrize("m", [1, 2])  # the GEMV and the tensor-core kernel
def test_wna16_act_order_kernel(m):
    from quantlab.kernels.triton_wna16 import wna16_matmul

    qw = act_order(canonical(40, 256, 4, 64))
    p = layout.pack_wna16(qw, torch.float16).to(DEV)
    x = torch.randn(m, 256).half()
    y = wna16_matmul(x.to(DEV), p)
    assert rel_err(y.cpu(), x.float() @ qw.dequantize().t()) < 3e-3


# How the scaled kernel walks its tiles: one program per tile, persistent programs (fewer than
# tiles: 4 on a CPU; 6 tiles at M = 37), the same with the last wave's K loops split (not at
# K = 96: 3 K steps are too few to split), or the K loop (3 tiles of 32) split across programs.
SCALED_MODES = {"tile": {}, "persistent": {"PERSISTENT": True},
                "split_tail": {"PERSISTENT": True, "SPLIT_TAIL": True}, "split2": {"SPLIT_K": 2},
                "split3": {"SPLIT_K": 3}, "tma_store": {"TMA_STORE": True},
                "persistent_tma_store": {"PERSISTENT": True, "TMA_STORE": True}}


def _scaled_config(mode: str) -> dict | None:
    from quantlab.kernels.triton_scaled import INTERPRET_CONFIG

    return {**INTERPRET_CONFIG, **SCALED_MODES[mode]} if SCALED_MODES[mode] else None


@needs_triton
@pytest.mark.parametrize("m", [1, 37])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("mode", list(SCALED_MODES))
def test_w8a8_kernel_matches_reference(m, symmetric, mode):
    from quantlab.kernels.triton_scaled import w8a8_matmul

    qw = canonical(72, 96, 8, None, symmetric)
    p = layout.pack_w8a8(qw).to(DEV)
    xq, sx = reference.quantize_act_int8(torch.randn(m, 96, device=DEV))
    out = torch.full((m, 72), float("nan"), dtype=torch.float16, device=DEV)
    y = w8a8_matmul(xq, sx, p, torch.float16, config=_scaled_config(mode), out=out)
    assert rel_err(y, reference.w8a8_mm(xq, sx, p, torch.float16)) < TOL[torch.float16]
    if mode != "tile":  # int32 partials sum exactly: the same bits as one program per tile
        assert torch.equal(y, w8a8_matmul(xq, sx, p, torch.float16))


@needs_triton
@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("mode", ["tile", "split3", "persistent_tma_store"])
def test_fp8_kernel_matches_reference(per_row, mode):
    from quantlab.kernels import split_k
    from quantlab.kernels.triton_scaled import fp8_matmul

    p = layout.quantize_fp8_weight(torch.randn(72, 96), per_row).to(DEV)
    for seed in (0, 1):  # a second call on the same split-K buffers
        g = torch.Generator().manual_seed(seed)
        xq, sx = reference.quantize_act_fp8(torch.randn(37, 96, generator=g).to(DEV), per_row)
        out = torch.full((37, 72), float("nan"), dtype=torch.bfloat16, device=DEV)
        y = fp8_matmul(xq, sx, p, torch.bfloat16, config=_scaled_config(mode), out=out)
        assert rel_err(y, reference.fp8_mm(xq, sx, p, torch.bfloat16)) < TOL[torch.bfloat16]
    if mode == "split3":
        assert not split_k._WORKSPACE[(str(xq.device), torch.int32, "partials")].any()


@needs_triton
def test_tma_store_needs_aligned_output_rows():
    """A TMA store takes rows that start 16 bytes apart: an explicit TMA_STORE config on an
    fp16 output of N = 36 (72-byte rows) is refused with the reason; autotuned large-M calls
    drop the TMA-store configs there instead (`_stores`) and keep them where N allows."""
    from quantlab.kernels import triton_scaled as ts

    p = layout.quantize_fp8_weight(torch.randn(36, 64)).to(DEV)
    xq, sx = reference.quantize_act_fp8(torch.randn(5, 64).to(DEV), True)
    with pytest.raises(ValueError, match="16-byte aligned"):
        ts.fp8_matmul(xq, sx, p, torch.float16, config=_scaled_config("tma_store"))
    y = ts.fp8_matmul(xq, sx, p, torch.float16, config=_scaled_config("tile"))
    assert rel_err(y, reference.fp8_mm(xq, sx, p, torch.float16)) < TOL[torch.float16]
    tma = [c for c in ts.LARGE_M_CONFIGS if c.kwargs["TMA_STORE"]]
    assert tma and all(c.kwargs["PERSISTENT"] and not c.kwargs["SPLIT_TAIL"] for c in tma)
    assert ts._stores(ts.LARGE_M_CONFIGS, {"y_desc": None}) == [
        c for c in ts.LARGE_M_CONFIGS if c not in tma]
    assert ts._stores(ts.LARGE_M_CONFIGS, {"y_desc": object()}) == ts.LARGE_M_CONFIGS
    assert ts._store_desc(torch.empty(4, 36, dtype=torch.float16)) is None
    assert ts._store_desc(torch.empty(4, 40, dtype=torch.float16)) is not None
    # an autotuner config as `retime_top` launches it: the TMA store on N = 40 (80-byte rows)
    p = layout.quantize_fp8_weight(torch.randn(40, 64)).to(DEV)
    cfg = ts._config_dict(ts._cfg(32, 32, 32, 4, 2, group_m=2, persistent=True, tma_store=True))
    y = ts.fp8_matmul(xq, sx, p, torch.float16, config=cfg)
    assert rel_err(y, reference.fp8_mm(xq, sx, p, torch.float16)) < TOL[torch.float16]


@needs_triton
@pytest.mark.parametrize("m", [37, 96, 160])
def test_split_tail_splits_the_last_wave(m):
    """4 persistent programs on a CPU, tiles of 32 × 32 × 32, K = 2048 (64 K steps): at M = 37 the
    last wave is 2 of 6 tiles, split in 2 (one round of half tiles), at M = 96 1 of 9, split
    in 4; at M = 160 (3 of 15) no split beats a whole round. The counters are zero again
    after, and int8 gives the same bits as one program per tile."""
    from quantlab.kernels import split_k
    from quantlab.kernels.triton_scaled import fp8_matmul, w8a8_matmul

    g = torch.Generator().manual_seed(m)
    config = _scaled_config("split_tail")
    p8 = layout.pack_w8a8(canonical(72, 2048, 8, None, False)).to(DEV)
    xq, sx = reference.quantize_act_int8(torch.randn(m, 2048, generator=g).to(DEV))
    y = w8a8_matmul(xq, sx, p8, torch.float16, config=config)
    assert torch.equal(y, w8a8_matmul(xq, sx, p8, torch.float16, config=_scaled_config("tile")))
    pf = layout.quantize_fp8_weight(torch.randn(72, 2048, generator=g)).to(DEV)
    xf, sf = reference.quantize_act_fp8(torch.randn(m, 2048, generator=g).to(DEV), True)
    out = torch.full((m, 72), float("nan"), dtype=torch.bfloat16, device=DEV)
    y = fp8_matmul(xf, sf, pf, torch.bfloat16, config=config, out=out)
    assert rel_err(y, reference.fp8_mm(xf, sf, pf, torch.bfloat16)) < TOL[torch.bfloat16]
    assert not split_k._WORKSPACE[(str(xf.device), torch.int32, "partials")].any()


# The Gluon W8A8/FP8 kernel (gluon_scaled, M > 64 on Hopper): CPUs compile it for sm_90 and
# check its K loop in the PTX and in ptxas' report; GPUs also run it.
_GLUON_SCALED_PTX = """
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
import torch
from quantlab.kernels import gluon_scaled as g
kind, bm, bn, bk, stages, zc = sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6] == "1"
op = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kind]
c = g.Config(bm, bn, bk, stages)
al, bl = g._layouts(op, c)
t = {"int8": "i8", "fp8": "fp8e4nv"}[kind]
sig = {"a_desc": f"tensordesc<{t}[{bm}, {bk}],{al!r}>", "b_desc": f"tensordesc<{t}[{bn}, {bk}],{bl!r}>",
       "y_ptr": "*bf16", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "zc_ptr": "*i32", "rs_ptr": "*i32",
       "M": "i32", "N": "i32", "K": "i32", "stride_ym": "i32", "ROW_A": "constexpr", "ROW_B": "constexpr",
       "ZC": "constexpr", "GROUP_M": "constexpr", "STAGES": "constexpr", "num_warps": "constexpr"}
aligned = {(i,): [["tt.divisibility", 16]] for i in (2, 3, 4, 5, 6, 8, 9, 10)}  # as the JIT sees them
src = GluonASTSource(g._scaled_kernel, sig, attrs=aligned,
                     constexprs={"ROW_A": True, "ROW_B": True, "ZC": zc, "GROUP_M": 8, "STAGES": stages,
                                 "num_warps": c.warps})
print(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": c.warps}).asm["ptx"])
"""


@needs_triton
@pytest.mark.parametrize("kind,bm,bn,bk,stages,zc", [
    ("int8", 128, 128, 128, 5, False), ("int8", 128, 256, 128, 3, True), ("fp8", 64, 256, 128, 4, False),
    ("fp8", 128, 128, 64, 6, False)])
def test_gluon_scaled_kernel_keeps_one_wgmma_in_flight(kind, bm, bn, bk, stages, zc, tmp_path):
    """Compiled for sm_90: the K loop issues its BK/32 wgmmas per 64 rows and waits with one
    group outstanding (Triton's own pipeliner drains int8 every step), and ptxas keeps them
    asynchronous: it serialized a first version's wgmmas (info C7515; that version refilled
    the ring under a branch and stored the tile by TMA), which then ran 40% slower on an H100.
    Output leaves in 16-byte stores. The first stage's copies start before the last stage's
    barrier is initialized (each init costs a CTA barrier)."""
    import subprocess

    from triton.backends.nvidia import compiler

    ptx = compiled_in_subprocess(_GLUON_SCALED_PTX, kind, str(bm), str(bn), str(bk), str(stages), str(int(zc)))
    operands = "s32.s8.s8" if kind == "int8" else "f32.e4m3.e4m3"
    assert len(re.findall(rf"wgmma\.mma_async\S*{operands}", ptx)) == bk // 32 * (bn // 128 if kind == "int8" else 1)
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    assert "st.global.v4" in ptx and "ld.local" not in ptx
    assert ptx.find("cp.async.bulk.tensor") < ptx.rfind("mbarrier.init")
    (tmp_path / "k.ptx").write_text(ptx)
    try:  # the ptxas Triton compiles sm_90 with (chosen by arch from 3.7 on)
        ptxas = compiler.get_ptxas(90).path
    except TypeError:
        ptxas = compiler.get_ptxas().path
    info = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True, timeout=300)
    assert info.returncode == 0, info.stderr[-2000:]
    assert "C7515" not in info.stdout + info.stderr  # "wgmma.mma_async instructions are serialized"


def test_fastest_compares_interleaved_medians(monkeypatch):
    """`common.fastest` times every candidate once per round, the rounds interleaved, and keeps
    the best median: one lucky timing does not win, and a slowdown that hits every candidate
    in one round (clock drift) changes no choice."""
    script = {"a": [1.0, 1.5, 0.6], "b": [0.9, 1.4, 0.9], "c": [1.1, 1.6, 1.2]}
    calls: list[str] = []

    def fake_bench(fn):
        name = fn()
        calls.append(name)
        return script[name][calls.count(name) - 1]

    monkeypatch.setattr(common, "autotune_bench", fake_bench)
    assert common.fastest([lambda: "a", lambda: "b", lambda: "c"]) == 1  # medians 1.0, 0.9, 1.2
    assert calls == ["a", "b", "c"] * 3


def test_retime_top_keeps_the_best_median_of_the_autotuners_best(monkeypatch):
    """`common.retime_top` re-times the autotuner's `top` configs (by its one timing, median first)
    in `fastest`'s interleaved rounds and caches the winner for each new key; a tuner without
    timings keeps its pick."""
    import types

    inf = float("inf")
    timings = {"a": [1.00, 0.9, 1.1], "b": [0.98, 0.9, 1.0], "c": [1.02, 1.0, 1.1], "d": [2.0, 2.0, 2.0],
               "e": [inf, inf, inf]}  # a config that did not compile is never launched
    tuner = types.SimpleNamespace(cache={("k",): "b"}, configs_timings=timings)
    seen: list[list[str]] = []
    rounds_asked: list[int] = []

    def fake_fastest(runs, rounds):
        names = [run() for run in runs]
        seen.append(names)
        rounds_asked.append(rounds)
        return names.index("c")  # the interleaved rounds favour the autotuner's third

    monkeypatch.setattr(common, "fastest", fake_fastest)
    common.retime_top(tuner, {("k",)}, launch=lambda c: c, top=3)
    assert seen == [["b", "a", "c"]] and tuner.cache[("k",)] == "c"
    common.retime_top(tuner, {("k",)}, launch=lambda c: c, top=9, rounds=7)
    assert seen[-1] == ["b", "a", "c", "d"] and rounds_asked == [5, 7]
    common.retime_top(tuner, set(), launch=lambda c: c)  # nothing new: nothing timed
    assert len(seen) == 2
    bare = types.SimpleNamespace(cache={("k",): "b"})
    common.retime_top(bare, {("k",)}, launch=lambda c: c)
    assert bare.cache[("k",)] == "b" and len(seen) == 2


def test_gluon_scaled_path_only_where_it_applies():
    """The auto path considers the Gluon kernel above SMALL_M on sm_90 only: on a CPU (or in the
    interpreter) it stays on the Triton kernel, and asking for Gluon there is an error."""
    ts = pytest.importorskip("quantlab.kernels.triton_scaled")
    a = torch.zeros(128, 64, dtype=torch.int8)
    b = torch.zeros(32, 64, dtype=torch.int8)
    assert ts._path(a, b, torch.bfloat16, "auto") == "triton"
    with pytest.raises(ValueError, match="impl 'gluon'"):
        ts._path(a, b, torch.bfloat16, "gluon")
    with pytest.raises(ValueError, match="impl must be one of"):
        ts._path(a, b, torch.bfloat16, "cutlass")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon scaled kernel runs on sm_90")
@pytest.mark.parametrize("m,n,k", [(300, 136, 272), (129, 8, 16), (65, 1024, 4096)])
def test_gluon_scaled_kernel_matches_reference(m, n, k):
    """Every fitting config, odd M and N, int8 symmetric and asymmetric (zero correction) and
    FP8 per row, against the torch reference. Above SMALL_M the auto path times both kernels
    and keeps the faster."""
    from quantlab.kernels import gluon_scaled
    from quantlab.kernels.triton_scaled import SMALL_M, _path, fp8_matmul, w8a8_matmul

    torch.manual_seed(0)
    w = torch.randn(n, k)
    x = torch.randn(m, k, device="cuda")
    cases = []
    for symmetric in (True, False):
        p = layout.pack_w8a8(canonical(n, k, 8, None, symmetric)).to("cuda")
        xq, sx = reference.quantize_act_int8(x)
        cases.append((w8a8_matmul, xq, sx, p, reference.w8a8_mm(xq, sx, p, torch.bfloat16)))
    pf = layout.quantize_fp8_weight(w, True).to("cuda")
    xf, sf = reference.quantize_act_fp8(x, True)
    cases.append((fp8_matmul, xf, sf, pf, reference.fp8_mm(xf, sf, pf, torch.bfloat16)))
    for c in gluon_scaled.fitting(torch.bfloat16):
        for mm, xq, sx, p, ref in cases:
            y = mm(xq, sx, p, torch.bfloat16, config=dict(block_m=c.block_m, block_n=c.block_n,
                                                          block_k=c.block_k, stages=c.stages), impl="gluon")
            assert rel_err(y, ref) < TOL[torch.bfloat16], (c, mm.__name__)
    assert _path(cases[0][1], cases[0][3].w, torch.bfloat16, "auto") == ("faster" if m > SMALL_M else "triton")
    for mm, xq, sx, p, ref in cases:  # the auto path, whichever kernel it keeps
        assert rel_err(mm(xq, sx, p, torch.bfloat16), ref) < TOL[torch.bfloat16]


@needs_triton
def test_scaled_small_m_splits_fill_idle_sms(monkeypatch):
    """On 132 SMs a down projection at M = 1 (K×N = 18944×3584: 56 tiles of 64 columns) gets
    whole-wave splits of its K loop; an up projection (296 tiles) already fills the GPU and
    is not split."""
    from quantlab.kernels import triton_scaled as ts

    monkeypatch.setattr(ts, "sm_count", lambda device, interpreted: 132)
    y = torch.empty(0)
    narrow = [c for c in ts._small_m_splits(ts.SMALL_M_CONFIGS[:1], dict(M=1, N=3584, K=18944, y_ptr=y))]
    assert sorted(c.kwargs["SPLIT_K"] for c in narrow) == [1, 2, 5, 7, 9]
    wide = ts._small_m_splits(ts.SMALL_M_CONFIGS[:1], dict(M=1, N=18944, K=3584, y_ptr=y))
    assert [c.kwargs["SPLIT_K"] for c in wide] == [1]


@needs_triton
def test_linear_entry_points_use_the_kernels():
    """ops.* take the Triton path (the interpreter on a CPU) and match the float computation."""
    assert ops.use_triton(torch.zeros(1, device=DEV)), "the interpreter should take CPU tensors"
    x = torch.randn(2, 5, 96)
    qw = canonical(48, 96, 4, 32)
    y = ops.wna16_linear(x.half().to(DEV), layout.pack_wna16(qw, torch.float16).to(DEV))
    assert y.shape == (2, 5, 48)
    assert rel_err(y.cpu(), x @ qw.dequantize().t()) < 3e-3
    w = torch.randn(48, 96)
    y8 = ops.w8a8_linear(x.half().to(DEV), layout.quantize_int8_weight(w).to(DEV))
    assert rel_err(y8.cpu(), x @ w.t()) < 0.02  # int8 activations and weights
    yf = ops.fp8_linear(x.half().to(DEV), layout.quantize_fp8_weight(w).to(DEV))
    assert rel_err(yf.cpu(), x @ w.t()) < 0.08  # e4m3


@needs_triton
def test_custom_ops_only_under_torch_compile(monkeypatch):
    """Eager calls launch the kernels directly (the custom op's dispatch is host time an eager
    prefill waits on); under torch.compile each GEMM and the decode attention is the custom op,
    one opaque node, so the whole function traces without a graph break."""
    x = torch.randn(3, 96).half().to(DEV)
    p4 = layout.pack_wna16(canonical(48, 96, 4, 32), torch.float16).to(DEV)
    p8 = layout.quantize_int8_weight(torch.randn(48, 96)).to(DEV)

    (q, k, v, mask, pos, ks, vs), *_ = _attention_case(torch.float16, "int8")
    cache = tuple(t.to(DEV) for t in (k, v, mask, pos, ks, vs))
    q = q.to(DEV)

    def both(x):
        y = ops.wna16_linear(x, p4) + ops.w8a8_linear(x, p8)
        return y, ops.decode_attention(q * y[0, 0], *cache)

    eager = both(x)
    traced = torch.compile(both, backend="aot_eager", fullgraph=True)(x)
    assert all(torch.equal(a, b) for a, b in zip(traced, eager))

    def refuse(*args):
        raise AssertionError("the custom op ran eagerly")

    monkeypatch.setattr(ops, "_wna16_mm_op", refuse)
    monkeypatch.setattr(ops, "_scaled_mm_op", refuse)
    monkeypatch.setattr(ops, "_decode_attention_op", refuse)
    assert all(torch.equal(a, b) for a, b in zip(both(x), eager))


@needs_triton
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_activation_quant_kernel_is_bit_identical(static, dtype):
    """The one-launch int8 activation quantization gives the torch path's codes and scales
    exactly: rows longer than a block (1500 > 1024), an all-zero row, and exact ties (a row
    whose absmax is 127 has scale 1, so x.5 must round half to even)."""
    from quantlab.kernels.triton_act import quantize_rows
    from quantlab.runner.codes import InputQuant

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 1500, generator=g) * 3
    x[1] = 0
    x[2, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.0])
    x[2, 8:] = 0
    x = x.to(dtype).to(DEV)
    act = InputQuant("int8", not static, torch.tensor([5.0], device=DEV) if static else None)
    want_q, want_s = act.quantize_torch(x)
    q, s = quantize_rows(x, "int8", act.absmax)
    assert torch.equal(s, want_s) and torch.equal(q, want_q)
    q2, s2 = act.quantize(x)  # the kernel on a GPU, the torch ops on the CPU
    assert torch.equal(q2, q) and torch.equal(s2, s)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton interpreter's float32 → e4m3 cast is wrong")
@pytest.mark.parametrize("static", [False, True])
def test_fp8_activation_quant_kernel_is_bit_identical(static):
    """The one-launch FP8 activation quantization gives the torch path's e4m3 codes and scales
    exactly on a GPU: long rows, a zero row, values past ±448·s (saturated) and exact e4m3
    rounding ties."""
    from quantlab.kernels.triton_act import quantize_rows
    from quantlab.runner.codes import InputQuant

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1500, generator=g) * 3
    x[1] = 0
    x[2, :6] = torch.tensor([448.0, 17.0, 19.0, 4.25, -4.75, -0.0068359375])  # scale 1: e4m3 ties
    x[2, 6:] = 0
    x = x.to(torch.bfloat16).cuda()
    act = InputQuant("fp8", not static, torch.tensor([2.0], device="cuda") if static else None)
    want_q, want_s = act.quantize_torch(x)
    q, s = quantize_rows(x, "fp8", act.absmax)
    assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    q2, s2 = act.quantize(x)  # the kernel, through the runner's dispatch
    assert torch.equal(s2, s) and torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor launches the Triton kernel on a GPU")
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_compiled_activation_quant_launches_the_kernel_bit_identically(kind):
    """Under torch.compile the activation quantization is a `triton_op`: Inductor's code
    launches the same Triton kernel (no graph break, no custom-op call) and the codes and
    scales equal the eager ones bit for bit, next to a fused RMSNorm in front of it."""
    from torch._inductor.utils import run_and_get_code

    x = (torch.randn(37, 1536, generator=torch.Generator().manual_seed(1)) * 4).to(torch.bfloat16).cuda()

    def quantize(x):
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return ops.quantize_rows(h, kind)

    ops.register_compiled_ops()
    eager = quantize(x)
    compiled, code = run_and_get_code(torch.compile(quantize, fullgraph=True, dynamic=True), x)
    assert "_quantize_rows_kernel" in "".join(code)
    assert all(torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 else b) for a, b in zip(compiled, eager))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="cuBLASLt's row-wise scaled FP8 GEMM needs sm_90")
@pytest.mark.parametrize("per_tensor_input", [False, True])
def test_large_m_fp8_gemm_through_cublas_matches_the_reference(per_tensor_input):
    """Above the small-M sizes the FP8 Linear runs through torch._scaled_mm: the same product
    as the reference up to fp32 summation order (per-token or per-tensor input scales)."""
    g = torch.Generator().manual_seed(0)
    qw = quantize_weight(torch.randn(256, 512, generator=g), WeightScheme(type="float", bits=8, group_size=None))
    p = layout.pack_fp8(QuantizedWeight(qw.codes.cuda(), qw.scales.cuda(), qw.zeros.cuda(), qw.g_idx.cuda(),
                                        qw.scheme))
    x = torch.randn(128, 512, generator=g).cuda()
    xq, sx = reference.quantize_act_fp8(x, per_row=not per_tensor_input)
    y = ops.fp8_mm(xq, sx, p, torch.bfloat16)
    want = reference.fp8_mm(xq, sx, p, torch.float32)
    assert y.dtype == torch.bfloat16 and rel_err(y, want) < TOL[torch.bfloat16]
