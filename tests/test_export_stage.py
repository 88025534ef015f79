"""The `export` recipe field and run stage: formats land in run_dir/export/<format>/, the stage
key follows the quantized model and the format list, and bad names are recipe errors."""

from __future__ import annotations

import json

import pytest

from quantlab.errors import UserError
from quantlab.export import api
from quantlab.pipeline import run_recipe
from quantlab.plan import build_plan
from quantlab.recipe import validate_recipe


def raw(model_dir, run_dir, export):
    return {"name": "export_test", "seed": 0, "device": "cpu", "model": {"id": str(model_dir)},
            "stages": [{"rtn": {"weights": {"bits": 4, "symmetric": True, "group_size": 32}}}],
            "export": export, "output": {"dir": str(run_dir)}}


def test_k_quant_export_keeps_the_float_weights(tiny_model_dir, tmp_path):
    """Listing a llama.cpp K-quant makes the quantize stage keep each Linear's float weight
    before rounding (a new quantize key), and the GGUF is quantized from those."""
    run_dir = tmp_path / "run"
    plain = validate_recipe(raw(tiny_model_dir, run_dir, ["gguf-q4_0"]))
    recipe = validate_recipe(raw(tiny_model_dir, run_dir, ["gguf-q4_0", "gguf-q4_k_m"]))
    assert {s.name: s.key for s in build_plan(recipe)}["quantize"] != \
        {s.name: s.key for s in build_plan(plain)}["quantize"]
    run_recipe(recipe)
    assert (run_dir / "quantized" / "folded.safetensors").is_file()
    assert api.inspect(run_dir / "export" / "gguf-q4_k_m").ok
    side = json.loads((run_dir / "export" / "gguf-q4_k_m" / "quantlab_export.json").read_text())
    assert all("folded" in m["encoding"] for m in side["modules"].values())
    side_q4 = json.loads((run_dir / "export" / "gguf-q4_0" / "quantlab_export.json").read_text())
    assert all(m["encoding"] == "transcoded" for m in side_q4["modules"].values())


def test_export_stage_writes_each_format(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    recipe = validate_recipe(raw(tiny_model_dir, run_dir, ["gptq", "gguf-q4_0"]))
    names = [s.name for s in build_plan(recipe)]
    assert names.index("export") == names.index("quantize") + 1
    run_recipe(recipe)
    for fmt in ("gptq", "gguf-q4_0"):
        assert api.inspect(run_dir / "export" / fmt).ok
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["stages"]["export"]["outputs"] == ["export/gptq", "export/gguf-q4_0"]
    side = json.loads((run_dir / "export" / "gptq" / "quantlab_export.json").read_text())
    assert side["source"] == "../../quantized"

    # another format reruns export only; the quantized model is reused
    more = validate_recipe(raw(tiny_model_dir, run_dir, ["gptq", "gguf-q4_0", "awq"]))
    keys = {s.name: s.key for s in build_plan(more)}
    assert keys["quantize"] == {s.name: s.key for s in build_plan(recipe)}["quantize"]
    run_recipe(more)
    again = json.loads((run_dir / "manifest.json").read_text())
    assert again["stages"]["quantize"]["finished"] == manifest["stages"]["quantize"]["finished"]
    assert again["stages"]["export"]["key"] == keys["export"] != manifest["stages"]["export"]["key"]
    assert api.inspect(run_dir / "export" / "awq").ok


def test_no_export_by_default(tiny_model_dir, tmp_path):
    recipe = validate_recipe({k: v for k, v in raw(tiny_model_dir, tmp_path, []).items() if k != "export"})
    assert recipe.export == [] and "export" not in [s.name for s in build_plan(recipe)]


def test_unknown_format_is_a_recipe_error(tiny_model_dir, tmp_path):
    with pytest.raises(UserError, match=r"export\[1\]: got 'onnx'.*'awq'"):
        validate_recipe(raw(tiny_model_dir, tmp_path, ["gptq", "onnx"]))


def test_a_format_the_run_cannot_deliver_is_refused_before_anything_runs(tiny_model_dir, tmp_path):
    """`quantlab validate` and `quantlab run` ask each listed exporter about the canonical form the
    recipe will produce: one line naming the entry and the exporter's reason, exit 2, no run dir."""
    import yaml
    from typer.testing import CliRunner

    from quantlab.cli import app

    run_dir = tmp_path / "run"
    spec = raw(tiny_model_dir, run_dir, ["gptq", "gguf-q4_0"])
    spec["stages"][0]["rtn"]["weights"]["symmetric"] = False
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(spec))
    runner = CliRunner()
    for command in ("validate", "run"):
        result = runner.invoke(app, [command, str(path)])
        assert result.exit_code == 2, result.output
        assert result.output.strip().splitlines() == [
            "error: export[1]: gguf-q4_0: Q4_0 holds symmetric int codes of ≤4 bits in whole 32-column groups; "
            "W4A16_ASYM_g32 would be rounded a second time (export gguf-q8_0 or gguf-q4_1 or gguf-f16, or "
            "quantize with codes and groups it holds)"]
    assert not run_dir.exists()
    spec["export"] = ["gptq", "gguf-q4_1"]
    path.write_text(yaml.safe_dump(spec))
    assert runner.invoke(app, ["validate", str(path)]).exit_code == 0
