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

Per scheme and batch: a warm-up generation (autotuning, CUDA-graph capture), then `--repeats`
timed ones; medians of prefill tokens/s (batch × prompt tokens / prefill time) and decode
tokens/s (batch × (new tokens − 1) / decode-loop time). The runner decodes under a captured
CUDA graph on a GPU (`--decode`), eagerly on CPU.

    python benchmarks/decode.py                     # the GPU run: 28 layers, batch 1 and 16
    python benchmarks/decode.py --layers 8          # a shallower model (memory / time)
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
# decode tok/s at batch 1; the w4a16-head line is informational (the bar names the W4A16 model)
BARS = [("w4a16", "bf16", 2.5), ("w4a16", "hf-bf16", 3.0), ("w4a16-head", "bf16", 2.5)]


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


def time_runner(model, prompts: torch.Tensor, new_tokens: int, repeats: int, decode: str) -> dict[str, Any]:
    from quantlab.runner.generate import generate

    generate(model, prompts, new_tokens, decode=decode)  # warm-up: autotune, graph capture
    runs = [generate(model, prompts, new_tokens, decode=decode) for _ in range(repeats)]
    return {"prefill_tok_s": statistics.median(r.prefill_tokens_per_s for r in runs),
            "decode_tok_s": statistics.median(r.decode_tokens_per_s for r in runs),
            "decode_mode": runs[0].stats["decode"]}


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
    return {"prefill_tok_s": b * p / prefill, "decode_tok_s": b * (new_tokens - 1) / max(total - prefill, 1e-9),
            "decode_mode": "transformers generate"}


def measure(model, label: str, args, device: torch.device, vocab: int, hf: bool = False) -> list[dict[str, Any]]:
    from quantlab.runner.linear import weight_bytes

    rows = []
    for batch in args.batches:
        prompts = torch.randint(0, vocab, (batch, args.prompt_len), generator=torch.Generator().manual_seed(batch))
        prompts = prompts.to(device)
        if hf:
            res = time_hf(model, prompts, args.new_tokens, args.repeats)
            embed = model.get_input_embeddings().weight  # one row per token is read, not the table
            wbytes = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()
        else:
            model.set_attention(args.attention)
            fused = args.fused_decode and model.set_fused_decode(True)
            res = time_runner(model, prompts, args.new_tokens, args.repeats, args.decode)
            if args.profile:
                res["step_kernels"] = step_kernels(model, prompts, args.decode)
            if args.attention != "torch":
                res["decode_mode"] += f" + {args.attention} attention"
            if fused:
                res["decode_mode"] += " + fused epilogues"
            if args.pdl:
                res["decode_mode"] += " + PDL"
            wbytes = weight_bytes(model)  # Linears incl. lm_head; the embedding table is not read whole
        row = {"scheme": label, "batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
               **res, "weight_gb": wbytes / 1e9,
               "decode_weight_gb_s": wbytes * res["decode_tok_s"] / batch / 1e9}
        rows.append(row)
        print(f"  {label:8s} batch {batch:3d}: prefill {res['prefill_tok_s']:10.1f} tok/s, "
              f"decode {res['decode_tok_s']:9.1f} tok/s ({res['decode_mode']})", flush=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return rows


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
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(args: argparse.Namespace, on_rows: Callable[[dict[str, Any]], Any] = lambda res: None) -> dict[str, Any]:
    """Measure every wanted scheme; `on_rows` gets the result so far after each scheme (the
    caller saves it, so a run stopped by a time limit keeps what it measured)."""
    from quantlab.runner.load import from_hf_model

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = qwen2_config(args)
    rows: list[dict[str, Any]] = []

    def result() -> dict[str, Any]:
        return {"device": device_name(device), "dtype": str(dtype).removeprefix("torch."),
                "config": config.to_dict(), "layers": config.num_hidden_layers, "tiny": args.tiny,
                "args": vars(args), "rows": rows, "bars": bars(rows), "versions": versions(),
                "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}

    wanted = set(args.schemes)
    if wanted & {"hf-bf16", "bf16"}:
        hf = hf_model(config, device, dtype)
        if "hf-bf16" in wanted:
            rows += measure(hf, "hf-bf16", args, device, config.vocab_size, hf=True)
            on_rows(result())
        if "bf16" in wanted:
            runner = from_hf_model(hf)
            del hf
            free(device)
            rows += measure(runner, "bf16", args, device, config.vocab_size)
            on_rows(result())
            del runner
        else:
            del hf
        free(device)
    for name in ("w4a16", "w8a8", "fp8", "w4a16-head", "w4a16-floor"):
        if name not in wanted:
            continue
        floor = name == "w4a16-floor"
        if floor and device.type != "cuda":
            print("  w4a16-floor: needs a CUDA GPU (Triton), skipped", flush=True)
            continue
        base, _, variant = name.partition("-")
        model = quantized_runner(config, base, device, dtype, head=variant == "head")
        with gemms_read_only() if floor else contextlib.nullcontext():
            rows += measure(model, name, args, device, config.vocab_size)
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
    def tps(scheme: str) -> float | None:
        return next((r["decode_tok_s"] for r in rows if r["scheme"] == scheme and r["batch"] == 1), None)

    out = []
    for scheme, base, need in BARS:
        a, b = tps(scheme), tps(base)
        if a is None or b is None:
            continue
        ratio = a / b
        out.append({"what": f"{scheme} decode at batch 1 vs {base}", "ratio": ratio, "bar": need, "met": ratio >= need})
    return out


def step_table(row: dict[str, Any], top: int = 12) -> list[str]:
    """A scheme's kernels per decode step; 'between kernels' is the step's wall time (from the
    timed runs) less the kernels' sum."""
    kernels = row["step_kernels"]
    step_us = 1e6 * row["batch"] / row["decode_tok_s"]
    busy = sum(k["us_per_step"] for k in kernels)
    launches = sum(k["per_step"] for k in kernels)
    lines = ["", f"### {row['scheme']}, batch {row['batch']}: one decode step", "",
             f"{step_us:.0f} µs per step: {busy:.0f} µs in {launches:.0f} kernels, "
             f"{step_us - busy:.0f} µs between them.", "",
             "| kernel | per step | µs per step |", "|---|---:|---:|"]
    lines += [f"| `{k['kernel'][:90]}` | {k['per_step']:.1f} | {k['us_per_step']:.1f} |" for k in kernels[:top]]
    rest = kernels[top:]
    if rest:
        lines.append(f"| {len(rest)} others | {sum(k['per_step'] for k in rest):.1f} | "
                     f"{sum(k['us_per_step'] for k in rest):.1f} |")
    return lines


def markdown(res: dict[str, Any]) -> str:
    cfg = res["config"]
    lines = [
        f"# Decode benchmark — {res['device']}",
        "",
        f"Qwen2-7B-shaped model with random weights ({res['layers']} layers, hidden {cfg['hidden_size']}, "
        f"intermediate {cfg['intermediate_size']}, {cfg['num_attention_heads']} heads / "
        f"{cfg['num_key_value_heads']} KV heads, vocab {cfg['vocab_size']}), {res['dtype']} activations; "
        f"prompt {res['args']['prompt_len']} tokens, {res['args']['new_tokens']} new tokens, median of "
        f"{res['args']['repeats']} runs after a warm-up. "
        + ", ".join(f"{k} {v}" for k, v in res["versions"].items()) + ".",
        "",
        "| scheme | batch | prefill tok/s | decode tok/s | × bf16 runner | × hf bf16 | weights GB | decode weight GB/s | decode |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    base = {(r["scheme"], r["batch"]): r["decode_tok_s"] for r in res["rows"]}
    for r in res["rows"]:
        vs = lambda s: f"{r['decode_tok_s'] / base[(s, r['batch'])]:.2f}×" if (s, r["batch"]) in base else "—"  # noqa: E731
        lines.append(f"| {r['scheme']} | {r['batch']} | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.1f} | "
                     f"{vs('bf16')} | {vs('hf-bf16')} | {r['weight_gb']:.2f} | {r['decode_weight_gb_s']:.1f} | "
                     f"{r['decode_mode']} |")
    if any(r["scheme"] == "w4a16-floor" for r in res["rows"]):
        lines += ["", "w4a16-floor: the W4A16 model with every decode GEMM replaced by a kernel that only "
                  "reads the GEMM's weight bytes (benchmarks/read_floor.py) — the most any W4A16 kernel "
                  "could give this runner."]
    for r in res["rows"]:
        if r.get("step_kernels"):
            lines += step_table(r)
    if res["bars"]:
        lines += ["", "## Bars", ""]
        lines += [f"- {'met' if b['met'] else 'NOT met'}: {b['what']}: {b['ratio']:.2f}× (bar {b['bar']}×)"
                  for b in res["bars"]]
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
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="comma-separated batch sizes (default 1,16; tiny 1,2)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 512; tiny 16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 128; tiny 8)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--schemes", type=lambda s: s.split(","), default=list(SCHEMES),
                    help=f"comma-separated subset of {','.join(SCHEMES)}")
    ap.add_argument("--decode", choices=("auto", "eager", "graphs", "compile"), default="auto",
                    help="runner decode step: CUDA graph on a GPU by default, eager on CPU")
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
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args(argv)
    unknown = set(args.schemes) - set(SCHEMES)
    if unknown:
        ap.error(f"--schemes: unknown {sorted(unknown)}; choose from {', '.join(SCHEMES)}")
    args.batches = args.batches or ([1, 2] if args.tiny else [1, 16])
    args.prompt_len = args.prompt_len or (16 if args.tiny else 512)
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
