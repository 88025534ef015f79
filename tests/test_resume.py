"""Resumable runs: an interrupted run keeps finished stages, a rerun skips them byte-for-byte,
and a run that finished nothing leaves no directory behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from quantlab import stages
from quantlab.errors import UserError
from quantlab.pipeline import run_recipe
from quantlab.plan import build_plan
from quantlab.recipe import Recipe, validate_recipe
from conftest import WIKI_TEST, WIKI_TRAIN

ALL_STAGES = ["calibration", "evaluate_float", "quantize", "evaluate_quantized", "report"]


@pytest.fixture(scope="module")
def data_files(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("data")
    calib, test = root / "calib.txt", root / "test.raw"
    calib.write_text("".join(WIKI_TRAIN.read_text(encoding="utf-8").splitlines(keepends=True)[:150]))
    test.write_text("".join(WIKI_TEST.read_text(encoding="utf-8").splitlines(keepends=True)[:60]))
    return calib, test


def raw_recipe(model_dir: Path, data: tuple[Path, Path], run_dir: Path) -> dict:
    return {
        "name": "resume_test",
        "seed": 0,
        "device": "cpu",
        "model": {"id": str(model_dir)},
        "calibration": {"dataset": {"source": str(data[0])}, "num_samples": 4, "seq_len": 32},
        "stages": [{"rtn": {"weights": {"bits": 4, "symmetric": False, "group_size": 32}}}],
        "evaluate": {"perplexity": {"dataset": {"source": str(data[1])}, "seq_len": 32, "max_windows": 2}},
        "output": {"dir": str(run_dir)},
    }


@pytest.fixture()
def recipe(tiny_model_dir, data_files, tmp_path) -> Recipe:
    return validate_recipe(raw_recipe(tiny_model_dir, data_files, tmp_path / "run"))


def manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def interrupt(_ctx) -> None:
    raise KeyboardInterrupt


def must_not_run(ctx) -> None:
    raise AssertionError("a finished stage ran again")


def test_interrupted_run_resumes_without_redoing_calibration(recipe: Recipe, monkeypatch) -> None:
    run_dir = recipe.run_dir
    real_quantize = stages.quantize
    monkeypatch.setattr(stages, "quantize", interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_recipe(recipe)

    tokens = run_dir / stages.CALIB_TOKENS
    assert tokens.is_file() and (run_dir / stages.CALIB_INFO).is_file()
    first = manifest(run_dir)
    assert list(first["stages"]) == ["calibration", "evaluate_float"]
    assert set(first["stages"]["calibration"]["outputs"]) == {stages.CALIB_TOKENS, stages.CALIB_INFO}
    assert not (run_dir / stages.QUANTIZED).exists()
    assert not list(run_dir.rglob("*.partial"))
    content, mtime = tokens.read_bytes(), tokens.stat().st_mtime_ns

    # The plan binds stage functions when it is built, i.e. inside run_recipe: patching the
    # module attributes now changes what the second run calls.
    monkeypatch.setattr(stages, "quantize", real_quantize)
    monkeypatch.setattr(stages, "calibrate", must_not_run)
    monkeypatch.setattr(stages, "evaluate_float", must_not_run)
    run_recipe(recipe)

    assert tokens.read_bytes() == content and tokens.stat().st_mtime_ns == mtime
    second = manifest(run_dir)
    assert list(second["stages"]) == ALL_STAGES
    assert second["stages"]["calibration"] == first["stages"]["calibration"]
    assert second["stages"]["evaluate_float"] == first["stages"]["evaluate_float"]
    report = json.loads((run_dir / stages.REPORT_JSON).read_text())
    assert [r["model"] for r in report["perplexity"]] == ["float", "quantized"]
    assert all(r["windows"] == 2 and r["seq_len"] == 32 for r in report["perplexity"])
    assert report["quantized_linears"] == 14
    kld = report["divergence"]
    assert kld["mean_kld"] > 0 and 0 < kld["top1_agreement"] <= 1 and kld["tokens_scored"] == 2 * 31
    assert "## Divergence from float" in (run_dir / stages.REPORT_MD).read_text()
    assert (run_dir / stages.REPORT_MD).is_file() and (run_dir / "recipe.resolved.yaml").is_file()
    assert validate_recipe(yaml.safe_load((run_dir / "recipe.resolved.yaml").read_text())) == recipe

    # A third run with nothing changed does no work at all.
    for name in ("calibrate", "quantize", "evaluate_float", "evaluate_quantized", "report"):
        monkeypatch.setattr(stages, name, must_not_run)
    run_recipe(recipe)
    assert manifest(run_dir)["stages"] == second["stages"]


def test_deleted_output_reruns_only_that_stage(recipe: Recipe, monkeypatch) -> None:
    run_recipe(recipe)
    (recipe.run_dir / stages.PPL_QUANT).unlink()
    ran = []
    for name in ("calibrate", "quantize", "evaluate_float", "evaluate_quantized", "report"):
        real = getattr(stages, name)
        monkeypatch.setattr(stages, name, lambda ctx, real=real, name=name: (ran.append(name), real(ctx)))
    run_recipe(recipe)
    assert ran == ["evaluate_quantized"]  # the report's key is unchanged, its outputs exist


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_failure_before_any_stage_finishes_leaves_no_run_dir(recipe: Recipe, monkeypatch, error) -> None:
    def fail(_ctx):
        raise error

    monkeypatch.setattr(stages, "calibrate", fail)
    with pytest.raises(type(error)):
        run_recipe(recipe)
    assert not recipe.run_dir.exists()


def test_an_existing_directory_that_is_not_a_run_is_refused_and_kept(recipe: Recipe) -> None:
    recipe.run_dir.mkdir()
    (recipe.run_dir / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not a quantlab run directory"):
        run_recipe(recipe)
    assert sorted(p.name for p in recipe.run_dir.iterdir()) == ["notes.txt"]


def test_an_interrupted_run_in_an_empty_existing_directory_keeps_it(recipe: Recipe, monkeypatch) -> None:
    recipe.run_dir.mkdir()
    monkeypatch.setattr(stages, "calibrate", interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_recipe(recipe)
    assert recipe.run_dir.is_dir()


def test_cli_interrupt_exits_130_and_keeps_finished_stages(tiny_model_dir, data_files, tmp_path, monkeypatch) -> None:
    from quantlab.cli import app

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw_recipe(tiny_model_dir, data_files, tmp_path / "run")))
    monkeypatch.setattr(stages, "quantize", interrupt)
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 130
    assert "interrupted: finished stages are kept" in result.stderr and "Traceback" not in result.output
    assert list(manifest(tmp_path / "run")["stages"]) == ["calibration", "evaluate_float"]


def test_content_keys_rerun_only_what_depends_on_a_change(tiny_model_dir, data_files, tmp_path) -> None:
    base = raw_recipe(tiny_model_dir, data_files, tmp_path / "run")
    keys = {s.name: s.key for s in build_plan(validate_recipe(base))}
    assert list(keys) == ALL_STAGES

    group = validate_recipe({**base, "stages": [{"rtn": {"weights": {"bits": 4, "symmetric": False,
                                                                      "group_size": 64}}}]})
    changed = {s.name: s.key for s in build_plan(group)}
    assert changed["calibration"] == keys["calibration"] and changed["evaluate_float"] == keys["evaluate_float"]
    assert changed["quantize"] != keys["quantize"] and changed["evaluate_quantized"] != keys["evaluate_quantized"]

    windows = {**base, "evaluate": {"perplexity": {**base["evaluate"]["perplexity"], "max_windows": 3}}}
    changed = {s.name: s.key for s in build_plan(validate_recipe(windows))}
    assert changed["calibration"] == keys["calibration"] and changed["quantize"] == keys["quantize"]
    assert changed["evaluate_float"] != keys["evaluate_float"]

    no_kld = {**base, "evaluate": {"perplexity": {**base["evaluate"]["perplexity"], "kl_divergence": False}}}
    changed = {s.name: s.key for s in build_plan(validate_recipe(no_kld))}
    assert all(changed[n] == keys[n] for n in ("evaluate_float", "quantize"))  # the float side stands
    assert changed["evaluate_quantized"] != keys["evaluate_quantized"]  # it wrote the divergence too

    seed = {s.name: s.key for s in build_plan(validate_recipe({**base, "seed": 1}))}
    assert seed["calibration"] != keys["calibration"] and seed["quantize"] != keys["quantize"]
    assert seed["evaluate_float"] == keys["evaluate_float"]  # float perplexity does not depend on the seed

    per_channel = validate_recipe({**base, "stages": [{"rtn": {"weights": "W8A16"}}]})
    per_group = validate_recipe({**base, "stages": [{"rtn": {"weights": {"bits": 8, "group_size": 128}}}]})
    assert build_plan(per_channel)[2].key != build_plan(per_group)[2].key


def test_too_little_evaluation_data_is_a_one_line_user_error(tiny_model_dir, data_files, tmp_path) -> None:
    from quantlab.cli import app

    short = tmp_path / "short.txt"
    short.write_text("Only a handful of tokens here .\n")
    raw = raw_recipe(tiny_model_dir, data_files, tmp_path / "run")
    raw.pop("calibration")
    raw["evaluate"]["perplexity"]["dataset"]["source"] = str(short)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines()[-1].startswith("error: evaluate.perplexity.seq_len: ")
    assert "Traceback" not in result.output
    assert not (tmp_path / "run").exists()  # failed in the first stage: nothing to resume


def test_other_code_reruns_every_stage(tiny_model_dir, data_files, tmp_path, monkeypatch) -> None:
    """A run directory made by other quantlab code is redone, not reused (stage keys hash the
    source as well as the recipe)."""
    import quantlab.plan as plan_module

    recipe = validate_recipe(raw_recipe(tiny_model_dir, data_files, tmp_path / "run"))
    keys = {s.name: s.key for s in build_plan(recipe)}
    assert keys == {s.name: s.key for s in build_plan(recipe)}  # stable for the same code
    monkeypatch.setattr(plan_module, "code_fingerprint", lambda: "0123456789abcdef")
    other = {s.name: s.key for s in build_plan(recipe)}
    assert all(other[name] != keys[name] for name in ALL_STAGES)


def test_code_fingerprint_follows_the_source(tmp_path) -> None:
    from quantlab.rundir import _fingerprint, code_fingerprint

    pkg = tmp_path / "pkg"
    (pkg / "__pycache__").mkdir(parents=True)
    (pkg / "a.py").write_text("X = 1\n")
    first = code_fingerprint((pkg,))
    (pkg / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"\0")
    (pkg / "notes.txt").write_text("not code")
    _fingerprint.cache_clear()
    assert code_fingerprint((pkg,)) == first  # caches and other files do not count
    (pkg / "a.py").write_text("X = 2\n")
    _fingerprint.cache_clear()
    assert code_fingerprint((pkg,)) != first
    assert len(code_fingerprint()) == 16  # the installed quantlab, kernels included


def test_sigterm_unwinds_like_ctrl_c(tiny_model_dir, data_files, tmp_path, monkeypatch) -> None:
    """A real SIGTERM during the first stage: exit 143, one line, no run directory left."""
    import os
    import signal

    from quantlab.cli import app

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw_recipe(tiny_model_dir, data_files, tmp_path / "run")))
    monkeypatch.setattr(stages, "calibrate", lambda ctx: os.kill(os.getpid(), signal.SIGTERM))
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 143 and result.stderr.strip().splitlines()[-1].startswith("terminated:")
    assert not (tmp_path / "run").exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored for the caller
