"""The stages of a run. Each reads what earlier stages wrote in the run directory and writes
its own outputs atomically; none reaches back into another's internals."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from quantlab.algorithms import build_algorithm
from quantlab.context import RunContext
from quantlab.data import sampling, sources as data_sources
from quantlab.engine.sequential import run_sequential
from quantlab.eval.divergence import divergence
from quantlab.eval.perplexity import perplexity
from quantlab.formats import keeps_folded_weights
from quantlab.models.arch import arch_spec_for
from quantlab.progress import console, step
from quantlab.algorithms.act_ranges import ActRanges, canonical_entries
from quantlab.eval.fake_quant import apply_from_canonical, describe
from quantlab.quant.canonical import load_fake_quant_model, save_canonical
from quantlab.quant.scale_tables import scale_tables, write_scale_tables
from quantlab.report import write_report
from quantlab.rundir import atomic_path, write_text_atomic

CALIB_TOKENS = "calib/tokens.safetensors"
CALIB_INFO = "calib/info.json"
QUANTIZED = "quantized"
PPL_FLOAT = "reports/perplexity_float.json"
PPL_QUANT = "reports/perplexity_quantized.json"
DIVERGENCE = "reports/divergence.json"
VERIFY = "reports/verify.json"
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
    head = [a for a, entry in zip(algorithms, ctx.recipe.stages) if getattr(entry.config, "lm_head", False)]
    ids = calibration_ids(ctx)
    start = time.perf_counter()
    scales: dict[str, torch.Tensor] = {}
    folded = {} if keeps_folded_weights(ctx.recipe.export) else None
    steps = len(spec.decoder_layers(model)) + bool(head)
    with step(f"quantize ({' → '.join(e.kind for e in ctx.recipe.stages)})", steps) as update:
        quantized = run_sequential(model, spec, ids, algorithms, ctx.device, on_layer=update, scales=scales,
                                   folded=folded, head_algorithms=head)
    seconds = time.perf_counter() - start
    extra = {"stages": [e.dump() for e in ctx.recipe.stages],
             "quantize_seconds": round(seconds, 2), "source_model": ctx.recipe.model.id}
    ranges = next((a for a in reversed(algorithms) if isinstance(a, ActRanges)), None)
    extra.update(canonical_entries(ranges, scales))
    extra.update({f"{type(a).__name__.lower()}_summary": a.summary() for a in algorithms if hasattr(a, "summary")})
    target = ctx.run.resolve(QUANTIZED)
    save_canonical(target, model, quantized, ctx.tokenizer, extra, scales=scales, folded=folded)
    console.print(f"quantize: {len(quantized)} Linears in {seconds:.1f} s")
    if ranges is not None:
        _write_scale_tables(target, model, extra, quantized, scales)


def _write_scale_tables(target: Path, model: torch.nn.Module, quant_config: dict[str, Any],
                        quantized: dict[str, Any], scales: dict[str, torch.Tensor]) -> None:
    """PaddleNLP-style absmax tables next to the canonical form (A8W8 / FP8 / C8 runs)."""
    try:
        tables = scale_tables(model.config.to_dict(), quant_config, quantized, scales)
    except ValueError as exc:
        console.print(f"scale tables: not written ({exc})")
        return
    write_scale_tables(target, tables)
    console.print(f"scale tables: {', '.join(tables)} in {target}")


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


def _fake_quant_model(ctx: RunContext, announce: bool = True) -> torch.nn.Module:
    source = ctx.run.resolve(QUANTIZED)
    model = load_fake_quant_model(source, ctx.dtype)
    handles = apply_from_canonical(model, source)  # activations / KV as deployed, if quantized
    if announce and (handles.linears or handles.attentions):
        console.print(f"fake quant: {describe(json.loads((source / 'quant_config.json').read_text()))} "
                      f"on {handles.linears} Linears, {len(handles.attentions)} attention modules")
    return model


def evaluate_quantized(ctx: RunContext) -> None:
    _evaluate(ctx, _fake_quant_model(ctx), "quantized", PPL_QUANT)


def evaluate_divergence(ctx: RunContext) -> None:
    """KL(float ‖ quantized) and top-1 agreement on the perplexity windows (quantlab.eval.divergence)."""
    ppl = ctx.recipe.evaluate.perplexity
    assert ppl is not None
    with step("divergence from float") as update:
        result = divergence(ctx.float_model(), _fake_quant_model(ctx, announce=False), eval_tokens(ctx), ppl.seq_len,
                            ppl.max_windows, ctx.device, on_window=update)
    write_text_atomic(ctx.run.resolve(DIVERGENCE), json.dumps(result.to_dict(), indent=2) + "\n")
    console.print(f"divergence: KL(float ‖ quantized) mean {result.mean_kld:.5f}, p99 {result.p99_kld:.5f}; "
                  f"top-1 agreement {100 * result.top1_agreement:.2f}% over {result.tokens_scored} tokens")


def export_dir(fmt: str) -> str:
    return f"export/{fmt}"


def export(ctx: RunContext) -> None:
    """Each format goes to `export/<format>/`, written atomically and validated before it lands."""
    from quantlab.export.api import export as export_one

    for fmt in dict.fromkeys(ctx.recipe.export):
        with step(f"export ({fmt})"):
            result = export_one(ctx.run.resolve(QUANTIZED), ctx.run.resolve(export_dir(fmt)), fmt)
        console.print(f"export: {fmt} → {export_dir(fmt)} ({len(result.checks)} checks passed)")


def _verify_tokens(ctx: RunContext) -> torch.Tensor | None:
    """The token stream the verify stage cuts prompts and windows from (shared with evaluation)."""
    from quantlab.recipe import verify_dataset

    data = verify_dataset(ctx.recipe)
    if data is None:
        return None
    ppl = ctx.recipe.evaluate.perplexity
    if ppl is not None and data == ppl.dataset:
        return eval_tokens(ctx)
    docs = data_sources.load_documents(data, "verify.dataset", ctx.tokenizer)
    return sampling.tokenize_joined(docs, ctx.tokenizer)


def verify(ctx: RunContext) -> None:
    """Runner vs fake-quant model on the canonical form: errors, agreement, perplexities."""
    from quantlab.runner import verify as rv
    from quantlab.runner.load import load_runner

    spec = ctx.recipe.verify
    assert spec is not None
    source = ctx.run.resolve(QUANTIZED)
    stream = _verify_tokens(ctx)
    prompts = ([ctx.tokenizer(p).input_ids for p in spec.prompts] if spec.prompts
               else rv.prompts_from_stream(stream, spec.num_prompts, spec.prompt_tokens))
    exact = spec.precision == "float64"
    device, dtype = (torch.device("cpu"), torch.float64) if exact else (ctx.device, ctx.dtype)
    with step("verify: loading runner and fake-quant model"):
        runner = load_runner(source, device, dtype)
        reference = load_fake_quant_model(source, dtype).to(device)
        apply_from_canonical(reference, source)
    with step(f"verify: {len(prompts)} prompts × {spec.max_new_tokens} tokens"):
        # in float64 the reference is its own float64 copy: no floor to measure
        result = rv.compare(runner, reference, prompts, spec.max_new_tokens, floor=not exact)
    if spec.perplexity_windows:
        with step(f"verify: perplexity, {spec.perplexity_windows} windows × {spec.seq_len}"):
            result["perplexity"] = rv.perplexity_pair(runner, reference, stream, spec.seq_len,
                                                      spec.perplexity_windows, device)
    result.update(device=str(device), dtype="float64" if exact else ctx.recipe.model.dtype)
    write_text_atomic(ctx.run.resolve(VERIFY), json.dumps(result, indent=2) + "\n")
    console.print(f"verify: greedy agreement {100 * result['greedy_agreement']:.2f}%, "
                  f"logit rel error {result['logits']['rel']:.2e}")


def report(ctx: RunContext) -> None:
    results = [json.loads(ctx.run.resolve(p).read_text()) for p in (PPL_FLOAT, PPL_QUANT)
               if ctx.run.resolve(p).exists()]
    quant_config = json.loads(ctx.run.resolve(f"{QUANTIZED}/quant_config.json").read_text())
    verified = ctx.run.resolve(VERIFY)
    verify_result = json.loads(verified.read_text()) if ctx.recipe.verify and verified.exists() else None
    ppl = ctx.recipe.evaluate.perplexity
    diverged = ctx.run.resolve(DIVERGENCE)
    kld = (json.loads(diverged.read_text()) if ppl and ppl.baseline and ppl.kl_divergence and diverged.exists()
           else None)
    write_report(ctx.run, ctx.recipe, results, quant_config, REPORT_JSON, REPORT_MD, verify=verify_result,
                 divergence=kld)
