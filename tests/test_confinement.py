"""A run writes only into a directory of its own and an export never replaces files it was not
told to: symbolic links, the filesystem root, home, the current directory and its parents,
unrelated non-empty directories and unwritable places are refused in one line before anything
is written; `quantlab export --out` keeps an existing non-empty target unless --force."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from quantlab.cli import app
from quantlab.errors import UserError
from quantlab.rundir import check_run_dir


@pytest.mark.parametrize("given, why", [
    ("/", "filesystem root"), ("~", "home directory"), (".", "current directory"), ("..", "current directory"),
    ("/dev/null/run", "not a writable directory"), ("run\x00x", "NUL"),
])
def test_places_a_run_must_not_write_to(given: str, why: str) -> None:
    with pytest.raises(UserError, match=why):
        check_run_dir(Path(given).expanduser() if given == "~" else Path(given))


def test_a_symlinked_run_dir_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    (target / "quantized").mkdir(parents=True)
    (target / "quantized" / "keep.txt").write_text("mine")
    (tmp_path / "run").symlink_to(target)
    with pytest.raises(UserError, match="symbolic link"):
        check_run_dir(tmp_path / "run")
    check_run_dir(tmp_path / "new" / "run")  # a new directory is fine
    assert (target / "quantized" / "keep.txt").read_text() == "mine"


def test_export_keeps_a_non_empty_target_without_force(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "quantized").mkdir(parents=True)
    (run / "quantized" / "quant_config.json").write_text("{}")
    (tmp_path / "out" / "gptq").mkdir(parents=True)
    (tmp_path / "out" / "gptq" / "precious.txt").write_text("mine")
    result = CliRunner().invoke(app, ["export", str(run), "--format", "gptq", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "--force" in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1
    assert (tmp_path / "out" / "gptq" / "precious.txt").read_text() == "mine"


def test_a_pickle_only_checkpoint_needs_the_opt_in(tmp_path: Path) -> None:
    from quantlab.models.sources import check_model_id
    from quantlab.recipe import ModelSpec

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(UserError, match="pytorch_model.bin.*allow_pickle"):
        check_model_id(ModelSpec(id=str(tmp_path)))
    check_model_id(ModelSpec(id=str(tmp_path), allow_pickle=True))


def test_a_file_that_is_no_checkpoint_is_named_as_one(tmp_path: Path) -> None:
    from quantlab.models.sources import check_model_id
    from quantlab.recipe import ModelSpec

    (tmp_path / "README.md").write_text("# not a model")
    with pytest.raises(UserError, match="is a file, not a checkpoint directory"):
        check_model_id(ModelSpec(id=str(tmp_path / "README.md")))


def test_a_new_run_dir_must_be_under_the_runs_root(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("QUANTLAB_ALLOW_OUTSIDE")
    monkeypatch.chdir(tmp_path)
    check_run_dir(Path("runs/a"))  # under the current directory
    for outside in ("/etc/quantlab-run", str(tmp_path.parent / "elsewhere")):
        with pytest.raises(UserError, match="outside the runs root.*--allow-outside"):
            check_run_dir(Path(outside))
    monkeypatch.setenv("QUANTLAB_RUNS_ROOT", str(tmp_path.parent))
    check_run_dir(tmp_path.parent / "elsewhere")
    with pytest.raises(UserError, match="QUANTLAB_RUNS_ROOT="):
        check_run_dir(Path("/etc/quantlab-run"))
    (tmp_path.parent / "done-run").mkdir()
    (tmp_path.parent / "done-run" / "manifest.json").write_text("{}")
    monkeypatch.delenv("QUANTLAB_RUNS_ROOT")
    check_run_dir(tmp_path.parent / "done-run")  # an existing run stays usable wherever it is


def test_allow_outside_lifts_the_root_for_the_command(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("QUANTLAB_ALLOW_OUTSIDE")
    monkeypatch.chdir(tmp_path)
    args = ["validate", "smollm2_rtn_w4a16", "--set", "output.dir=/tmp/quantlab-outside-test/run"]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "outside the runs root" in refused.stderr
    monkeypatch.setattr("quantlab.plan.check_model_id", lambda spec: None)  # the model is not what is tested
    monkeypatch.setattr("quantlab.plan.check_source", lambda spec, field: None)
    monkeypatch.setattr("quantlab.plan.admit", lambda recipe: None)
    allowed = CliRunner().invoke(app, [*args, "--allow-outside"])
    assert "outside the runs root" not in allowed.output
    assert not Path("/tmp/quantlab-outside-test").exists()  # validate writes nothing
