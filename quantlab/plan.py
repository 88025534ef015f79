"""Recipe → Plan: the ordered stages of a run, each with a content key over its inputs.

A stage's key hashes exactly what its outputs depend on (the keys of the stages it reads plus
its own parameters), so a resumed run skips finished stages and a changed parameter reruns
only what depends on it: a new evaluation window count reuses the quantized model, a new
group size reuses the calibration set and the float baseline. The stages that read no other
stage also hash quantlab's source (`rundir.code_fingerprint`), so other code reruns them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from quantlab import stages
from quantlab.admission import admit
from quantlab.context import RunContext, pick_device
from quantlab.data.sources import check_source, check_summary_pairs, check_token_supply
from quantlab.formats import keeps_folded_weights
from quantlab.models.sources import check_model_id, local_tokenizer
from quantlab.recipe import Recipe, verify_dataset
from quantlab.rundir import check_run_dir, code_fingerprint, content_key


@dataclass(frozen=True)
class Stage:
    name: str
    key: str
    outputs: tuple[str, ...]
    run: Callable[[RunContext], None]
    shareable: bool = False  # reads only the float model: a sibling run's finished copy will do


def preflight(recipe: Recipe) -> Any | None:
    """Checks that need the filesystem (and at most one probe of the hub) but no downloads; done
    before a run directory exists, so bad input is refused before anything is written. Returns
    the model's tokenizer when it was loaded to count the data's tokens (the run reuses it: a
    large vocabulary takes seconds to load), else None."""
    check_run_dir(recipe.run_dir)
    pick_device(recipe.device)  # `device: cuda` on a machine without CUDA: refused here, not mid-run
    check_model_id(recipe.model)
    if recipe.calibration:
        check_source(recipe.calibration.dataset, "calibration.dataset")
    if recipe.evaluate.perplexity:
        check_source(recipe.evaluate.perplexity.dataset, "evaluate.perplexity.dataset")
    if recipe.verify and recipe.verify.dataset:
        check_source(recipe.verify.dataset, "verify.dataset")
    if recipe.evaluate.rouge:
        check_source(recipe.evaluate.rouge.dataset, "evaluate.rouge.dataset")
    admit(recipe)
    if recipe.evaluate.rouge:
        check_summary_pairs(recipe.evaluate.rouge.dataset, "evaluate.rouge.dataset")
    return check_token_supply(recipe, lambda: local_tokenizer(recipe.model))  # local data, model on disk


def build_plan(recipe: Recipe, fixed: dict[str, str] | None = None) -> list[Stage]:
    """The stages of `recipe`. `fixed` pins the keys of finished quantizing stages (`quantlab
    eval`: the quantized model on disk stands whatever the code or recipe computes now)."""
    fixed = fixed or {}
    model = recipe.model.model_dump(mode="json")
    code = code_fingerprint()
    plan: list[Stage] = []
    calib_key = "none"
    if recipe.calibration:
        # `offload` places the activations, it changes no result: toggling it reuses finished stages
        calib_key = fixed.get("calibration") or content_key(
            "calibration", code, model, recipe.calibration.model_dump(mode="json", exclude={"offload"}), recipe.seed)
        plan.append(Stage("calibration", calib_key, (stages.CALIB_TOKENS, stages.CALIB_INFO), stages.calibrate))
    ppl = recipe.evaluate.perplexity
    ppl_params = ppl.model_dump(mode="json", exclude={"baseline", "kl_divergence"}) if ppl else None
    if ppl and ppl.baseline:
        plan.append(Stage("evaluate_float", content_key("ppl", code, model, ppl_params), (stages.PPL_FLOAT,),
                          stages.evaluate_float, shareable=True))
    stage_params = [e.model_dump(mode="json", exclude_none=True) for e in recipe.stages]
    # a K-quant export needs the float weights before rounding, which only the quantize stage has
    folded = ["keep folded weights"] if keeps_folded_weights(recipe.export) else []
    quant_key = fixed.get("quantize") or content_key("quantize", code, model, calib_key, stage_params, recipe.seed,
                                                     *folded)
    plan.append(Stage("quantize", quant_key, (stages.QUANTIZED, stages.LINEAR_ERRORS), stages.quantize))
    if recipe.export:
        formats = list(dict.fromkeys(recipe.export))
        plan.append(Stage("export", fixed.get("export") or content_key("export", quant_key, formats),
                          tuple(stages.export_dir(f) for f in formats), stages.export))
    if ppl:
        # with the divergence, one pass over the windows gives both (the float model runs beside)
        kld = ppl.baseline and ppl.kl_divergence
        plan.append(Stage("evaluate_quantized", content_key("ppl", quant_key, ppl_params, *(["kld"] if kld else [])),
                          (stages.PPL_QUANT, *([stages.DIVERGENCE] if kld else [])), stages.evaluate_quantized))
    rouge = recipe.evaluate.rouge
    if rouge:
        params = rouge.model_dump(mode="json", exclude={"baseline", "bootstrap"})
        float_key = "none"
        if rouge.baseline:
            float_key = content_key("rouge", code, model, params)
            plan.append(Stage("evaluate_rouge_float", float_key, (stages.ROUGE_FLOAT,), stages.evaluate_rouge_float,
                              shareable=True))
        plan.append(Stage("evaluate_rouge_quantized",
                          content_key("rouge", quant_key, params, float_key, rouge.bootstrap, recipe.seed),
                          (stages.ROUGE_QUANT, stages.ROUGE), stages.evaluate_rouge_quantized))
    if recipe.verify:
        data = verify_dataset(recipe)
        plan.append(Stage("verify", content_key("verify", quant_key, recipe.verify.model_dump(mode="json"),
                                                data.model_dump(mode="json") if data else None,
                                                recipe.model.dtype, recipe.device),
                          (stages.VERIFY,), stages.verify))
    report_key = content_key("report", [s.key for s in plan])
    plan.append(Stage("report", report_key, (stages.REPORT_JSON, stages.REPORT_MD, stages.REPORT_HTML),
                      stages.report))
    return plan
