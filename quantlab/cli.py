"""The `quantlab` command line. User errors print one line and exit 2; no tracebacks."""

from __future__ import annotations

import functools
import importlib.resources
import os
import sys
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

from quantlab.errors import UserError
from quantlab.progress import console

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Post-training quantization and calibration for LLMs.")

SetOption = Annotated[Optional[list[str]], typer.Option("--set", help="override: key.path=value (YAML value)")]


def user_errors(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(code=exc.exit_code) from None
        except KeyboardInterrupt:
            typer.echo("interrupted: finished stages are kept; run the same command to resume", err=True)
            raise typer.Exit(code=130) from None

    return wrapper


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
        set_: SetOption = None) -> None:
    """Run a recipe: calibrate, quantize, evaluate, report (resumes a killed run)."""
    from quantlab.recipe import load_recipe

    loaded = load_recipe(recipe_path(recipe), set_)
    _quiet_libraries()
    from quantlab.pipeline import run_recipe

    run_recipe(loaded)


@app.command()
@user_errors
def validate(recipe: Annotated[str, typer.Argument(help="recipe YAML file or shipped recipe name")],
             set_: SetOption = None) -> None:
    """Check a recipe without running it."""
    from quantlab.plan import build_plan, preflight
    from quantlab.recipe import load_recipe

    loaded = load_recipe(recipe_path(recipe), set_)
    preflight(loaded)
    stages = " → ".join(s.name for s in build_plan(loaded))
    typer.echo(f"ok: {loaded.name} (model {loaded.model.id}; {stages}; run dir {loaded.run_dir})")


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
        table.add_row(m.alias, f"PyPI {m.pypi_package}=={m.version}", m.description)
    console.print(table)


def main() -> None:  # pragma: no cover - entry point for `python -m quantlab`
    app(prog_name="quantlab")
    sys.exit(0)
