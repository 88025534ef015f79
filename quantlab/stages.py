"""The stages of a run. Each reads what earlier stages wrote in the run directory and writes
its own outputs atomically; none reaches back into another's internals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from quantlab.algorithms import build_algorithm
from quantlab.context import RunContext
from quantlab.data import sampling, sources as data_sources
from quantlab.engine import distributed
from quantlab.engine.expert_coverage import expert_coverage
from quantlab.engine.linear_error import LinearErrors
from quantlab.engine.memory import MemoryPeaks
from quantlab.engine.sequential import LayerContext, run_sequential
from quantlab.eval import rouge, summaries
from quantlab.eval.divergence import divergence
from quantlab.eval.perplexity import PerplexityResult, perplexity
from quantlab.formats import keeps_folded_weights
from quantlab.models.arch import arch_spec_for
from quantlab.models.moe import calibrate_all_experts
from quantlab.progress import console, step
from quantlab.algorithms.act_ranges import ActRanges, canonical_entries
from quantlab.eval.fake_quant import apply_from_canonical, describe
from quantlab.quant.canonical import canonical_model, canonical_writer, layer_tensors, load_fake_quant_model
from quantlab.quant.scale_tables import scale_tables_from_canonical, write_scale_tables
from quantlab.report import write_report
from quantlab.rundir import atomic_path, write_text_atomic

CALIB_TOKENS = "calib/tokens.safetensors"
CALIB_INFO = "calib/info.json"
QUANTIZED = "quantized"
LINEAR_ERRORS = "reports/linear_errors.json"
EXPERT_COVERAGE = "reports/expert_coverage.json"
PPL_FLOAT = "reports/perplexity_float.json"
PPL_QUANT = "reports/perplexity_quantized.json"
DIVERGENCE = "reports/divergence.json"
ROUGE_FLOAT = "reports/rouge_float.jsonl"
ROUGE_QUANT = "reports/rouge_quantized.jsonl"
ROUGE = "reports/rouge.json"
VERIFY = "reports/verify.json"
REPORT_JSON = "reports/report.json"
REPORT_MD = "reports/report.md"
REPORT_HTML = "reports/report.html"


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
    """Quantize layer by layer, writing each finished layer into the canonical form at once:
    with a lazily read checkpoint, host memory holds the non-layer weights and one layer."""
    model, layer_store = ctx.quantize_model()
    spec = arch_spec_for(model)
    algorithms = [build_algorithm(entry) for entry in ctx.recipe.stages]
    head = [a for a, entry in zip(algorithms, ctx.recipe.stages) if getattr(entry.config, "lm_head", False)]
    ids = calibration_ids(ctx)
    peaks = MemoryPeaks.start(ctx.device)
    scales: dict[str, torch.Tensor] = {}
    folded = {} if keeps_folded_weights(ctx.recipe.export) else None
    steps = len(spec.decoder_layers(model)) + bool(head)
    errors, routed = LinearErrors(), {}
    all_experts = ctx.recipe.calibration is not None and ctx.recipe.calibration.all_experts
    calibrate_all_experts(model, all_experts)
    engine = dict(head_algorithms=head, errors=errors, layers_from=layer_store, offload=ctx.recipe.offload_activations)
    if not distributed.current().main:  # another calibration process: the same collectives, no files
        run_sequential(model, spec, ids, algorithms, ctx.device, **engine)
        return
    target = ctx.run.resolve(QUANTIZED)
    with canonical_writer(target) as writer:
        def write_block(block: LayerContext) -> None:
            writer.add_block(layer_tensors(block.prefix, block.layer, block.quantized),
                             {block.full_name(n): qw for n, qw in block.quantized.items()})

        with step(f"quantize ({' → '.join(e.kind for e in ctx.recipe.stages)})", steps) as update:
            run_sequential(model, spec, ids, algorithms, ctx.device, on_layer=update, scales=scales,
                           folded=folded, routed=routed, sink=write_block, **engine)
        extra = {"stages": [e.dump() for e in ctx.recipe.stages], **peaks.stop(),
                 "source_model": ctx.recipe.model.id, "lazy_loading": layer_store is not None}
        if "memory_plan" in ctx.run.manifest:  # the run's plan (pipeline.run_recipe), beside the measured peaks
            extra["memory_plan"] = ctx.run.manifest["memory_plan"]
        ranges = next((a for a in reversed(algorithms) if isinstance(a, ActRanges)), None)
        extra.update(canonical_entries(ranges, scales))
        extra.update({f"{type(a).__name__.lower()}_summary": a.summary() for a in algorithms if hasattr(a, "summary")})
        writer.finish(model, ctx.tokenizer, extra=extra, scales=scales, folded=folded)
    console.print(f"quantize: {len(writer.modules)} Linears in {extra['quantize_seconds']:.1f} s, peak "
                  + ", ".join(f"{k.removeprefix('peak_').removesuffix('_bytes')} {v / 2**30:.1f} GiB"
                              for k, v in extra.items() if k.startswith("peak_")))
    write_text_atomic(ctx.run.resolve(LINEAR_ERRORS), json.dumps(
        {"tokens_per_linear": errors.tokens, "linears": errors.results}, indent=1) + "\n")
    if ranges is not None:
        _write_scale_tables(target)
    if routed:
        coverage = expert_coverage(routed, all_experts, [e.kind for e in ctx.recipe.stages])
        write_text_atomic(ctx.run.resolve(EXPERT_COVERAGE), json.dumps(coverage, indent=1) + "\n")
        console.print(f"experts: {coverage['experts_unreached']} of {coverage['experts']} saw no routed "
                      f"calibration token{' (all calibrated on every token)' if all_experts else ''}")


def _write_scale_tables(target: Path) -> None:
    """PaddleNLP-style absmax tables next to the canonical form (A8W8 / FP8 / C8 runs)."""
    try:
        tables = scale_tables_from_canonical(target)
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


def _evaluate(ctx: RunContext, model: torch.nn.Module, layers: Any, label: str, output: str) -> None:
    ppl = ctx.recipe.evaluate.perplexity
    assert ppl is not None
    stream = eval_tokens(ctx)
    how = ", layer by layer" if layers is not None else ""
    with step(f"perplexity ({label}{how})") as update:
        result = perplexity(model, stream, ppl.seq_len, ppl.max_windows, ctx.device, on_window=update,
                            bos=sampling.bos_prefix(ctx.tokenizer), layers=layers)
    _write_perplexity(ctx, result, label, output)


def _write_perplexity(ctx: RunContext, result: PerplexityResult, label: str, output: str) -> None:
    payload: dict[str, Any] = {"model": label, "dataset": ctx.recipe.evaluate.perplexity.dataset.source,
                               **result.to_dict()}
    write_text_atomic(ctx.run.resolve(output), json.dumps(payload, indent=2) + "\n")
    console.print(f"perplexity ({label}): {result.perplexity:.4f} over {result.windows} windows × {result.seq_len}")


def evaluate_float(ctx: RunContext) -> None:
    """The float baseline, layer by layer when the checkpoint can be read lazily (no step needs
    the whole model in host memory), else on the whole model; the same result either way."""
    _evaluate(ctx, *ctx.float_layers(), "float", PPL_FLOAT)


def _fake_quant_model(ctx: RunContext, announce: bool = True, by_layer: bool = False) -> tuple[torch.nn.Module, Any]:
    """The fake-quant model of the run's canonical form, and its layer store: None for a model
    loaded whole; with `by_layer`, its layers are read (and dequantized) one at a time."""
    source = ctx.run.resolve(QUANTIZED)
    model, layers = canonical_model(source, ctx.dtype) if by_layer else (load_fake_quant_model(source, ctx.dtype), None)
    handles = apply_from_canonical(model, source)  # activations / KV as deployed, if quantized
    if announce and (handles.linears or handles.attentions):
        console.print(f"fake quant: {describe(json.loads((source / 'quant_config.json').read_text()))} "
                      f"on {handles.linears} Linears, {len(handles.attentions)} attention modules")
    return model, layers


def evaluate_quantized(ctx: RunContext) -> None:
    """Perplexity of the fake-quant model; with the float baseline and `kl_divergence`, in the same
    pass over the windows, KL(float ‖ quantized) and top-1 agreement (quantlab.eval.divergence).
    The fake-quant model is read from the canonical form layer by layer (its shards are per
    layer), the float one where its checkpoint allows: no whole model in host memory."""
    ppl = ctx.recipe.evaluate.perplexity
    assert ppl is not None
    model, layers = _fake_quant_model(ctx, by_layer=True)
    if not (ppl.baseline and ppl.kl_divergence):
        _evaluate(ctx, model, layers, "quantized", PPL_QUANT)
        return
    float_model, float_layers = ctx.float_layers()
    stream, bos = eval_tokens(ctx), sampling.bos_prefix(ctx.tokenizer)
    with step("perplexity and divergence from float (quantized)") as update:
        result = divergence(float_model, model, stream, ppl.seq_len, ppl.max_windows, ctx.device,
                            on_window=update, bos=bos, reference_layers=float_layers, candidate_layers=layers)
    quantized = PerplexityResult.of(result.candidate_mean_nll, result.windows, stream, ppl.seq_len,
                                    result.seconds, bos)
    _write_perplexity(ctx, quantized, "quantized", PPL_QUANT)
    write_text_atomic(ctx.run.resolve(DIVERGENCE), json.dumps(result.to_dict(), indent=2) + "\n")
    console.print(f"divergence: KL(float ‖ quantized) mean {result.mean_kld:.5f}, p99 {result.p99_kld:.5f}; "
                  f"top-1 agreement {100 * result.top1_agreement:.2f}% over {result.tokens_scored} tokens")


def _rouge_prompts(ctx: RunContext) -> tuple[list[summaries.Prompt], dict[str, Any]]:
    """The ROUGE prompts (built once per process) and what they were built from."""
    spec = ctx.recipe.evaluate.rouge
    assert spec is not None
    if "rouge_prompts" not in ctx._cache:
        pairs, fields = data_sources.load_summary_pairs(spec.dataset, "evaluate.rouge.dataset")
        style = summaries.prompt_style(spec.prompt, ctx.tokenizer)
        indices = summaries.pick(spec.num_samples, len(pairs), spec.seed)
        prompts = summaries.build_prompts(pairs, indices, ctx.tokenizer, style, spec.template, spec.max_input_tokens)
        tokenize = rouge.choose_tokenize(spec.tokenize, [p.reference for p in prompts])
        ctx._cache["rouge_prompts"] = prompts, {"dataset": spec.dataset.source, **fields, "prompt": style,
                                                "tokenize": tokenize, "stemmer": tokenize == "words"}
    return ctx._cache["rouge_prompts"]


def _summarize(ctx: RunContext, label: str, output: str) -> None:
    """Greedy summaries of every ROUGE prompt by one model, scored, one JSON line per sample.
    The bundled runner generates; a model it cannot build falls back to transformers' `generate`."""
    spec = ctx.recipe.evaluate.rouge
    assert spec is not None
    prompts, info = _rouge_prompts(ctx)
    stop = summaries.stop_ids(ctx.tokenizer, info["prompt"])
    pad = ctx.tokenizer.pad_token_id if ctx.tokenizer.pad_token_id is not None else 0
    with step(f"summaries ({label}): loading"):
        generator, backend = _summary_generator(ctx, label, stop, pad, max(len(p.ids) for p in prompts))
    with step(f"summaries ({label}): {len(prompts)} prompts, batch {spec.batch_size}") as update:
        done = summaries.generate_all(generator, prompts, spec.batch_size, stop, on_batch=update)
    texts = [ctx.tokenizer.decode(t, skip_special_tokens=True).strip() for t in done.tokens]
    scores = rouge.score(texts, [p.reference for p in prompts], info["tokenize"])
    rows = [{"index": p.index, "prompt": p.text, "prompt_tokens": len(p.ids), "reference": p.reference,
             "summary": text, "new_tokens": len(tokens), **scores.sample(i)}
            for i, (p, text, tokens) in enumerate(zip(prompts, texts, done.tokens))]
    meta = {"model": label, "generator": backend, "samples": len(prompts), "seconds": round(done.seconds, 2),
            "samples_per_s": round(len(prompts) / max(done.seconds, 1e-9), 4), "new_tokens": done.new_tokens,
            "batch_size": spec.batch_size, **info, **scores.mean()}
    write_text_atomic(ctx.run.resolve(output), summaries.jsonl(meta, rows))
    console.print(f"ROUGE ({label}): " + ", ".join(f"{k} {v:.2f}" for k, v in scores.mean().items())
                  + f" over {len(prompts)} samples ({info['tokenize']}; {done.seconds:.0f} s, {backend})")


def _summary_generator(ctx: RunContext, label: str, stop: list[int], pad: int,
                       longest_prompt: int) -> tuple[summaries.Generator, str]:
    """The bundled runner of the float or quantized model as a batch generator, or transformers'
    `generate` where the runner cannot build the model; and which of the two it is."""
    from quantlab.errors import UserError
    from quantlab.runner.generate import continuations
    from quantlab.runner.load import from_hf_model, load_runner

    new_tokens = ctx.recipe.evaluate.rouge.max_new_tokens
    try:
        model = (from_hf_model(ctx.float_model(), ctx.device, ctx.dtype) if label == "float"
                 else load_runner(ctx.run.resolve(QUANTIZED), ctx.device, ctx.dtype))
    except UserError as exc:
        console.print(f"summaries ({label}): the runner cannot build this model ({exc}); using transformers")
        hf = (ctx.float_model() if label == "float" else _fake_quant_model(ctx, announce=False)[0]).to(ctx.device)
        return summaries.hf_generator(hf, new_tokens, stop, pad), "transformers"
    model.set_attention("triton")  # where Triton runs; else the torch path

    def generator(batch: list[list[int]]) -> list[list[int]]:
        return continuations(model, batch, new_tokens, stop, pad, max_seq_len=longest_prompt + new_tokens)

    return generator, "runner"


def evaluate_rouge_float(ctx: RunContext) -> None:
    _summarize(ctx, "float", ROUGE_FLOAT)


def evaluate_rouge_quantized(ctx: RunContext) -> None:
    """The quantized model's summaries, and with the float ones the paired difference (reports/rouge.json)."""
    spec = ctx.recipe.evaluate.rouge
    assert spec is not None
    _summarize(ctx, "quantized", ROUGE_QUANT)
    quant_meta, quant_rows = summaries.read_jsonl(ctx.run.resolve(ROUGE_QUANT))
    result: dict[str, Any] = {"quantized": quant_meta}
    if spec.baseline:
        float_meta, float_rows = summaries.read_jsonl(ctx.run.resolve(ROUGE_FLOAT))
        result["float"] = float_meta
        result["difference"] = rouge.paired_difference(rouge.Scores.of_rows(quant_rows, quant_meta["tokenize"]),
                                                       rouge.Scores.of_rows(float_rows, float_meta["tokenize"]),
                                                       spec.bootstrap, ctx.recipe.seed)
        result["identical_summaries"] = round(
            sum(a["summary"] == b["summary"] for a, b in zip(float_rows, quant_rows)) / max(len(quant_rows), 1), 4)
    write_text_atomic(ctx.run.resolve(ROUGE), json.dumps(result, indent=2, ensure_ascii=False) + "\n")


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
                                                      spec.perplexity_windows, device,
                                                      sampling.bos_prefix(ctx.tokenizer))
    result.update(device=str(device), dtype="float64" if exact else ctx.recipe.model.dtype)
    write_text_atomic(ctx.run.resolve(VERIFY), json.dumps(result, indent=2) + "\n")
    console.print(f"verify: greedy agreement {100 * result['greedy_agreement']:.2f}%, "
                  f"logit rel error {result['logits']['rel']:.2e}")


def report(ctx: RunContext) -> None:
    from quantlab.report_html import run_page

    results = [json.loads(ctx.run.resolve(p).read_text()) for p in (PPL_FLOAT, PPL_QUANT)
               if ctx.run.resolve(p).exists()]
    quant_config = json.loads(ctx.run.resolve(f"{QUANTIZED}/quant_config.json").read_text())
    verified = ctx.run.resolve(VERIFY)
    verify_result = json.loads(verified.read_text()) if ctx.recipe.verify and verified.exists() else None
    ppl, rouge_spec = ctx.recipe.evaluate.perplexity, ctx.recipe.evaluate.rouge
    kld = _read_json(ctx, DIVERGENCE) if ppl and ppl.baseline and ppl.kl_divergence else None
    rouge_result = _read_json(ctx, ROUGE) if rouge_spec else None
    quantized = ctx.run.resolve(QUANTIZED)
    size = sum(f.stat().st_size for f in quantized.rglob("*") if f.is_file())
    payload = write_report(ctx.run, ctx.recipe, results, quant_config, REPORT_JSON, REPORT_MD, verify=verify_result,
                           divergence=kld, rouge=rouge_result, linear_errors=_read_json(ctx, LINEAR_ERRORS),
                           size_bytes=size, expert_coverage=_read_json(ctx, EXPERT_COVERAGE))
    write_text_atomic(ctx.run.resolve(REPORT_HTML), run_page(payload, side_by_side(ctx.run.path) if rouge_spec else []))


def side_by_side(run_dir: Path, count: int = 3) -> list[dict[str, str]]:
    """The first `count` ROUGE samples: reference, float and quantized summaries."""
    rows = {}
    for label, path in (("float", ROUGE_FLOAT), ("quantized", ROUGE_QUANT)):
        if (run_dir / path).exists():
            for r in summaries.read_jsonl(run_dir / path)[1][:count]:
                rows.setdefault(r["index"], {"reference": r["reference"]})[label] = r["summary"]
    return [r for r in rows.values() if "quantized" in r]


def _read_json(ctx: RunContext, path: str) -> dict[str, Any] | None:
    target = ctx.run.resolve(path)
    return json.loads(target.read_text(encoding="utf-8")) if target.exists() else None
