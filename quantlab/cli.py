"""The `quantlab` command line. User errors print one line and exit 2; no tracebacks."""

from __future__ import annotations

import functools
import importlib.resources
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

from quantlab.errors import UserError
from quantlab.progress import console

# The engine alternates buffers of very different sizes (a layer's activations, an in × in
# Hessian and its factors): with fixed segments PyTorch's allocator reserved 19.8 GB for a
# 10.3 GB peak on a Qwen2-7B-shaped GPTQ run (benchmarks/results/scale_nvidia_h200.md);
# expandable segments map memory as needed. A user's own setting wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Post-training quantization and calibration for LLMs.")

SetOption = Annotated[Optional[list[str]], typer.Option("--set", help="override: key.path=value (YAML value)")]
AllowOutside = Annotated[bool, typer.Option("--allow-outside", help="let output.dir be a new directory outside the "
                                            "runs root ($QUANTLAB_RUNS_ROOT, else the current directory)")]


def user_errors(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _on_sigterm) if main else None
        try:
            return fn(*args, **kwargs)
        except UserError as exc:
            if os.environ.get("RANK", "0") == "0":  # under torchrun every process meets the same bad input
                typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(code=exc.exit_code) from None
        except KeyboardInterrupt as exc:
            what, code = ("terminated", 143) if isinstance(exc, Terminated) else ("interrupted", 130)
            typer.echo(f"{what}: finished stages are kept; run the same command to resume", err=True)
            raise typer.Exit(code=code) from None
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous)

    return wrapper


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's or `kill`'s), raised where the process is, so that it unwinds as
    Ctrl-C does: partial files are removed and a run that finished no stage leaves no directory
    (Python's default for SIGTERM is to die on the spot)."""


def _on_sigterm(_signum: int, _frame: object) -> None:
    raise Terminated


def allow_outside(given: bool) -> None:
    """`--allow-outside`: through the environment, so torchrun's processes inherit it."""
    if given:
        from quantlab.rundir import ALLOW_OUTSIDE_ENV

        os.environ[ALLOW_OUTSIDE_ENV] = "1"


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def shipped_recipes() -> dict[str, Path]:
    root = importlib.resources.files("quantlab.recipes")
    return {p.name.removesuffix(".yaml"): Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}


def recipe_path(arg: str) -> Path:
    """A recipe file, or the name of a recipe that ships with quantlab."""
    path = Path(arg)
    if path.is_file() or path.suffix in (".yaml", ".yml"):
        return path
    shipped = shipped_recipes()
    if arg in shipped:
        return shipped[arg]
    raise UserError(f"{arg}: no such recipe file or shipped recipe; shipped: {', '.join(sorted(shipped))}")


@app.command()
@user_errors
def run(recipe: Annotated[str, typer.Argument(help="recipe YAML file or shipped recipe name")],
        set_: SetOption = None,
        gpus: Annotated[int, typer.Option(help="calibrate on N GPUs: the same command in N processes "
                                               "under torchrun; rank 0 writes the run directory")] = 1,
        outside: AllowOutside = False) -> None:
    """Run a recipe: calibrate, quantize, evaluate, report (resumes a killed run)."""
    from quantlab.recipe import load_recipe

    allow_outside(outside)

    loaded = load_recipe(recipe_path(recipe), set_)
    if gpus != 1:
        under = int(os.environ.get("WORLD_SIZE", "1"))
        if under > 1 and under != gpus:
            raise UserError(f"--gpus {gpus}: already one of {under} processes under torchrun; leave --gpus out")
        if under == 1:
            from quantlab.pipeline import check_gpus
            from quantlab.plan import preflight

            check_gpus(loaded, gpus)
            preflight(loaded)
            raise typer.Exit(code=_torchrun(recipe, set_, gpus))
    _quiet_libraries()
    from quantlab.pipeline import run_recipe

    run_recipe(loaded)


def _torchrun(recipe: str, set_: list[str] | None, gpus: int) -> int:
    """`quantlab run` again in `gpus` processes under torch.distributed.run (torchrun); returns
    the exit code of the process that failed first (2 for bad input, which rank 0 printed on one
    line), or 0. The launcher's own log lines are held back: the processes print what matters."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run as torchrun

    argv = ["--standalone", f"--nproc-per-node={gpus}", "--module", "quantlab", "run", recipe,
            *(f"--set={item}" for item in set_ or [])]
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // gpus)))
    logging.disable(logging.ERROR)
    try:
        torchrun(get_args_parser().parse_args(argv))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode != UserError.exit_code:
            why = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
            typer.echo(f"error: calibration process {rank} of {gpus} failed ({why})", err=True)
        return failure.exitcode if failure.exitcode > 0 else 1
    finally:
        logging.disable(logging.NOTSET)
    return 0


@app.command()
@user_errors
def validate(recipe: Annotated[str, typer.Argument(help="recipe YAML file or shipped recipe name")],
             set_: SetOption = None, outside: AllowOutside = False) -> None:
    """Check a recipe without running it."""
    from quantlab.plan import build_plan, preflight
    from quantlab.recipe import load_recipe

    allow_outside(outside)

    loaded = load_recipe(recipe_path(recipe), set_)
    preflight(loaded)
    from quantlab.context import pick_device
    from quantlab.memory_plan import announce

    announce(loaded, pick_device(loaded.device), say=typer.echo)  # preflight refused a missing one
    stages = " → ".join(s.name for s in build_plan(loaded))
    typer.echo(f"ok: {loaded.name} (model {loaded.model.id}; {stages}; run dir {loaded.run_dir})")


@app.command("export")
@user_errors
def export_cmd(run_dir: Annotated[Path, typer.Argument(help="run directory (or its quantized/ directory)")],
               format_: Annotated[list[str], typer.Option("--format", "-f", help="export format; repeatable")],
               out: Annotated[Optional[Path], typer.Option(help="output root; default RUN_DIR/export")] = None,
               max_shard_size: Annotated[Optional[str], typer.Option(help="safetensors shard limit, e.g. 2GB")] = None,
               force: Annotated[bool, typer.Option("--force", help="replace an existing non-empty OUT/<format>/")] = False,
               ) -> None:
    """Export a finished run's quantized model: each format to OUT/<format>/, validated. An
    existing non-empty target is replaced only with --force (the export replaces it whole)."""
    from quantlab.export.api import export
    from quantlab.formats import FORMATS

    canonical = run_dir if (run_dir / "quant_config.json").is_file() else run_dir / "quantized"
    if not (canonical / "quant_config.json").is_file():
        raise UserError(f"{run_dir}: no quantized model (expected {run_dir}/quantized/quant_config.json); "
                        "run the recipe first")
    unknown = [f for f in format_ if f not in FORMATS]
    if unknown:
        raise UserError(f"--format {unknown[0]!r}: unknown; formats: {', '.join(FORMATS)}")
    root = out or (canonical.parent / "export")
    from quantlab.memory_plan import parse_size

    shard = parse_size(max_shard_size, "--max-shard-size") if max_shard_size else None
    for fmt in dict.fromkeys(format_):
        target = root / fmt
        if target.is_symlink() or (target.exists() and not target.is_dir()):
            raise UserError(f"--out: {target} exists and is not a directory of its own; give another --out")
        if target.is_dir() and any(target.iterdir()) and not force:
            raise UserError(f"--out: {target} already holds files, which the export would replace; "
                            "give another --out, or --force to replace them")
    _quiet_libraries()
    for fmt in dict.fromkeys(format_):
        report = export(canonical, root / fmt, fmt, max_shard_bytes=shard)
        typer.echo(f"ok: {fmt} → {root / fmt} ({len(report.checks)} checks passed)")
        typer.echo(f"    load with {report.facts['engine']}")


@app.command("inspect")
@user_errors
def inspect_cmd(path: Annotated[Path, typer.Argument(help="an export directory, a .gguf file or a canonical dir")]
                ) -> None:
    """Detect an export's format, print what it holds and every rule checked; exit 1 if broken."""
    from quantlab.export.api import inspect

    report = inspect(path)
    typer.echo(f"{report.path}: {report.format}")
    for key, value in report.facts.items():
        if key != "skipped":
            typer.echo(f"  {key}: {value}")
    typer.echo("rules:")
    for rule, (passed, failed) in report.rule_counts().items():
        typer.echo(f"  {'FAIL' if failed else 'ok  '} {rule}: {passed} passed" + (f", {failed} failed" if failed else ""))
    for why in report.facts.get("skipped", []):
        typer.echo(f"  skip {why}")
    for check in report.failures:
        typer.echo(f"  FAIL {check.line()}", err=True)
    if not report.ok:
        raise typer.Exit(code=1)


@app.command("generate")
@user_errors
def generate_cmd(
    run_dir: Annotated[Path, typer.Argument(help="run directory, its quantized/ directory, or a float model directory")],
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="text to continue")],
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_k: Annotated[Optional[int], typer.Option(help="sample among the k most likely tokens")] = None,
    seed: Annotated[int, typer.Option(help="sampling seed")] = 0,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
    chat: Annotated[bool, typer.Option(help="wrap the prompt in the tokenizer's chat template")] = False,
    decode: Annotated[str, typer.Option(
        help="decode steps: auto (compile on a GPU, eager on the CPU) | eager | graphs | compile")] = "auto",
    attention: Annotated[str, typer.Option(
        help="decode attention: triton (flash-decoding kernel over the cache as stored, where Triton "
             "runs; else the torch path) | torch")] = "triton",
    fused_decode: Annotated[Optional[bool], typer.Option(
        "--fused-decode/--no-fused-decode",
        help="decode each layer as four GEMVs with fused epilogues and the attention's partials "
             "(W4A16/W8A16 models, batch 1, on a GPU); default: wherever it applies")] = None,
) -> None:
    """Generate text with quantlab's runner from a run's quantized model, streaming to stdout."""
    from quantlab.runner.stream import run_generate

    _quiet_libraries()
    run_generate(run_dir, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                 seed=seed, device=device, chat=chat, decode=decode, attention=attention,
                 fused_decode=fused_decode)


@app.command("eval")
@user_errors
def eval_cmd(run_dir: Annotated[Path, typer.Argument(help="a run directory quantlab run made")],
             set_: SetOption = None) -> None:
    """Evaluate a finished run again (e.g. --set evaluate.rouge.num_samples=200) without quantizing again."""
    _quiet_libraries()
    from quantlab.pipeline import evaluate_run

    evaluate_run(run_dir, set_)


@app.command("compare")
@user_errors
def compare_cmd(run_dirs: Annotated[list[Path], typer.Argument(help="run directories to put side by side")],
                html: Annotated[Optional[Path], typer.Option(help="also write the table and a plot as one HTML file")] = None,
                markdown: Annotated[Optional[Path], typer.Option(help="also write the table as Markdown")] = None,
                json_out: Annotated[Optional[Path], typer.Option("--json", help="also write the rows as JSON")] = None,
                ) -> None:
    """One table across runs: method, scheme, size on disk, quantization time, perplexity, KLD, ROUGE."""
    from rich.table import Table

    from quantlab import compare
    from quantlab.report_html import COMPARE_COLUMNS, compare_page
    from quantlab.rundir import write_text_atomic

    rows = compare.compare_rows(run_dirs)
    table = Table(*COMPARE_COLUMNS)
    for row in rows:
        table.add_row(*("—" if row.get(c) is None else str(row[c]) for c in COMPARE_COLUMNS))
    console.print(table)
    for path, text in ((markdown, lambda: compare.markdown(rows)), (html, lambda: compare_page(rows)),
                       (json_out, lambda: json.dumps(rows, indent=2, ensure_ascii=False) + "\n")):
        if path is not None:
            write_text_atomic(path, text())
            typer.echo(f"wrote {path}")


@app.command("recipes")
def list_recipes() -> None:
    """List the recipes that ship with quantlab."""
    from rich.table import Table

    from quantlab.recipe import read_yaml

    table = Table("name", "model", "stages")
    for name, path in sorted(shipped_recipes().items()):
        raw = read_yaml(path)
        stages = ", ".join(next(iter(s)) for s in raw.get("stages", []) if isinstance(s, dict))
        table.add_row(name, str(raw.get("model", {}).get("id")), stages)
    console.print(table)


@app.command("models")
def list_models() -> None:
    """List built-in model aliases (real models obtainable without a model hub)."""
    from rich.table import Table

    from quantlab.models.builtin import BUILTIN_MODELS

    table = Table("alias", "from", "description")
    for m in BUILTIN_MODELS.values():
        table.add_row(m.alias, m.source, m.description)
    console.print(table)


def main() -> None:  # pragma: no cover - entry point for `python -m quantlab`
    app(prog_name="quantlab")
    sys.exit(0)
