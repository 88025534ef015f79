"""A damaged run is caught on resume: a finished stage whose recorded files no longer match
their recorded size and sha256 reruns (and says which file), and a damaged manifest.json
reruns every stage instead of raising. One tiny real run is made per module; each case
damages a copy of it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from quantlab import stages
from quantlab.pipeline import run_recipe
from quantlab.recipe import Recipe, validate_recipe
from quantlab.rundir import RunDir
from conftest import WIKI_TEST, WIKI_TRAIN, unmeasured

STAGE_FUNCTIONS = {"calibration": "calibrate", "evaluate_float": "evaluate_float", "quantize": "quantize",
                   "evaluate_quantized": "evaluate_quantized", "report": "report"}


@pytest.fixture(scope="module")
def finished(tiny_model_dir, tmp_path_factory) -> tuple[Recipe, Path]:
    root = tmp_path_factory.mktemp("integrity")
    calib, test = root / "calib.txt", root / "test.raw"
    calib.write_text("".join(WIKI_TRAIN.read_text(encoding="utf-8").splitlines(keepends=True)[:150]))
    test.write_text("".join(WIKI_TEST.read_text(encoding="utf-8").splitlines(keepends=True)[:60]))
    raw = {
        "name": "integrity_test", "seed": 0, "device": "cpu", "model": {"id": str(tiny_model_dir)},
        "calibration": {"dataset": {"source": str(calib)}, "num_samples": 4, "seq_len": 32},
        "stages": [{"rtn": {"weights": {"bits": 4, "symmetric": False, "group_size": 32}}}],
        "evaluate": {"perplexity": {"dataset": {"source": str(test)}, "seq_len": 32, "max_windows": 2}},
        "output": {"dir": str(root / "finished" / "run")},
    }
    recipe = validate_recipe(raw)
    run_recipe(recipe)
    return recipe, recipe.run_dir, raw


@pytest.fixture()
def copy(finished, tmp_path) -> Path:
    """A copy of the finished run, alone in its parent (no sibling to adopt a stage from)."""
    target = tmp_path / "run"
    shutil.copytree(finished[1], target)
    return target


@pytest.fixture()
def ran(monkeypatch) -> list[str]:
    """The stages that run, in order (the plan binds the module attributes when it is built)."""
    names: list[str] = []
    for stage, attr in STAGE_FUNCTIONS.items():
        real = getattr(stages, attr)
        monkeypatch.setattr(stages, attr, lambda ctx, real=real, stage=stage: (names.append(stage), real(ctx)))
    return names


def shard(run: Path, i: int = 0) -> str:
    return sorted(p.relative_to(run).as_posix() for p in (run / stages.QUANTIZED).glob("model-*.safetensors"))[i]


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def same_size_garbage(path: Path) -> None:  # only the hash can tell
    path.write_bytes(b"x" * path.stat().st_size)


DAMAGE = {
    # case: (the file, relative to the run; what is done to it; the stage that reruns; the message)
    "truncated shard": (lambda run: shard(run, -1), truncate, "quantize", "changed since it was written (size"),
    "100-byte calib tokens": (lambda run: stages.CALIB_TOKENS, lambda p: p.write_bytes(b"\0" * 100), "calibration",
                              "changed since it was written (size 100 bytes"),
    "file deleted in quantized/": (lambda run: f"{stages.QUANTIZED}/tokenizer.json", Path.unlink, "quantize",
                                   "is missing"),
    "garbage quant_config.json": (lambda run: f"{stages.QUANTIZED}/quant_config.json",
                                  same_size_garbage, "quantize", "changed since it was written (sha256 differs)"),
}


def comparable(path: Path) -> bytes | dict:
    """The bytes of a file; for a JSON file, its content less the measurements."""
    return unmeasured(json.loads(path.read_text())) if path.suffix == ".json" else path.read_bytes()


def stage_files(run: Path, stage: str) -> dict[str, bytes | dict]:
    files = json.loads((run / "manifest.json").read_text())["stages"][stage]["files"]
    return {rel: comparable(run / rel) for rel in files}


def messages(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())  # rich wraps long lines


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_artifact_reruns_its_stage(case, finished, copy, ran, capsys) -> None:
    recipe, original, raw = finished
    which, damage, stage, message = DAMAGE[case]
    rel = which(copy)
    damage(copy / rel)
    capsys.readouterr()

    run_recipe(recipe, copy)

    assert ran == [stage]  # its dependents read the artifact before it was damaged: their outputs stand
    assert f"rerun {stage}: {rel} {message}" in messages(capsys)
    assert stage_files(copy, stage) == stage_files(original, stage)  # restored bit for bit
    assert RunDir(copy).is_done(stage, RunDir(original).manifest["stages"][stage]["key"])


MANIFESTS = {"garbage bytes": b"\x89\xff garbage \x00", "a list": b"[]", "stages a list": b'{"stages": []}'}
MORE_MANIFESTS = {  # checked on RunDir alone: the pipeline treats every damaged manifest alike
    "truncated JSON": b'{"stages": {"calibration": {"key": "',
    "no stages": b'{"created": "2026-01-01T00:00:00"}',
    "stages a string": b'{"stages": "calibration"}',
    "entry not an object": b'{"stages": {"calibration": null}}',
    "entry without fields": b'{"stages": {"calibration": {"outputs": 3}}}',
    "digests not a map": b'{"stages": {"calibration": {"key": "k", "outputs": [], "files": []}}}',
    "digest without size": b'{"stages": {"calibration": {"key": "k", "outputs": [], "files": {"a": {"sha256": "0"}}}}}',
}


@pytest.mark.parametrize("case", [*MANIFESTS, *MORE_MANIFESTS])
def test_a_damaged_manifest_counts_nothing_done(case, tmp_path) -> None:
    (tmp_path / "manifest.json").write_bytes({**MANIFESTS, **MORE_MANIFESTS}[case])
    run = RunDir(tmp_path)
    assert run.damaged and run.manifest["stages"] == {} and not run.is_done("calibration", "k")


@pytest.mark.parametrize("case", list(MANIFESTS))
def test_a_damaged_manifest_reruns_every_stage(case, finished, copy, ran, capsys) -> None:
    recipe, original, raw = finished
    (copy / "manifest.json").write_bytes(MANIFESTS[case])
    capsys.readouterr()

    run_recipe(recipe, copy)

    assert ran == list(STAGE_FUNCTIONS)
    assert "manifest.json is damaged" in messages(capsys)
    rewritten = json.loads((copy / "manifest.json").read_text())
    assert list(rewritten["stages"]) == list(STAGE_FUNCTIONS)
    for stage in ("calibration", "evaluate_float", "quantize", "evaluate_quantized"):  # report.md: timings
        assert stage_files(copy, stage) == stage_files(original, stage)


def test_damaged_upstream_reruns_before_a_changed_downstream_stage_reads_it(finished, copy, ran, capsys) -> None:
    """A changed evaluation setting reruns evaluate_quantized, which reads quantized/: the
    damaged quant_config.json is caught by the quantize stage, checked first, and rewritten."""
    recipe, original, raw = finished
    (copy / stages.QUANTIZED / "quant_config.json").write_text("garbage")
    evaluate = {"perplexity": {**raw["evaluate"]["perplexity"], "max_windows": 3}}
    more = validate_recipe({**raw, "evaluate": evaluate})

    run_recipe(more, copy)

    assert ran.index("quantize") < ran.index("evaluate_quantized")
    assert stage_files(copy, "quantize") == stage_files(original, "quantize")


def test_a_manifest_without_digests_is_checked_as_before(finished, copy, ran) -> None:
    """Entries written before "files" was recorded: done when the outputs exist and file
    outputs match their recorded "sha256" (what that code recorded)."""
    recipe, _, _ = finished
    manifest = json.loads((copy / "manifest.json").read_text())
    for entry in manifest["stages"].values():
        del entry["files"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    run_recipe(recipe, copy)
    assert ran == []

    (copy / stages.PPL_FLOAT).write_text("{}")
    run_recipe(recipe, copy)
    assert ran == ["evaluate_float"]


def test_eval_refuses_a_damaged_quantized_model_instead_of_quantizing(copy, ran) -> None:
    from quantlab.errors import UserError
    from quantlab.pipeline import evaluate_run

    truncate(copy / shard(copy, -1))
    with pytest.raises(UserError, match="changed since it was written.*does not quantize again"):
        evaluate_run(copy, ["evaluate.perplexity.max_windows=1"])
    assert ran == []
