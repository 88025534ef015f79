"""The stages of a run. Each reads what earlier stages wrote in the run directory and writes
its own outputs atomically; none reaches back into another's internals."""

from __future__ import annotations

import json
import time
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from quantlab.algorithms import build_algorithm
from quantlab.context import RunContext
from quantlab.data import sampling, sources as data_sources
from quantlab.engine.sequential import run_sequential
from quantlab.eval.perplexity import perplexity
from quantlab.models.arch import arch_spec_for
from quantlab.progress import console, step
from quantlab.quant.canonical import load_fake_quant_model, save_canonical
from quantlab.report import write_report
from quantlab.rundir import atomic_path, write_text_atomic

CALIB_TOKENS = "calib/tokens.safetensors"
CALIB_INFO = "calib/info.json"
QUANTIZED = "quantized"
PPL_FLOAT = "reports/perplexity_float.json"
PPL_QUANT = "reports/perplexity_quantized.json"
REPORT_JSON = "reports/report.json"
REPORT_MD = "reports/report.md"


def calibrate(ctx: RunContext) -> None:
    spec = ctx.recipe.calibration
    assert spec is not None
    with step("calibration: loading data"):
        docs = data_sources.load_documents(spec.dataset, "calibration.dataset", ctx.tokenizer)
    calib = sampling.sample(docs, ctx.tokenizer, spec, ctx.recipe.seed)
    target = ctx.run.resolve(CALIB_TOKENS)
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as tmp:
        save_file({"input_ids": calib.input_ids.contiguous()}, tmp)
    info = {"num_samples": calib.input_ids.shape[0], "seq_len": calib.input_ids.shape[1],
            "strategy": spec.strategy, "source": spec.dataset.source, "documents": len(docs),
            "source_tokens": calib.source_tokens, "seed": ctx.recipe.seed}
    write_text_atomic(ctx.run.resolve(CALIB_INFO), json.dumps(info, indent=2) + "\n")
    console.print(f"calibration: {info['num_samples']} × {info['seq_len']} tokens from {spec.dataset.source}")


def calibration_ids(ctx: RunContext) -> torch.Tensor:
    if ctx.recipe.calibration is None:
        return torch.zeros(0, 1, dtype=torch.int64)
    return load_file(ctx.run.resolve(CALIB_TOKENS))["input_ids"]


def quantize(ctx: RunContext) -> None:
    model = ctx.take_float_model()
    spec = arch_spec_for(model)
    algorithms = [build_algorithm(entry) for entry in ctx.recipe.stages]
    ids = calibration_ids(ctx)
    start = time.perf_counter()
    with step(f"quantize ({' → '.join(e.kind for e in ctx.recipe.stages)})", len(spec.decoder_layers(model))) as update:
        quantized = run_sequential(model, spec, ids, algorithms, ctx.device, on_layer=update)
    seconds = time.perf_counter() - start
    extra = {"stages": [e.model_dump(mode="json", exclude_none=True) for e in ctx.recipe.stages],
             "quantize_seconds": round(seconds, 2), "source_model": ctx.recipe.model.id}
    save_canonical(ctx.run.resolve(QUANTIZED), model, quantized, ctx.tokenizer, extra)
    console.print(f"quantize: {len(quantized)} Linears in {seconds:.1f} s")


def eval_tokens(ctx: RunContext) -> torch.Tensor:
    ppl = ctx.recipe.evaluate.perplexity
    assert ppl is not None
    if "eval_tokens" not in ctx._cache:
        docs = data_sources.load_documents(ppl.dataset, "evaluate.perplexity.dataset", ctx.tokenizer)
        ctx._cache["eval_tokens"] = sampling.tokenize_joined(docs, ctx.tokenizer)
    return ctx._cache["eval_tokens"]


def _evaluate(ctx: RunContext, model: torch.nn.Module, label: str, output: str) -> None:
    ppl = ctx.recipe.evaluate.perplexity
    assert ppl is not None
    stream = eval_tokens(ctx)
    with step(f"perplexity ({label})") as update:
        result = perplexity(model, stream, ppl.seq_len, ppl.max_windows, ctx.device, on_window=update)
    payload: dict[str, Any] = {"model": label, "dataset": ppl.dataset.source, **result.to_dict()}
    write_text_atomic(ctx.run.resolve(output), json.dumps(payload, indent=2) + "\n")
    console.print(f"perplexity ({label}): {result.perplexity:.4f} over {result.windows} windows × {result.seq_len}")


def evaluate_float(ctx: RunContext) -> None:
    _evaluate(ctx, ctx.float_model(), "float", PPL_FLOAT)


def evaluate_quantized(ctx: RunContext) -> None:
    model = load_fake_quant_model(ctx.run.resolve(QUANTIZED), ctx.dtype)
    _evaluate(ctx, model, "quantized", PPL_QUANT)


def report(ctx: RunContext) -> None:
    results = [json.loads(ctx.run.resolve(p).read_text()) for p in (PPL_FLOAT, PPL_QUANT)
               if ctx.run.resolve(p).exists()]
    quant_config = json.loads(ctx.run.resolve(f"{QUANTIZED}/quant_config.json").read_text())
    write_report(ctx.run, ctx.recipe, results, quant_config, REPORT_JSON, REPORT_MD)
