"""Execute a plan over a run directory, skipping stages that are already done.

Under torchrun (`quantlab run --gpus N`) every process runs this with the same recipe: rank 0
runs the calibration stage and the quantize stage first, then everything else, alone; the
other processes wait for rank 0 to reach the quantize stage (its calibration tokens are then
on disk), run that stage with it (the collectives; rank 0 writes the run directory), and exit.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch

from quantlab.admission import admit
from quantlab.context import RunContext, pick_device
from quantlab.engine import distributed
from quantlab.engine.observers import require_reducible
from quantlab.memory_plan import announce
from quantlab.plan import Stage, build_plan, preflight
from quantlab.progress import console
from quantlab.errors import UserError
from quantlab.recipe import Recipe, dump_recipe, load_recipe
from quantlab.rundir import RunDir, write_text_atomic


QUANTIZING = ("calibration", "quantize", "export")
COLLECTIVE = ("calibration", "quantize")  # what rank 0 runs first under several processes
EVALUATION_KEYS = ("evaluate", "verify", "device")


def run_recipe(recipe: Recipe, run_dir: Path | None = None, fixed: dict[str, str] | None = None) -> RunDir:
    """Run every stage of `recipe`; returns the run directory. Resumes a killed run. `fixed`:
    keys of finished stages to keep as they are (`evaluate_run`)."""
    tokenizer = preflight(recipe)
    device = pick_device(recipe.device)
    world = distributed.init_from_env(device.type)
    if world.active:
        check_distributed(recipe, world.size)
        device, console.quiet = world.device, not world.main
    memory = None if fixed else announce(recipe, device, note=False)  # before anything is written
    plan = build_plan(recipe, fixed)
    torch.manual_seed(recipe.seed)
    if not world.main:
        return _quantize_with_rank0(recipe, run_dir or recipe.run_dir, plan, device)
    run = RunDir.open(run_dir or recipe.run_dir)
    try:
        write_text_atomic(run.path / "recipe.resolved.yaml", dump_recipe(recipe))
        ctx = RunContext(recipe, run, device, tokenizer)
        run.manifest["model"] = {"id": recipe.model.id, **ctx.resolved.describe()}
        admit(recipe, Path(ctx.resolved.location))  # preflight skips a model not yet on disk
        if memory is None and not fixed:  # the config.json came with the model
            memory = announce(recipe, device, Path(ctx.resolved.location))
        if memory is not None:
            run.manifest["memory_plan"] = memory.to_dict()
        if run.damaged:
            console.print(f"[yellow]{run.path}/manifest.json is damaged ({run.damaged}): every stage reruns, "
                          "and it is rewritten as they finish[/yellow]")
        for stage in sorted(plan, key=lambda s: s.name not in COLLECTIVE) if world.active else plan:
            if stage.name not in COLLECTIVE:
                distributed.close()  # the rest is rank 0's alone
            done, damage = run.verify(stage.name, stage.key)  # in plan order: upstream damage reruns upstream first
            if world.active and stage.name == "quantize":  # the others start quantizing with us
                distributed.broadcast_object(done)
            if done:
                console.print(f"[dim]skip {stage.name}: done (key {stage.key})[/dim]")
                continue
            if damage:
                console.print(f"[dim]rerun {stage.name}: {damage}[/dim]")
            run.forget(stage.name)
            if stage.shareable and (source := run.adopt_from_sibling(stage.name, stage.key)) is not None:
                console.print(f"[dim]{stage.name}: reused from {source} (same key {stage.key})[/dim]")
                continue
            start = time.perf_counter()
            stage.run(ctx)
            run.record(stage.name, stage.key, list(stage.outputs), time.perf_counter() - start)
    except BaseException:
        if run.created is not None and not run.any_done:
            shutil.rmtree(run.created, ignore_errors=True)  # nothing worth resuming: leave no trace
        raise
    console.print(f"[green]done[/green]: {run.path}/reports/report.md")
    return run


def check_distributed(recipe: Recipe, size: int) -> None:
    """Refuse, before anything runs, what `size` calibration processes cannot do."""
    calib = recipe.calibration
    if calib is not None and calib.num_samples < size:
        raise UserError(f"calibration.num_samples: {calib.num_samples} samples cannot be split over {size} "
                        f"processes; give at least {size}")
    for i, entry in enumerate(recipe.stages):
        if entry.kind == "act_ranges" and entry.config.activations is not None:
            require_reducible(entry.config.activations.observer, f"stages[{i}].act_ranges.activations.observer")


def check_gpus(recipe: Recipe, gpus: int) -> None:
    """`--gpus N`, before N processes start: N CUDA devices here (or, with
    QUANTLAB_DISTRIBUTED_BACKEND=gloo, N CPU processes: how tests run the multi-process path
    on machines without a GPU), and nothing in the recipe that N processes cannot do."""
    if gpus < 1:
        raise UserError(f"--gpus {gpus}: give 1 or more")
    if os.environ.get(distributed.BACKEND_ENV) != "gloo":
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < gpus:
            raise UserError(f"--gpus {gpus}: {found} CUDA device(s) here (QUANTLAB_DISTRIBUTED_BACKEND=gloo "
                            "runs CPU processes instead, for tests)")
        if recipe.device == "cpu":
            raise UserError(f"--gpus {gpus}: the recipe's device is cpu; set device: cuda or auto")
    check_distributed(recipe, gpus)


def _quantize_with_rank0(recipe: Recipe, path: Path, plan: list[Stage], device: torch.device) -> RunDir:
    """A process other than rank 0: once rank 0 reaches the quantize stage (the calibration
    tokens are in the run directory), run it alongside, unless it is done; rank 0 writes."""
    done = distributed.broadcast_object(None)
    run = RunDir(path)
    if not done:
        next(s for s in plan if s.name == "quantize").run(RunContext(recipe, run, device))
    distributed.close()
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
    fixed = finished_quantization(RunDir(run_dir))
    if "quantize" not in fixed:
        raise UserError(f"{run_dir}: the quantize stage never finished; finish the run with quantlab run first")
    return run_recipe(recipe, run_dir, fixed)


def finished_quantization(run: RunDir) -> dict[str, str]:
    """The keys of the run's finished quantizing stages, each verified: a damaged artifact of
    one is refused in one line, since `quantlab eval` never quantizes (a rerun under the
    recorded key would quantize with today's code and file it as the old result)."""
    recorded = run.manifest["stages"]
    fixed = {}
    for name in QUANTIZING:
        if name in recorded:
            done, damage = run.verify(name, recorded[name]["key"])
            if damage:
                raise UserError(f"{run.path}: {damage}; quantlab eval does not quantize again: run the recipe "
                                "with quantlab run to redo that stage")
            if done:
                fixed[name] = recorded[name]["key"]
    return fixed
