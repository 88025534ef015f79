"""llm-compressor peer: `oneshot` GPTQ (W4A16, group size from the command line) or AWQ
(AWQ scales + W4A16 asym quantization) on the shared calibration ids, then quantlab's
perplexity on the in-memory model in this same process.

Runs inside the llmcompressor virtualenv. After `oneshot` the model carries
compressed-tensors quantization parameters and its Linears quantize-dequantize their
weights in forward, i.e. it computes what the saved checkpoint computes; scoring it in
memory avoids a save/load round trip that is not part of quantization.
Settings mirror quantlab's recipes: GPTQ dampening 0.01, no act-order (llm-compressor's
default is `static` act-order, so it is switched off explicitly), lm_head left in float.
"""

from __future__ import annotations

import sys

import _common


def scheme(args):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(num_bits=args.bits, type="int", symmetric=args.sym, strategy="group",
                               group_size=args.group_size,
                               actorder="static" if args.act_order else None)
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}


def recipe(args):
    if args.method == "gptq":
        from llmcompressor.modifiers.quantization import GPTQModifier

        return [GPTQModifier(config_groups=scheme(args), ignore=["lm_head"], dampening_frac=args.damp,
                             actorder="static" if args.act_order else None)]
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    return [AWQModifier(), QuantizationModifier(config_groups=scheme(args), ignore=["lm_head"])]


def cpu_only_workarounds() -> list[str]:
    """llm-compressor 0.14 AWQ pins its cached activations (`tensor.pin_memory()`) before the
    grid search, which raises "Cannot access accelerator device" on a machine with none.
    Pinning only speeds up host-to-device copies, so on CPU it is skipped."""
    import torch

    if torch.accelerator.is_available():
        return []
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    return ["patched IntermediatesCache.pin_memory to a no-op (pin_memory needs an accelerator)"]


def main() -> int:
    args = _common.parse_args(__doc__.splitlines()[0])
    timer = _common.Timer()
    result: dict = {"tool": "llmcompressor", "method": args.method, "group_size": args.group_size,
                    "sym": args.sym, "versions": _common.versions("llmcompressor", "compressed-tensors")}
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
        modifiers = recipe(args)
        result["config"] = [repr(m)[:600] for m in modifiers]
        with timer.measure("quantize"):
            model = oneshot(model=model, tokenizer=tokenizer, dataset=data, recipe=modifiers,
                            num_calibration_samples=ids.shape[0], max_seq_length=ids.shape[1],
                            shuffle_calibration_samples=False, output_dir=None) or model
        result["quantized_linears"] = sum(1 for m in model.modules() if hasattr(m, "weight_scale"))
        if result["quantized_linears"] == 0:
            raise RuntimeError("oneshot left no quantized Linear (no weight_scale parameters)")
        with timer.measure("eval"):
            result["perplexity"] = _common.score(model, args)
        result["status"] = "ok"
    except Exception as exc:  # the benchmark records a peer's failure instead of crashing
        _common.record_failure(result, exc)
    return _common.finish(args, result, timer)


if __name__ == "__main__":
    sys.exit(main())
