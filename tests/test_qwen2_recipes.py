"""The shipped Qwen2 recipes name `Qwen/Qwen2-0.5B-Instruct` on the hub; `--set model.id=DIR`
must run them unchanged on any local Qwen2 checkpoint. A tiny random Qwen2 (q/k/v biases, GQA)
stands in for the real one, as wide as the recipes' group of 128 (a group wider than a layer's
input is refused): this tests the plumbing, not the quality."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, WIKI_TEST, WIKI_TRAIN, tiny_model
from typer.testing import CliRunner

from quantlab.cli import app
from quantlab.quant.canonical import load_canonical


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tiny_model("qwen2", hidden_size=128, intermediate_size=128).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("recipe", ["qwen2_awq_int4", "qwen2_gptq_int4"])
def test_qwen2_recipe_runs_on_a_local_checkpoint(recipe, tiny_qwen2_dir, tmp_path):
    overrides = {
        "model.id": str(tiny_qwen2_dir),
        "calibration.dataset.source": str(WIKI_TRAIN),
        "calibration.num_samples": "4",
        "calibration.seq_len": "64",
        "evaluate.perplexity.dataset.source": str(WIKI_TEST),
        "evaluate.perplexity.seq_len": "64",
        "evaluate.perplexity.max_windows": "2",
        "output.dir": str(tmp_path / "run"),
    }
    args = ["run", str(REPO / "recipes" / f"{recipe}.yaml")]
    for key, value in overrides.items():
        args += ["--set", f"{key}={value}"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    _, weights = load_canonical(tmp_path / "run" / "quantized")
    names = {n.rsplit(".", 1)[-1] for n in weights}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert all(qw.scheme.bits == 4 and qw.scheme.group_size == 128 for qw in weights.values())
    report = json.loads((tmp_path / "run" / "reports" / "perplexity_quantized.json").read_text())
    assert report["perplexity"] > 1
