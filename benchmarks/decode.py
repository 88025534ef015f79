"""Decode benchmark of quantlab's runner: a Qwen2-7B-shaped model with random weights at bf16,
W4A16, W8A8 and FP8, next to transformers' own `generate` in bf16 (run on the device machine).

Random weights are fine for speed: every scheme reads the same bytes and runs the same kernels
as a trained model would. Quantized models get random but valid canonical weights (codes,
scales, zero points, g_idx) — no calibration — and go through the same `build_runner` as a
real run's `quantized/`:

* bf16    — float Linears (cuBLAS), q/k/v and gate/up fused;
* W4A16   — 4-bit symmetric, group 128, quantlab.kernels WNA16 GEMM;
* W8A8    — int8 per-channel weights, dynamic per-token int8 activations (int8 GEMM);
* FP8     — e4m3 per-channel weights, dynamic per-token FP8 activations;
* hf-bf16 — transformers `generate` (greedy, its default dynamic cache, eager), same weights
            as the bf16 row;
* w4a16-head — W4A16 with lm_head quantized too (4-bit, group 128; a stage's `lm_head: true`):
            the bf16 head is 1.09 of the 4.56 GB the W4A16 model reads per token;
* w4a16-floor (GPU only) — the W4A16 model with every decode GEMM (M ≤ 64) replaced by a
            kernel that only reads the GEMM's bytes (read_floor.py): no W4A16 kernel can make
            this runner decode faster.

Per scheme, prompt length (`--prompts`) and batch (`--batches`): a warm-up generation
(autotuning, CUDA-graph capture or compilation), then `--repeats` timed ones; medians of prefill
tokens/s (batch × prompt tokens / prefill time) and decode tokens/s (batch × (new tokens − 1) /
decode-loop time). Each batch starts from released KV caches and fresh prefill and decode steps
(`torch._dynamo.reset()` on a GPU: its steps compile as in a fresh process, not as the n-th
recompile of one frame, `release`); its prompt lengths share caches sized for the longest
prompt, so the compiled prefill (dynamic in the prompt length) and the decode step are shared.
The runner decodes under a captured CUDA graph or compiled step on a GPU (`--decode`), eagerly
on CPU.

Each decode row also gives the fraction of the HBM roofline: the bytes one decode step must read
(the Linears' weights, `quantlab.runner.linear.weight_bytes` — or the float parameters less the
embedding for transformers —, plus the K/V cache of the batch at the mean context, prompt + new
tokens / 2) × steps/s ÷ the device's peak bandwidth (`HBM_TBPS` by device name, `--hbm-tbps`;
none on CPU). A combination whose KV cache cannot fit the free GPU memory, or that runs out of
memory, is recorded as "not reached (OOM)" and the run goes on.

`--profile-prefill`: per scheme, one prefill at the first prompt length and batch under
torch.profiler, its kernels grouped by kind (GEMM, weight dequantization, activation
quantization, attention, copies, the rest), against the prefill's wall time.

    python benchmarks/decode.py                     # the GPU run: 28 layers, prompts 512 and 2048, batch 1, 16, 64
    python benchmarks/decode.py --layers 8          # a shallower model (memory / time)
    python benchmarks/decode.py --schemes bf16,fp8 --prompts 512 --batches 1 --profile-prefill
    python benchmarks/decode.py --tiny              # CPU smoke test, a few seconds

Writes `benchmarks/results/decode_<device>.json` and `.md` (`_tiny` suffix with --tiny).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("quantlab") is None:  # a bare checkout; an installed quantlab has quantlab.kernels
    sys.path.insert(0, str(REPO))

QWEN2_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6,
                rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096, rope_theta=1e6,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
SCHEMES = ("hf-bf16", "bf16", "w4a16", "w8a8", "fp8", "w4a16-head", "w4a16-floor")
QUANTIZED = ("w4a16", "w8a8", "fp8")  # the schemes the bars hold to bf16
PROMPTS, BATCHES = (512, 2048), (1, 16, 64)
TINY_PROMPTS, TINY_BATCHES = (16, 32), (1, 2)
ALL = None  # a bar's prompts or batches: every one measured


def _bar(kind: str, scheme: str, base: str, need: float, batches=ALL, prompts=ALL, source: str = "issue"):
    return dict(kind=kind, scheme=scheme, base=base, need=need, batches=batches, prompts=prompts, source=source)


# One bar row per measured (prompt, batch) each bar names. "issue": the prefill and decode bars
# of "the runner never slower than bf16"; "earlier": the W4A16 decode targets before it (the
# w4a16-head line is informational: the bars name the W4A16 model).
BARS = [
    *[_bar("prefill", s, "bf16", need, (1, 16), (512, 2048)) for s, need in (("w8a8", 1.3), ("fp8", 1.3), ("w4a16", 1.0))],
    *[_bar("decode", s, "bf16", 1.0, (1, 16, 64)) for s in QUANTIZED],
    _bar("decode", "w8a8", "bf16", 1.5, (1,)), _bar("decode", "fp8", "bf16", 1.5, (1,)),
    _bar("decode", "w4a16", "bf16", 2.3, (1,)), _bar("decode", "w4a16", "bf16", 1.8, (16,)),
    _bar("decode", "w4a16", "bf16", 2.5, (1,), source="earlier"),
    _bar("decode", "w4a16", "hf-bf16", 3.0, (1,), source="earlier"),
    _bar("decode", "w4a16-head", "bf16", 2.5, (1,), source="earlier"),
]

# Peak HBM bandwidth in TB/s by device name (first match; `--hbm-tbps` overrides).
HBM_TBPS = [(r"\bGH200\b", 4.0), (r"\bH200\b", 4.8), (r"\bH100\b.*PCIe", 2.0), (r"\bH100\b.*NVL", 3.9),
            (r"\bH100\b", 3.35), (r"\bH800\b", 3.35), (r"\bH20\b", 4.0), (r"\bB200\b", 8.0),
            (r"\bA100\b.*80GB PCIe", 1.935), (r"\bA100\b.*80GB", 2.039), (r"\bA100\b", 1.555),
            (r"\bL40S\b", 0.864)]


def hbm_tbps(device: torch.device, override: float | None) -> float | None:
    """The device's peak HBM bandwidth in TB/s: `override`, else the table's, else None (CPU,
    an unlisted GPU: no roofline fraction)."""
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tbps for pattern, tbps in HBM_TBPS if re.search(pattern, name)), None)


def kv_bytes(config, batch: int, context: int, element_size: int) -> int:
    """Bytes of K and V for `batch` rows of `context` positions over all layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * batch * config.num_key_value_heads * context * head_dim * element_size


def qwen2_config(args: argparse.Namespace):
    from transformers import Qwen2Config

    shape = dict(TINY if args.tiny else QWEN2_7B)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    return Qwen2Config(**shape)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- models


def hf_model(config, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' Qwen2 with its own random init, made directly on the device."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


SCHEME_SPECS: dict[str, tuple[dict, dict | None]] = {  # weight scheme, activation scheme
    "w4a16": (dict(bits=4, symmetric=True, group_size=128), None),
    "w8a8": (dict(bits=8, symmetric=True, group_size=None), dict(type="int", dynamic=True, granularity="token")),
    "fp8": (dict(type="float", bits=8, symmetric=True, group_size=None), dict(type="float", dynamic=True,
                                                                              granularity="token")),
}


def random_qweight(n: int, k: int, scheme, device: torch.device):
    """Random codes and scales with weights of std ≈ 0.02 (a trained model's order)."""
    from quantlab.quant.primitives import QuantizedWeight, default_g_idx, num_groups

    if scheme.type == "float":
        codes = (torch.randn(n, k, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        return QuantizedWeight(codes, torch.full((n, 1), 0.02 / 64, device=device),
                               torch.zeros(n, 1, dtype=torch.uint8, device=device),
                               torch.zeros(k, dtype=torch.int32, device=device), scheme)
    levels = 2 ** scheme.bits
    groups = num_groups(k, scheme.group_size)
    codes = torch.randint(0, levels, (n, k), dtype=torch.uint8, device=device)
    scales = torch.full((n, groups), 0.02 * 12 ** 0.5 / levels, device=device)  # uniform codes: std = L/√12
    zeros = torch.full((n, groups), levels // 2, dtype=torch.uint8, device=device)
    return QuantizedWeight(codes, scales, zeros, default_g_idx(k, scheme.group_size).to(device), scheme)


def quantized_runner(config, name: str, device: torch.device, dtype: torch.dtype, head: bool = False):
    """The scheme's model; `head`: lm_head quantized with the same weight scheme."""
    from quantlab.quant.scheme import ActivationScheme, WeightScheme
    from quantlab.runner.load import build_runner

    w_spec, a_spec = SCHEME_SPECS[name]
    scheme = WeightScheme(**w_spec)
    h, inter, d = config.hidden_size, config.intermediate_size, config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    torch.manual_seed(0)
    rand = lambda *s: torch.randn(*s, device=device, dtype=dtype) * 0.02  # noqa: E731
    tensors = {"model.embed_tokens.weight": rand(config.vocab_size, h), "lm_head.weight": rand(config.vocab_size, h),
               "model.norm.weight": torch.ones(h, device=device, dtype=dtype)}
    quantized = {}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(h, device=device, dtype=dtype)
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(h, device=device, dtype=dtype)
        for proj, width in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            tensors[f"{p}.self_attn.{proj}.bias"] = rand(width)
        for name_, (n, k) in shapes.items():
            quantized[f"{p}.{name_}"] = random_qweight(n, k, scheme, device)
    if head:
        del tensors["lm_head.weight"]
        quantized["lm_head"] = random_qweight(config.vocab_size, h, scheme, device)
    quant_config: dict[str, Any] = {}
    if a_spec is not None:
        quant_config["activations"] = {**ActivationScheme(**a_spec).model_dump(), "modules": list(quantized)}
    model = build_runner(config, tensors, quantized, quant_config, {}, device, dtype)
    del quantized, tensors
    return model


# --------------------------------------------------------------------------- timing


def step_kernels(model, prompts: torch.Tensor, decode: str, steps: int = 32) -> list[dict[str, Any]]:
    """Device kernels of one decode step, by name: the profile of a generate with `steps` more
    tokens minus one with 2, over `steps` (prefill and warm-up cancel). CUPTI records each
    kernel of a CUDA-graph replay, so the sum against the step's wall time shows how much of the
    step is spent between kernels rather than in them."""
    from torch.profiler import ProfilerActivity, profile

    from quantlab.runner.generate import generate

    cuda = prompts.device.type == "cuda"  # on CPU: the ops' own CPU time (a smoke test)
    activity, total = (ProfilerActivity.CUDA, "device_time_total") if cuda else (ProfilerActivity.CPU, "self_cpu_time_total")

    def kernels(new_tokens: int) -> dict[str, tuple[int, float]]:
        with profile(activities=[activity]) as prof:
            generate(model, prompts, new_tokens, decode=decode)
        return {e.key: (e.count, getattr(e, total)) for e in prof.key_averages() if getattr(e, total) > 0}

    short, long = kernels(2), kernels(2 + steps)
    rows = []
    for name, (n, t) in long.items():
        n0, t0 = short.get(name, (0, 0.0))
        if (n - n0) / steps > 0.5:  # launched every step, not once per generate
            rows.append({"kernel": name, "per_step": (n - n0) / steps, "us_per_step": (t - t0) / steps})
    return sorted(rows, key=lambda r: -r["us_per_step"])


def time_runner(model, prompts: torch.Tensor, new_tokens: int, repeats: int, decode: str,
                prefill: str = "auto", cache_len: int | None = None) -> dict[str, Any]:
    from quantlab.runner.generate import generate

    kw = dict(decode=decode, prefill=prefill, max_seq_len=cache_len)
    generate(model, prompts, new_tokens, **kw)  # warm-up: autotune, compile
    runs = [generate(model, prompts, new_tokens, **kw) for _ in range(repeats)]
    return {"prefill_tok_s": statistics.median(r.prefill_tokens_per_s for r in runs),
            "decode_tok_s": statistics.median(r.decode_tokens_per_s for r in runs),
            "decode_mode": runs[0].stats["decode"], "prefill_mode": runs[0].stats["prefill"]}


@torch.no_grad()
def time_hf(model, prompts: torch.Tensor, new_tokens: int, repeats: int) -> dict[str, Any]:
    """Prefill = one forward of the prompt with a cache; decode = generate's time minus that."""
    dev = prompts.device
    mask = torch.ones_like(prompts)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, attention_mask=mask,
              pad_token_id=0)

    def timed(fn: Callable[[], Any]) -> float:
        sync(dev)
        start = time.perf_counter()
        fn()
        sync(dev)
        return time.perf_counter() - start

    model.generate(prompts, **kw)  # warm-up
    prefill = statistics.median(timed(lambda: model(prompts, attention_mask=mask, use_cache=True,
                                                       logits_to_keep=1))
                                for _ in range(repeats))
    total = statistics.median(timed(lambda: model.generate(prompts, **kw)) for _ in range(repeats))
    b, p = prompts.shape
    # (on a loaded CPU a tiny model's generate can time under its own prefill: floored at 1%)
    return {"prefill_tok_s": b * p / prefill, "decode_tok_s": b * (new_tokens - 1) / max(total - prefill, 0.01 * total),
            "decode_mode": "transformers generate"}


def is_oom(e: BaseException) -> bool:
    """An allocation failure: torch's, or cuBLAS's / a kernel launcher's own."""
    text = str(e)
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in text.lower() or "ALLOC_FAILED" in text


def release(model, device: torch.device) -> None:
    """Drop the runner's KV caches and its prefill and decode steps (a captured graph or a
    compiled step holds its own memory pool) so that a batch allocates only its own, and on a
    GPU forget the compiled frames (`torch._dynamo.reset()`): every (batch, cache length)
    compiles new steps of the same frames (the prefill's `call_layer`, `DecodeStep._forward`);
    recompiles count toward dynamo's recompile limit (8), past which a frame runs eagerly, and
    a changed shape can recompile it with dynamic shapes. Each batch's steps are compiled as in
    a fresh process."""
    for layer in getattr(getattr(model, "model", None), "layers", []):
        attn = getattr(layer, "self_attn", None)
        if attn is not None and hasattr(attn, "kv_cache"):
            attn.kv_cache = None
    if hasattr(model, "max_batch"):
        model.max_batch = model.max_seq_len = 0
    for step in ("_decode_step", "_prefill_steps"):
        if hasattr(model, step):
            delattr(model, step)
    if device.type == "cuda":
        torch._dynamo.reset()
    free(device)


def kv_fits(config, device: torch.device, batch: int, length: int, element_size: int) -> str | None:
    """None when the KV cache of `batch` rows × `length` positions fits the GPU's free memory
    (with 5% to spare); else why not."""
    if device.type != "cuda":
        return None
    need = kv_bytes(config, batch, length, element_size)
    free_b, _ = torch.cuda.mem_get_info(device)
    free_b += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if need <= 0.95 * free_b:
        return None
    return f"KV cache {need / 1e9:.1f} GB, {free_b / 1e9:.1f} GB free"


def not_reached(label: str, prompt_len: int, batch: int, args, why: str, oom: bool) -> dict[str, Any]:
    status = "not reached (OOM)" if oom else "failed"
    print(f"  {label:8s} prompt {prompt_len:5d} batch {batch:3d}: {status}: {why}", flush=True)
    return {"scheme": label, "batch": batch, "prompt_len": prompt_len, "new_tokens": args.new_tokens,
            "status": status, "error": why, "prefill_tok_s": None, "decode_tok_s": None}


def measure_one(model, label: str, args, device: torch.device, config, prompt_len: int, batch: int,
                hf: bool, peak_tbps: float | None, cache_len: int | None = None) -> dict[str, Any]:
    """One (prompt length, batch) of one scheme: timings, then the decode step's bytes."""
    from quantlab.runner.linear import weight_bytes

    prompts = torch.randint(0, config.vocab_size, (batch, prompt_len),
                            generator=torch.Generator().manual_seed(batch * 100003 + prompt_len))
    prompts = prompts.to(device)
    if hf:
        res = time_hf(model, prompts, args.new_tokens, args.repeats)
        embed = model.get_input_embeddings().weight  # one row per token is read, not the table
        wbytes = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()
        element_size = embed.element_size()
    else:
        model.set_attention(args.attention)
        fused = args.fused_decode and model.set_fused_decode(True)
        res = time_runner(model, prompts, args.new_tokens, args.repeats, args.decode, args.prefill, cache_len)
        if args.profile:
            res["step_kernels"] = step_kernels(model, prompts, args.decode)
        if args.attention != "torch":
            res["decode_mode"] += f" + {args.attention} attention"
        if fused:
            res["decode_mode"] += " + fused epilogues"
        if args.pdl:
            res["decode_mode"] += " + PDL"
        wbytes = weight_bytes(model)  # Linears incl. lm_head; the embedding table is not read whole
        element_size = model.dtype.itemsize
    # a decode step reads every weight once and the whole batch's K/V up to its position:
    # at the mean position of the decode, prompt + new tokens / 2
    kv = kv_bytes(config, batch, prompt_len + args.new_tokens // 2, element_size)
    steps_s = res["decode_tok_s"] / batch
    step_bytes = wbytes + kv
    row = {"scheme": label, "batch": batch, "prompt_len": prompt_len, "new_tokens": args.new_tokens,
           "status": "ok", **res, "weight_gb": wbytes / 1e9, "kv_gb_per_step": kv / 1e9,
           "decode_weight_gb_s": wbytes * steps_s / 1e9, "decode_gb_s": step_bytes * steps_s / 1e9,
           "hbm_roofline": step_bytes * steps_s / (peak_tbps * 1e12) if peak_tbps else None}
    roof = f", {row['hbm_roofline']:.1%} of HBM" if row["hbm_roofline"] is not None else ""
    print(f"  {label:8s} prompt {prompt_len:5d} batch {batch:3d}: prefill {res['prefill_tok_s']:10.1f} tok/s, "
          f"decode {res['decode_tok_s']:9.1f} tok/s{roof} ({res['decode_mode']}; prefill "
          f"{res.get('prefill_mode', '—')})", flush=True)
    sync(device)
    return row


def measure(model, label: str, args, device: torch.device, config, rows: list[dict[str, Any]],
            hf: bool = False, peak_tbps: float | None = None,
            checkpoint: Callable[[], Any] = lambda: None) -> None:
    """Every (prompt length, batch) of one scheme into `rows`, `checkpoint()` after each; one
    that does not fit or fails is recorded as such and the others still run."""
    element_size = (model.get_input_embeddings().weight if hf else model.model.embed_tokens.weight).element_size()
    cache_len = max(args.prompts) + args.new_tokens
    for batch in args.batches:
        release(model, device)  # a batch's prompt lengths share its caches and compiled steps
        why = kv_fits(config, device, batch, cache_len, element_size)
        for prompt_len in args.prompts:
            if why is not None:
                rows.append(not_reached(label, prompt_len, batch, args, why, oom=True))
            else:
                try:
                    rows.append(measure_one(model, label, args, device, config, prompt_len, batch, hf, peak_tbps,
                                            cache_len))
                except Exception as e:  # noqa: BLE001 — one combination must not end the run
                    if not is_oom(e):
                        traceback.print_exc()
                    rows.append(not_reached(label, prompt_len, batch, args, f"{type(e).__name__}: {str(e)[:300]}",
                                            oom=is_oom(e)))
            checkpoint()
    release(model, device)


# --------------------------------------------------------------------------- prefill profile

# Kernel kinds, matched in this order against a kernel's name (then against the names of the
# ops that launched it). Ranges the profile opens around the activation quantization and the
# attention (`labelled_ranges`) take precedence: the FP8 inputs are quantized by generic torch
# elementwise and reduction kernels, and SDPA's math fallback runs its own GEMMs.
KINDS = ("gemm", "weight dequant", "act quant", "attention", "copy", "other")
KIND_LABELS = {"gemm": "GEMM", "weight dequant": "weight dequant", "act quant": "act quant",
               "attention": "attention", "copy": "memcpy / memset", "other": "elementwise / norm / RoPE / other"}
NAME_RULES = [("attention", r"flash|attention|fmha|sdpa|softmax"),
              ("weight dequant", r"dequant"),
              ("act quant", r"quant|absmax|\bact_|_act\b"),
              ("gemm", r"wna16|scaled|cutlass|gemm|matmul|sm90|nvjet|xmma|gemv|"
                       r"aten::(?:mm|addmm|bmm|linear|_int_mm|_scaled_mm)$"),
              ("copy", r"memcpy|memset")]
RANGES = {"quantlab::act_quant": "act quant", "quantlab::attention": "attention"}


def kind_of(names: list[str]) -> str | None:
    for name in names:
        if name in RANGES:
            return RANGES[name]
    for kind, pattern in NAME_RULES:
        if any(re.search(pattern, name, re.IGNORECASE) for name in names):
            return kind
    return None


@contextlib.contextmanager
def labelled_ranges():
    """Within: every Linear input quantization (`InputQuant.quantize`) and every SDPA call runs
    inside a named profiler range, so its kernels are counted to it whatever their names."""
    import torch.nn.functional as F
    from torch.profiler import record_function

    from quantlab.runner.codes import InputQuant

    quantize, sdpa = InputQuant.quantize, F.scaled_dot_product_attention

    def ranged_quantize(self, x2):
        with record_function("quantlab::act_quant"):
            return quantize(self, x2)

    def ranged_sdpa(*a, **kw):
        with record_function("quantlab::attention"):
            return sdpa(*a, **kw)

    InputQuant.quantize, F.scaled_dot_product_attention = ranged_quantize, ranged_sdpa
    try:
        yield
    finally:
        InputQuant.quantize, F.scaled_dot_product_attention = quantize, sdpa


def kernel_table(prof, cuda: bool) -> tuple[list[tuple[str, str, float]], int]:
    """(kind, name, µs) per kernel (CUDA) or per op's self time (CPU), and the launches: CUDA
    kernels and copies, or the ops that call no other op."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    # the ops and ranges a kernel's linked correlation id names (not the runtime's launch
    # calls, whose ids are CUPTI's own)
    cpu = {e.id: e for e in events if e.device_type == DeviceType.CPU and not getattr(e, "linked_correlation_id", 0)}

    def chain(e) -> list[str]:
        names = []
        while e is not None:
            names.append(e.name)
            e = e.cpu_parent
        return names

    out: list[tuple[str, str, float]] = []
    if not cuda:
        for e in events:
            if e.device_type == DeviceType.CPU and not getattr(e, "is_user_annotation", False):
                out.append((kind_of(chain(e)) or "other", e.name, e.self_cpu_time_total))
        launches = sum(1 for e in events if e.device_type == DeviceType.CPU and not e.cpu_children
                       and not getattr(e, "is_user_annotation", False))
        return out, launches
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    # the ranges' GPU spans (kineto's gpu_user_annotation): a fallback where a launch is not
    # linked to the op that made it
    spans = [(e.time_range.start, e.time_range.end, RANGES[e.name]) for e in device if e.name in RANGES]
    kernels = [e for e in device if e.name not in RANGES and not getattr(e, "is_user_annotation", False)]
    for k in kernels:
        start, end = k.time_range.start, k.time_range.end
        anchor = cpu.get(getattr(k, "linked_correlation_id", 0) or -1)
        names = chain(anchor) if anchor is not None else []
        kind = next((RANGES[n] for n in names if n in RANGES), None) \
            or next((kind for s, t, kind in spans if s <= start and end <= t), None) \
            or kind_of([k.name]) or kind_of(names) or "other"
        out.append((kind, k.name, end - start))
    return out, len(kernels)


def profile_prefill(model, label: str, args, device: torch.device, config, hf: bool) -> dict[str, Any]:
    """One prefill at the first prompt length and batch under torch.profiler (CUDA kernels on a
    GPU, CPU ops otherwise), grouped by `KINDS`, next to the median wall time of three
    unprofiled ones: the gap is host time the device waits through (launches, Python)."""
    from torch.profiler import ProfilerActivity, profile

    prompt_len, batch = args.prompts[0], args.batches[0]
    prompts = torch.randint(0, config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(7))
    prompts = prompts.to(device)
    release(model, device)
    step = None
    if hf:
        mask = torch.ones_like(prompts)

        def prefill():
            return model(prompts, attention_mask=mask, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1)
    else:
        from quantlab.runner.generate import prefill_step

        model.setup_caches(batch, prompt_len + 1)
        model.set_padding(torch.zeros(batch, dtype=torch.long))
        step = prefill_step(model, args.prefill)

        def prefill():  # what `generate` times as the prefill
            return step(prompts).argmax(-1)

    def timed() -> float:
        sync(device)
        start = time.perf_counter()
        prefill()
        sync(device)
        return time.perf_counter() - start

    cuda = device.type == "cuda"
    with torch.no_grad():
        prefill()  # autotuning, allocator
        wall = statistics.median(timed() for _ in range(3))
        # CPU activity on a GPU too: the ops and ranges that launched each kernel
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        # a compiled prefill is not relabelled: patching what it traced would recompile it
        # inside the profile; its kernels are told apart by name
        ranges = labelled_ranges() if hf or step.mode == "eager" else contextlib.nullcontext()
        with ranges, profile(activities=activities) as prof:
            profiled = timed()
    table, launches = kernel_table(prof, cuda)
    release(model, device)
    busy = sum(us for _, _, us in table) / 1e3
    kinds = {kind: {"ms": sum(us for k, _, us in table if k == kind) / 1e3,
                    "launches": sum(1 for k, _, _ in table if k == kind)} for kind in KINDS}
    by_name: dict[tuple[str, str], list] = {}
    for kind, name, us in table:
        entry = by_name.setdefault((name, kind), [0, 0.0])
        entry[0] += 1
        entry[1] += us
    top = sorted(by_name.items(), key=lambda item: -item[1][1])[:12]
    # the profiler slows the CPU ops it times, not the GPU's kernels: on CPU the gap is taken
    # against the profiled prefill's own wall time
    ref = wall if cuda else profiled
    res = {"scheme": label, "prompt_len": prompt_len, "batch": batch, "activity": "cuda" if cuda else "cpu",
           "wall_ms": 1e3 * wall, "profiled_wall_ms": 1e3 * profiled, "kernel_ms": busy,
           "gap_ms": 1e3 * ref - busy, "launches": launches, "kinds": kinds,
           "top": [{"name": n, "kind": k, "count": c, "ms": us / 1e3} for (n, k), (c, us) in top]}
    print(f"  {label:8s} prefill profile (prompt {prompt_len}, batch {batch}): {1e3 * ref:.2f} ms wall, "
          f"{busy:.2f} ms in {launches} {'kernels' if cuda else 'ops'}: "
          + ", ".join(f"{k} {v['ms']:.2f}" for k, v in kinds.items() if v["ms"]), flush=True)
    return res


def maybe_profile(model, label: str, args, device: torch.device, config, hf: bool = False) -> list[dict[str, Any]]:
    if not args.profile_prefill:
        return []
    try:
        return [profile_prefill(model, label, args, device, config, hf)]
    except Exception as e:  # noqa: BLE001
        if not is_oom(e):
            traceback.print_exc()
        release(model, device)
        return [{"scheme": label, "prompt_len": args.prompts[0], "batch": args.batches[0],
                 "error": f"{type(e).__name__}: {str(e)[:300]}"}]


@contextlib.contextmanager
def gemms_read_only():
    """Within: every W4A16 GEMM of at most DECODE_MAX_M tokens only reads its weight's bytes
    and writes zeros (read_floor.py); prefill keeps the real kernels."""
    from quantlab.kernels import triton_wna16
    from read_floor import read_packed

    real = triton_wna16.wna16_matmul

    def read_only(x, p, impl="auto", config=None, out=None):
        if x.shape[0] > triton_wna16.DECODE_MAX_M:
            return real(x, p, impl, config, out)
        out = x.new_empty(x.shape[0], p.out_features) if out is None else out
        return read_packed(p, out)

    triton_wna16.wna16_matmul = read_only
    try:
        yield
    finally:
        triton_wna16.wna16_matmul = real


def free(device: torch.device) -> None:
    """Return a dropped model's GPU memory (on CPU its tensors go with their last reference; a
    full collection of a process holding transformers takes a third of a second)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def run(args: argparse.Namespace, on_rows: Callable[[dict[str, Any]], Any] = lambda res: None) -> dict[str, Any]:
    """Measure every wanted scheme; `on_rows` gets the result so far after each combination
    and scheme (the caller saves it, so a run stopped by a time limit keeps what it measured)."""
    from quantlab.runner.load import from_hf_model

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = qwen2_config(args)
    peak = hbm_tbps(device, args.hbm_tbps)
    rows: list[dict[str, Any]] = []
    profiles: list[dict[str, Any]] = []

    def result() -> dict[str, Any]:
        return {"device": device_name(device), "dtype": str(dtype).removeprefix("torch."),
                "config": config.to_dict(), "layers": config.num_hidden_layers, "tiny": args.tiny,
                "args": vars(args), "hbm_tbps": peak, "rows": rows, "bars": bars(rows),
                "prefill_profiles": profiles, "versions": versions(),
                "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}

    def saved() -> None:
        on_rows(result())

    def unbuilt(label: str, e: Exception) -> None:
        """The scheme's model could not be made: every combination is recorded as not reached."""
        if not is_oom(e):
            traceback.print_exc()
        why = f"building the model: {type(e).__name__}: {str(e)[:300]}"
        rows.extend(not_reached(label, p, b, args, why, is_oom(e)) for p in args.prompts for b in args.batches)
        free(device)

    wanted = set(args.schemes)
    if wanted & {"hf-bf16", "bf16"}:
        try:
            hf = hf_model(config, device, dtype)
        except Exception as e:  # noqa: BLE001
            hf = None
            for label in ("hf-bf16", "bf16"):
                if label in wanted:
                    unbuilt(label, e)
        if hf is not None and "hf-bf16" in wanted:
            measure(hf, "hf-bf16", args, device, config, rows, hf=True, peak_tbps=peak, checkpoint=saved)
            profiles += maybe_profile(hf, "hf-bf16", args, device, config, hf=True)
            on_rows(result())
        if hf is not None and "bf16" in wanted:
            runner = from_hf_model(hf)
            del hf
            free(device)
            measure(runner, "bf16", args, device, config, rows, peak_tbps=peak, checkpoint=saved)
            profiles += maybe_profile(runner, "bf16", args, device, config)
            on_rows(result())
            del runner
        else:
            del hf
        free(device)
    for name in [s for s in args.schemes if s not in ("hf-bf16", "bf16")]:
        floor = name == "w4a16-floor"
        if floor and device.type != "cuda":
            print("  w4a16-floor: needs a CUDA GPU (Triton), skipped", flush=True)
            continue
        base, _, variant = name.partition("-")
        try:
            model = quantized_runner(config, base, device, dtype, head=variant == "head")
        except Exception as e:  # noqa: BLE001
            unbuilt(name, e)
            on_rows(result())
            continue
        with gemms_read_only() if floor else contextlib.nullcontext():
            measure(model, name, args, device, config, rows, peak_tbps=peak, checkpoint=saved)
            if not floor:  # the floor's prefill is the W4A16 one
                profiles += maybe_profile(model, name, args, device, config)
        on_rows(result())
        del model
        free(device)
    return result()


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()})"


def versions() -> dict[str, str]:
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = "not installed"
    return out


def bars(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each bar at every measured (prompt, batch) it names: met when the scheme's tokens/s over
    the base's reach the bar; not met when the scheme was not reached there; not evaluated
    (met None) when the base was not."""
    index = {(r["scheme"], r["prompt_len"], r["batch"]): r for r in rows}
    out = []
    for bar in BARS:
        metric = f"{bar['kind']}_tok_s"
        for (scheme, prompt_len, batch), row in index.items():
            if scheme != bar["scheme"] or (bar["batches"] is not None and batch not in bar["batches"]) \
                    or (bar["prompts"] is not None and prompt_len not in bar["prompts"]):
                continue
            base = index.get((bar["base"], prompt_len, batch))
            if base is None:
                continue
            entry = {"what": f"{scheme} {bar['kind']} vs {bar['base']}", "kind": bar["kind"], "scheme": scheme,
                     "base": bar["base"], "prompt_len": prompt_len, "batch": batch, "bar": bar["need"],
                     "source": bar["source"], "ratio": None, "met": None, "note": ""}
            if base.get(metric) is None:
                entry["note"] = f"{bar['base']} {base.get('status', 'not reached')}"
            elif row.get(metric) is None:
                entry.update(met=False, note=row.get("status", "not reached"))
            else:
                ratio = row[metric] / base[metric]
                entry.update(ratio=ratio, met=ratio >= bar["need"])
            out.append(entry)
    return out


def step_table(row: dict[str, Any], top: int = 12) -> list[str]:
    """A scheme's kernels per decode step; 'between kernels' is the step's wall time (from the
    timed runs) less the kernels' sum."""
    kernels = row["step_kernels"]
    step_us = 1e6 * row["batch"] / row["decode_tok_s"]
    busy = sum(k["us_per_step"] for k in kernels)
    launches = sum(k["per_step"] for k in kernels)
    lines = ["", f"### {row['scheme']}, prompt {row['prompt_len']}, batch {row['batch']}: one decode step", "",
             f"{step_us:.0f} µs per step: {busy:.0f} µs in {launches:.0f} kernels, "
             f"{step_us - busy:.0f} µs between them.", "",
             "| kernel | per step | µs per step |", "|---|---:|---:|"]
    lines += [f"| `{k['kernel'][:90]}` | {k['per_step']:.1f} | {k['us_per_step']:.1f} |" for k in kernels[:top]]
    rest = kernels[top:]
    if rest:
        lines.append(f"| {len(rest)} others | {sum(k['per_step'] for k in rest):.1f} | "
                     f"{sum(k['us_per_step'] for k in rest):.1f} |")
    return lines


def profile_table(profiles: list[dict[str, Any]]) -> list[str]:
    """The prefill profiles: time per kernel kind (share of the kernels' sum) per scheme."""
    ok = [p for p in profiles if "kinds" in p]
    first = profiles[0]
    unit = "kernels" if first.get("activity", "cuda") == "cuda" else "CPU ops (self time)"
    lines = ["", f"## Prefill profile: prompt {first['prompt_len']}, batch {first['batch']}", "",
             f"One prefill under torch.profiler; ms in {unit} by kind (share of their sum); gap = wall − "
             "kernels: host time the device waits through (launches, Python). Wall: the median of three "
             "unprofiled prefills on a GPU, the profiled one on CPU.", "",
             "| scheme | wall ms | kernels ms | gap ms | launches | "
             + " | ".join(KIND_LABELS[k] for k in KINDS) + " |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(KINDS)]
    for p in ok:
        busy = max(p["kernel_ms"], 1e-9)
        cells = [f"{p['kinds'][k]['ms']:.2f} ({p['kinds'][k]['ms'] / busy:.0%})" if p["kinds"][k]["ms"] else "—"
                 for k in KINDS]
        wall = p["wall_ms"] if p["activity"] == "cuda" else p["profiled_wall_ms"]
        lines.append(f"| {p['scheme']} | {wall:.2f} | {p['kernel_ms']:.2f} | {p['gap_ms']:.2f} | "
                     f"{p['launches']} | " + " | ".join(cells) + " |")
    lines += [f"| {p['scheme']} | {p['error']} |" + " |" * (3 + len(KINDS)) for p in profiles if "error" in p]
    for p in ok:
        lines += ["", f"{p['scheme']}: the longest {len(p['top'])}", "", "| kernel | kind | count | ms |",
                  "|---|---|---:|---:|"]
        lines += [f"| `{t['name'][:90]}` | {t['kind']} | {t['count']} | {t['ms']:.3f} |" for t in p["top"]]
    return lines


def markdown(res: dict[str, Any]) -> str:
    cfg, a = res["config"], res["args"]
    peak = res.get("hbm_tbps")
    lines = [
        f"# Decode benchmark — {res['device']}",
        "",
        f"Qwen2-7B-shaped model with random weights ({res['layers']} layers, hidden {cfg['hidden_size']}, "
        f"intermediate {cfg['intermediate_size']}, {cfg['num_attention_heads']} heads / "
        f"{cfg['num_key_value_heads']} KV heads, vocab {cfg['vocab_size']}), {res['dtype']} activations; "
        f"prompts of {', '.join(map(str, a['prompts']))} tokens, batches {', '.join(map(str, a['batches']))}, "
        f"{a['new_tokens']} new tokens, median of {a['repeats']} runs after a warm-up. "
        + ", ".join(f"{k} {v}" for k, v in res["versions"].items()) + ".",
        "",
        "× bf16: against the bf16 runner at the same prompt and batch. HBM roofline: the bytes a decode step "
        "reads (weights + the batch's K/V at the mean context) × steps/s ÷ "
        + (f"{peak:g} TB/s." if peak else "the peak bandwidth (none known for this device)."),
        "",
        "| scheme | batch | prompt | prefill tok/s | prefill × bf16 | decode tok/s | decode × bf16 | × hf bf16 "
        "| HBM roofline | weights GB | KV GB / step | decode | prefill |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    rows = res["rows"]
    missing = [s for s in a["schemes"] if not any(r["scheme"] == s for r in rows)]
    if missing:  # saved after each combination: a run stopped by a time limit keeps what it measured
        lines[2:2] = [f"Not reached (the run ended before them): {', '.join(missing)}.", ""]
    index = {(r["scheme"], r["prompt_len"], r["batch"]): r for r in rows}
    order = {s: i for i, s in enumerate(SCHEMES)}

    def vs(r, base: str, metric: str) -> str:
        b = index.get((base, r["prompt_len"], r["batch"]))
        if r.get(metric) is None or b is None or b.get(metric) is None:
            return "—"
        return f"{r[metric] / b[metric]:.2f}×"

    for r in sorted(rows, key=lambda r: (r["prompt_len"], r["batch"], order.get(r["scheme"], len(order)))):
        if r.get("prefill_tok_s") is None:
            lines.append(f"| {r['scheme']} | {r['batch']} | {r['prompt_len']} | {r['status']} | | | | | | | | "
                         f"{r.get('error', '')[:80]} | |")
            continue
        roof = f"{r['hbm_roofline']:.1%}" if r.get("hbm_roofline") is not None else "—"
        lines.append(f"| {r['scheme']} | {r['batch']} | {r['prompt_len']} | {r['prefill_tok_s']:.1f} | "
                     f"{vs(r, 'bf16', 'prefill_tok_s')} | {r['decode_tok_s']:.1f} | {vs(r, 'bf16', 'decode_tok_s')} | "
                     f"{vs(r, 'hf-bf16', 'decode_tok_s')} | {roof} | {r['weight_gb']:.2f} | "
                     f"{r['kv_gb_per_step']:.3f} | {r['decode_mode']} | {r.get('prefill_mode', '—')} |")
    if any(r["scheme"] == "w4a16-floor" for r in rows):
        lines += ["", "w4a16-floor: the W4A16 model with every decode GEMM replaced by a kernel that only "
                  "reads the GEMM's weight bytes (benchmarks/read_floor.py) — the most any W4A16 kernel "
                  "could give this runner."]
    if res.get("prefill_profiles"):
        lines += profile_table(res["prefill_profiles"])
    for r in rows:
        if r.get("step_kernels"):
            lines += step_table(r)
    if res["bars"]:
        met = sum(1 for b in res["bars"] if b["met"])
        lines += ["", "## Bars", "",
                  f"{met} of {len(res['bars'])} met (this run). issue: \"the runner never slower than bf16\"; "
                  "earlier: the W4A16 decode targets before it.", "",
                  "| bar | source | prompt | batch | × | need | |", "|---|---|---:|---:|---:|---:|---|"]
        for b in res["bars"]:
            state = "—" if b["met"] is None else ("met" if b["met"] else "**not met**")
            ratio = f"{b['ratio']:.2f}×" if b["ratio"] is not None else "—"
            note = f" ({b['note']})" if b["note"] else ""
            lines.append(f"| {b['what']} | {b['source']} | {b['prompt_len']} | {b['batch']} | {ratio} | "
                         f"≥ {b['bar']}× | {state}{note} |")
    if res["tiny"]:
        lines += ["", "_--tiny: a smoke test of the script, not a measurement._"]
    return "\n".join(lines) + "\n"


def save(res: dict[str, Any], out: Path) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "_", res["device"].lower()).strip("_")
    slug = "cpu" if res["device"].startswith("CPU") else slug
    stem = out / f"decode_{slug}{'_tiny' if res['tiny'] else ''}"
    out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    stem.with_suffix(".md").write_text(markdown(res))
    return stem


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model, short prompts: a CPU smoke test")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 28, tiny: 2)")
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--batches", type=ints, default=None,
                    help=f"comma-separated batch sizes (default {','.join(map(str, BATCHES))}; "
                         f"tiny {','.join(map(str, TINY_BATCHES))})")
    ap.add_argument("--prompts", type=ints, default=None,
                    help=f"comma-separated prompt lengths in tokens (default {','.join(map(str, PROMPTS))}; "
                         f"tiny {','.join(map(str, TINY_PROMPTS))})")
    ap.add_argument("--prompt-len", type=int, default=None, help="one prompt length (the same as --prompts N)")
    ap.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 128; tiny 8)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--schemes", type=lambda s: s.split(","), default=list(SCHEMES),
                    help=f"comma-separated subset of {','.join(SCHEMES)}")
    ap.add_argument("--decode", choices=("auto", "eager", "graphs", "compile"), default="auto",
                    help="runner decode step: CUDA graph on a GPU by default, eager on CPU")
    ap.add_argument("--prefill", choices=("auto", "eager", "compile"), default="auto",
                    help="runner prefill: each layer compiled with dynamic shapes on a GPU by default, "
                         "eager on CPU")
    ap.add_argument("--attention", choices=("torch", "triton"), default="torch",
                    help="the runner's decode attention: torch ops, or the flash-decoding kernel")
    ap.add_argument("--pdl", action="store_true",
                    help="programmatic dependent launch (QUANTLAB_PDL=1): the GEMV and attention kernels "
                         "and Inductor's decode-step kernels launch early on Hopper")
    ap.add_argument("--fused-decode", action="store_true",
                    help="batch-1 steps of W4A16/W8A16 models as four epilogue GEMVs and the attention's "
                         "partials per layer (Transformer.set_fused_decode)")
    ap.add_argument("--profile", action="store_true",
                    help="also list each runner scheme's kernels per decode step (torch.profiler)")
    ap.add_argument("--profile-prefill", action="store_true",
                    help="per scheme, one prefill at the first prompt length and batch under torch.profiler: "
                         "kernel time by kind (GEMM, dequant, activation quantization, attention, other), "
                         "launches, and the gap to the wall time")
    ap.add_argument("--hbm-tbps", type=float, default=None,
                    help="peak HBM bandwidth in TB/s for the roofline fraction (default: by device name, "
                         "e.g. H200 4.8; none on CPU)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args(argv)
    unknown = set(args.schemes) - set(SCHEMES)
    if unknown:
        ap.error(f"--schemes: unknown {sorted(unknown)}; choose from {', '.join(SCHEMES)}")
    if args.prompts and args.prompt_len:
        ap.error("--prompts and --prompt-len: give one")
    args.batches = args.batches or list(TINY_BATCHES if args.tiny else BATCHES)
    args.prompts = args.prompts or ([args.prompt_len] if args.prompt_len else list(TINY_PROMPTS if args.tiny else PROMPTS))
    if min(args.batches) < 1 or min(args.prompts) < 1:
        ap.error("--batches and --prompts: positive integers")
    args.new_tokens = args.new_tokens or (8 if args.tiny else 128)
    if args.tiny:
        args.repeats = min(args.repeats, 2)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch.set_grad_enabled(False)
    if args.pdl:
        os.environ["QUANTLAB_PDL"] = "1"  # read at each launch and when the decode step compiles
    res = run(args, on_rows=lambda partial: save(partial, args.out))
    stem = save(res, args.out)
    print(markdown(res))
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
