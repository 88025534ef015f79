"""Execute a plan over a run directory, skipping stages that are already done."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from quantlab.admission import admit
from quantlab.context import RunContext, pick_device
from quantlab.plan import build_plan, preflight
from quantlab.progress import console
from quantlab.errors import UserError
from quantlab.recipe import Recipe, dump_recipe, load_recipe
from quantlab.rundir import RunDir, write_text_atomic


QUANTIZING = ("calibration", "quantize", "export")
EVALUATION_KEYS = ("evaluate", "verify", "device")


def run_recipe(recipe: Recipe, run_dir: Path | None = None, fixed: dict[str, str] | None = None) -> RunDir:
    """Run every stage of `recipe`; returns the run directory. Resumes a killed run. `fixed`:
    keys of finished stages to keep as they are (`evaluate_run`)."""
    preflight(recipe)
    device = pick_device(recipe.device)
    plan = build_plan(recipe, fixed)
    torch.manual_seed(recipe.seed)
    run = RunDir.open(run_dir or recipe.run_dir)
    try:
        write_text_atomic(run.path / "recipe.resolved.yaml", dump_recipe(recipe))
        ctx = RunContext(recipe, run, device)
        run.manifest["model"] = {"id": recipe.model.id, **ctx.resolved.describe()}
        admit(recipe, Path(ctx.resolved.location))  # preflight skips a model not yet on disk
        for stage in plan:
            if run.is_done(stage.name, stage.key):
                console.print(f"[dim]skip {stage.name}: done (key {stage.key})[/dim]")
                continue
            run.forget(stage.name)
            if stage.shareable and (source := run.adopt_from_sibling(stage.name, stage.key)) is not None:
                console.print(f"[dim]{stage.name}: reused from {source} (same key {stage.key})[/dim]")
                continue
            start = time.perf_counter()
            stage.run(ctx)
            run.record(stage.name, stage.key, list(stage.outputs), time.perf_counter() - start)
    except BaseException:
        if run.created_now and not run.any_done:
            shutil.rmtree(run.path, ignore_errors=True)  # nothing worth resuming: leave no trace
        raise
    console.print(f"[green]done[/green]: {run.path}/reports/report.md")
    return run


def evaluate_run(run_dir: Path, overrides: list[str] | None = None) -> RunDir:
    """Evaluate a finished run again, with `evaluate.*` / `verify.*` / `device` overrides, on the
    quantized model it holds: calibration, quantization and exports are never redone (their
    recorded keys stand); evaluation stages follow the resume rules of `run_recipe`."""
    for item in overrides or []:
        key = item.split("=", 1)[0].strip()
        if key.split(".", 1)[0] not in EVALUATION_KEYS:
            raise UserError(f"--set {key}: quantlab eval changes only {', '.join(k + '.*' for k in EVALUATION_KEYS[:2])} "
                            "and device; to change the quantization, run the recipe with quantlab run")
    resolved = run_dir / "recipe.resolved.yaml"
    if not resolved.is_file():
        raise UserError(f"{run_dir}: not a run directory (no recipe.resolved.yaml); give a directory quantlab run made")
    recipe = load_recipe(resolved, [*(overrides or []), f"output.dir={run_dir}"])
    stages = RunDir(run_dir).manifest["stages"]
    fixed = {name: stages[name]["key"] for name in QUANTIZING
             if name in stages and all((run_dir / o).exists() for o in stages[name]["outputs"])}
    if "quantize" not in fixed:
        raise UserError(f"{run_dir}: the quantize stage never finished; finish the run with quantlab run first")
    return run_recipe(recipe, run_dir, fixed)
