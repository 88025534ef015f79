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
from quantlab.recipe import Recipe, dump_recipe
from quantlab.rundir import RunDir, write_text_atomic


def run_recipe(recipe: Recipe, run_dir: Path | None = None) -> RunDir:
    """Run every stage of `recipe`; returns the run directory. Resumes a killed run."""
    preflight(recipe)
    device = pick_device(recipe.device)
    plan = build_plan(recipe)
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
