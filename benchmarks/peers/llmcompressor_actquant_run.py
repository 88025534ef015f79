"""llm-compressor peer for activation / KV-cache quantization: `oneshot` SmoothQuant + W8A8 or
static FP8 with an FP8 KV cache on the shared calibration ids, then quantlab's perplexity on
the in-memory model in this same process.

  * smoothquant-w8a8: SmoothQuantModifier(smoothing_strength=0.8, the strength of
    llm-compressor's W8A8 example; the class default is 0.5), then QuantizationModifier with
    the `W8A8` preset: int8 symmetric weights per output channel, int8 activations per token
    at run time (dynamic);
  * fp8-kv: QuantizationModifier with the `FP8` preset (e4m3 weights per tensor, static
    per-tensor activation scales from the calibration set) and an FP8 KV cache with one
    static scale per tensor (`kv_cache_scheme`, llm-compressor's default observer).
lm_head stays float in both, as in quantlab's recipes.

After `oneshot`, compressed-tensors quantizes in forward: each Linear fake-quantizes its
input (and weight), and a `QuantizedKVCache` hooked into each attention fake-quantizes K and V.
A model whose activations silently stayed float would score like a weight-only model, so
before scoring one short forward counts those fake-quant calls and the row fails unless every
quantized Linear's input and (fp8-kv) every attention's K and V went through them.
Runs inside the llmcompressor virtualenv; helpers come from `_common` and `llmcompressor_run`.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Any

import _common
from llmcompressor_run import cpu_only_workarounds

METHODS = ("smoothquant-w8a8", "fp8-kv")
SMOOTHING_STRENGTH = 0.8
PROBE_TOKENS = 64


def parse_args() -> argparse.Namespace:
    """The weight-only flags of `_common.parse_args` (bits, group, damp) do not apply here."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="float model directory (HF layout)")
    p.add_argument("--calib", required=True, help="safetensors with input_ids [samples, seq_len]")
    p.add_argument("--eval", required=True, help="safetensors with input_ids [tokens] (the test stream)")
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--seq-len", type=int, default=2048, help="perplexity window")
    p.add_argument("--windows", type=int, default=None, help="first k windows; all when omitted")
    p.add_argument("--workdir", required=True, help="scratch directory")
    p.add_argument("--out", required=True, help="result JSON")
    return p.parse_args()


def recipe(method: str) -> list:
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import SmoothQuantModifier

    if method == "smoothquant-w8a8":
        return [SmoothQuantModifier(smoothing_strength=SMOOTHING_STRENGTH),
                QuantizationModifier(targets=["Linear"], scheme="W8A8", ignore=["lm_head"])]
    kv = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
    return [QuantizationModifier(targets=["Linear"], scheme="FP8", ignore=["lm_head"], kv_cache_scheme=kv)]


def fake_quant_calls(model, ids) -> Counter:
    """compressed-tensors' fake-quant calls in one forward, by what they quantize ("input",
    "weight", "k", "v"): `forward_quantize` as the quantized Linear forward and the quantized
    KV cache look it up in their own modules."""
    import compressed_tensors.modeling.kvcache as kv_module
    import compressed_tensors.quantization.lifecycle.forward as linear_module
    import torch

    calls: Counter = Counter()
    original = linear_module.forward_quantize

    def counting(module, value, base_name, args):
        calls[base_name] += 1
        return original(module, value, base_name, args)

    modules = (linear_module, kv_module)
    for m in modules:
        m.forward_quantize = counting
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for m in modules:
            m.forward_quantize = original
    return calls


def check_fake_quant(model, ids, kv: bool) -> dict[str, Any]:
    """Fail unless the model really quantizes activations (and K/V) in forward."""
    import torch
    from compressed_tensors.quantization import QuantizationStatus

    act_linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)
                   and getattr(getattr(m, "quantization_scheme", None), "input_activations", None) is not None]
    attns = [m for m in model.modules() if hasattr(m, "k_scale") and hasattr(m, "v_scale")]
    quantized = [m for m in model.modules() if getattr(m, "quantization_scheme", None) is not None]
    frozen = sum(getattr(m, "quantization_status", None) == QuantizationStatus.FROZEN for m in quantized)
    calls = fake_quant_calls(model, ids)
    probe = {"linears_with_input_quant": len(act_linears), "attentions_with_kv_scales": len(attns),
             "static_input_scales": sum(hasattr(m, "input_scale") for m in act_linears),
             "frozen_modules": frozen, "quantized_modules": len(quantized), "calls_in_one_forward": dict(calls)}
    problems = []
    if not act_linears or calls["input"] != len(act_linears):
        problems.append(f"{calls['input']} Linear inputs fake-quantized for {len(act_linears)} quantized Linears")
    if kv and (not attns or calls["k"] != len(attns) or calls["v"] != len(attns)):
        problems.append(f"K/V fake-quantized {calls['k']}/{calls['v']} times for {len(attns)} attentions with k_scale")
    if frozen != len(quantized):
        problems.append(f"{frozen} of {len(quantized)} quantized modules frozen")
    if problems:
        raise RuntimeError("activation/KV fake quant not applied in forward: " + "; ".join(problems) + f" ({probe})")
    return probe


def describe(probe: dict[str, Any], kv: bool) -> str:
    calls = probe["calls_in_one_forward"]
    text = (f"fake-quant check: {calls['input']} Linear inputs quantized per forward "
            f"({probe['static_input_scales']} with a static input_scale)")
    if kv:
        text += f", K and V in {calls['k']}/{probe['attentions_with_kv_scales']} attentions"
    return text + f", {probe['frozen_modules']} modules frozen"


def main() -> int:
    args = parse_args()
    timer = _common.Timer()
    kv = args.method == "fp8-kv"
    result: dict = {"tool": "llmcompressor", "method": args.method, "group_size": None, "sym": None,
                    "versions": _common.versions("llmcompressor", "compressed-tensors"), "notes": []}
    try:
        import torch
        from datasets import Dataset
        from llmcompressor import oneshot
        from transformers import AutoModelForCausalLM, AutoTokenizer

        ids = _common.calibration_ids(args.calib)
        data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
        with timer.measure("load"):
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(args.model)
        result["workarounds"] = cpu_only_workarounds()
        modifiers = recipe(args.method)
        result["config"] = [repr(m)[:600] for m in modifiers]
        with timer.measure("quantize"):
            model = oneshot(model=model, tokenizer=tokenizer, dataset=data, recipe=modifiers,
                            num_calibration_samples=ids.shape[0], max_seq_length=ids.shape[1],
                            shuffle_calibration_samples=False, output_dir=None) or model
        model.eval()
        result["quantized_linears"] = sum(1 for m in model.modules() if hasattr(m, "weight_scale"))
        with timer.measure("check"):
            probe = check_fake_quant(model, _common.eval_stream(args.eval)[:PROBE_TOKENS].unsqueeze(0), kv)
        result["fake_quant_probe"] = probe
        result["notes"].append(describe(probe, kv))
        if args.method == "smoothquant-w8a8":
            result["notes"].append(f"SmoothQuant smoothing_strength {SMOOTHING_STRENGTH} (class default 0.5)")
        if kv:
            result["notes"].append("KV scale observer: llm-compressor's default for kv_cache_scheme (`minmax`)")
        with timer.measure("eval"):
            result["perplexity"] = _common.score(model, args)
        result["status"] = "ok"
    except Exception as exc:  # the benchmark records a peer's failure instead of crashing
        _common.record_failure(result, exc, limit=600)
    return _common.finish(args, result, timer)


if __name__ == "__main__":
    sys.exit(main())
