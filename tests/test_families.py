"""Each newer family end to end on a saved tiny checkpoint of its real config shape (Qwen3:
q/k norms; Qwen3-MoE: routed experts, no shared expert; Gemma 3: a sliding-window and a global
layer, `1 + weight` norms, scaled embeddings, GELU, sandwich norms): AWQ then GPTQ quantize
every Linear, both perplexities come out, and the bundled runner computes what the
fake-quant model computes (logits, greedy tokens, perplexity)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig

from conftest import WIKI_TRAIN, tiny_model
from quantlab.models.arch import ARCH_SPECS, MOE_ARCH_SPECS
from quantlab.pipeline import run_recipe
from quantlab.recipe import validate_recipe

FAMILIES = ("qwen3", "qwen3_moe", "gemma3_text")
W4 = {"bits": 4, "symmetric": False, "group_size": 32}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text("".join(WIKI_TRAIN.read_text(encoding="utf-8").splitlines(keepends=True)[:150]))
    return path


@pytest.fixture(scope="module", params=FAMILIES)
def run(request, tmp_path_factory, tokenizer, data) -> tuple[str, Path]:
    family = request.param
    root = tmp_path_factory.mktemp(family)
    tiny_model(family, seed=3, initializer_range=0.1).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    recipe = validate_recipe({
        "name": family, "seed": 0, "device": "cpu", "model": {"id": str(root / "model")},
        "calibration": {"dataset": {"source": str(data)}, "num_samples": 8, "seq_len": 32},
        "stages": [{"awq": {"weights": W4, "max_tokens": 256}}, {"gptq": {"weights": W4}}],
        "evaluate": {"perplexity": {"dataset": {"source": str(data)}, "seq_len": 32, "max_windows": 2}},
        "verify": {"num_prompts": 3, "prompt_tokens": 8, "max_new_tokens": 8, "perplexity_windows": 2,
                   "seq_len": 32},
        "output": {"dir": str(root / "run")},
    })
    run_recipe(recipe)
    return family, root / "run"


def _report(run_dir: Path) -> dict:
    return json.loads((run_dir / "reports" / "report.json").read_text())


def test_every_linear_is_quantized(run):
    family, run_dir = run
    config = AutoConfig.from_pretrained(run_dir / "quantized")
    spec = ARCH_SPECS.get(family) or MOE_ARCH_SPECS[family].expand(config)
    modules = json.loads((run_dir / "quantized" / "quant_config.json").read_text())["modules"]
    assert sorted(modules) == sorted(f"model.layers.{i}.{n}" for i in range(2) for n in spec.linears)


def test_float_and_quantized_perplexity(run):
    rows = {r["model"]: r["perplexity"] for r in _report(run[1])["perplexity"]}
    assert set(rows) == {"float", "quantized"}
    assert all(0 < p < float("inf") for p in rows.values()) and rows["quantized"] != rows["float"]


def test_runner_computes_the_fake_quant_model(run):
    verify = _report(run[1])["verify"]
    assert verify["greedy_agreement"] >= 0.99, verify["greedy_agreement"]
    assert verify["logits"]["rel"] < 1e-4 and all(row["rel"] < 1e-4 for row in verify["layers"])
    assert abs(verify["perplexity"]["rel_diff_pct"]) < 0.1
