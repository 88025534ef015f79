"""kill -9 at every moment a run changes its directory, then a resume: the outputs are byte for
byte those of a run that was never killed.

A run changes its directory only by renaming a finished temporary file or directory into place
(`rundir.atomic_path`: artifacts, then the manifest entry that records them) and, inside the
quantize stage, by writing one canonical shard per layer into its temporary directory. Killing
the process just before each of those moments reaches every state the directory can be left
in: every stage boundary (before and after the manifest records a stage), and mid-stage (a
stage's first outputs in place, the rest not; half the quantized layers written). The run is a
forked child of the test process that SIGKILLs itself there, so no Python cleanup runs, as
with a real kill -9; the resume runs here.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from pathlib import Path
from typing import Callable

import pytest

from quantlab import pipeline
from quantlab.quant import canonical
from quantlab.recipe import Recipe, validate_recipe
from conftest import unmeasured
from test_resume import data_files, raw_recipe  # noqa: F401  (the shared tiny recipe and data)

pytestmark = pytest.mark.usefixtures("one_thread")

# The manifest records timestamps, and the Markdown and HTML reports render report.json, which
# is compared without its measurements.
RENDERED = {"manifest.json", "report.md", "report.html"}


def kill_recipe(model_dir: Path, data: tuple[Path, Path], run_dir: Path) -> Recipe:
    """The tiny resume recipe with GPTQ and an export: every kind of stage, one shard per layer."""
    raw = raw_recipe(model_dir, data, run_dir)
    raw["stages"] = [{"gptq": {"weights": {"bits": 4, "symmetric": True, "group_size": 32}}}]
    raw["export"] = ["compressed-tensors"]
    return validate_recipe(raw)


def contents(run_dir: Path) -> dict[str, object]:
    """Every file of a run directory by relative path: its bytes (the directory's own path
    replaced, which recipe.resolved.yaml names), or for JSON its value without the measurements."""
    return {p.relative_to(run_dir).as_posix(): unmeasured(json.loads(p.read_bytes())) if p.suffix == ".json"
            else p.read_bytes().replace(str(run_dir).encode(), b"RUN")
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name not in RENDERED}


def _counting(real: Callable, at: int | None, seen: list[int]) -> Callable:
    """`real`, counted; the `at`-th call (1-based) kills the process before it happens."""
    def call(*args, **kwargs):
        seen[0] += 1
        if seen[0] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    return call


def _child(recipe: Recipe, renames_at: int | None, shards_at: int | None, counts) -> None:
    """Run `recipe`, killed before rename number `renames_at` or shard number `shards_at`;
    `counts` gets (renames, shards) of a run that was not killed."""
    import torch

    torch.set_num_threads(1)  # a forked child must not reuse the parent's OpenMP pool
    renames, shards = [0], [0]
    os.replace = _counting(os.replace, renames_at, renames)
    canonical.CanonicalWriter.add_block = _counting(canonical.CanonicalWriter.add_block, shards_at, shards)
    pipeline.run_recipe(recipe)
    counts.put((renames[0], shards[0]))


def run_in_child(recipe: Recipe, renames_at: int | None = None, shards_at: int | None = None):
    """(exit code, (renames, shards) when the child finished)."""
    ctx = multiprocessing.get_context("fork")
    counts = ctx.SimpleQueue()
    proc = ctx.Process(target=_child, args=(recipe, renames_at, shards_at, counts))
    proc.start()
    proc.join(timeout=300)
    return proc.exitcode, None if counts.empty() else counts.get()


@pytest.fixture(scope="module")
def reference(tiny_model_dir, data_files, tmp_path_factory) -> tuple[dict[str, object], int, int]:
    """A run never killed: its files, and how many renames and shard writes it made."""
    recipe = kill_recipe(tiny_model_dir, data_files, tmp_path_factory.mktemp("reference") / "run")
    code, counts = run_in_child(recipe)
    assert code == 0 and counts is not None
    renames, shards = counts
    assert renames >= 15 and shards >= 2, counts  # every stage's outputs and manifest entries
    return contents(recipe.run_dir), renames, shards


def test_kill_at_every_rename_and_mid_quantize_resumes_to_identical_outputs(
        reference, tiny_model_dir, data_files, tmp_path) -> None:
    want, renames, shards = reference
    points = [("rename", k) for k in range(1, renames + 1)] + [("shard", k) for k in range(2, shards + 1)]
    for kind, k in points:
        recipe = kill_recipe(tiny_model_dir, data_files, tmp_path / f"{kind}{k}" / "run")
        code, _ = run_in_child(recipe, **{f"{kind}s_at": k})
        assert code == -signal.SIGKILL, (kind, k, code)
        pipeline.run_recipe(recipe)  # resume in this process
        got = contents(recipe.run_dir)
        assert got.keys() == want.keys(), (kind, k, sorted(got.keys() ^ want.keys()))
        assert [f for f in want if got[f] != want[f]] == [], (kind, k)
        assert not list(recipe.run_dir.rglob("*.partial")), (kind, k)
