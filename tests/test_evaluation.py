"""The evaluation a run reports, end to end on a tiny model: ROUGE stages (float and quantized
summaries from the runner, scored, with the paired difference), per-Linear output errors, the
self-contained HTML report, `quantlab eval` (evaluation again, never quantization), float
baselines reused by a sibling run, and `quantlab compare`."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from conftest import WIKI_TEST, WIKI_TRAIN, SHARED_DATA, tiny_model
from quantlab import compare, stages
from quantlab.errors import UserError
from quantlab.eval import summaries
from quantlab.pipeline import evaluate_run, run_recipe
from quantlab.recipe import validate_recipe
from quantlab.report_html import compare_page
from quantlab.runner.generate import continuations
from quantlab.runner.load import from_hf_model

CNN = SHARED_DATA / "cnn_dailymail" / "cnn_dailymail_3.0.0_validation_first1000.jsonl"


class ExternalReferences(HTMLParser):
    """Every src / href that is not embedded (`data:`) or in-page (`#`), and every script or stylesheet link."""

    def __init__(self) -> None:
        super().__init__()
        self.external: list[str] = []
        self.images = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.images += tag == "img"
        if tag in ("script", "link", "iframe", "object", "embed"):
            self.external.append(tag)
        for name, value in attrs:
            if name in ("src", "href") and value and not value.startswith(("data:", "#")):
                self.external.append(value)


def external_references(page: str) -> ExternalReferences:
    parser = ExternalReferences()
    parser.feed(page)
    return parser


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval-data")
    calib, test, pairs = root / "calib.txt", root / "test.raw", root / "pairs.jsonl"
    calib.write_text("".join(WIKI_TRAIN.read_text(encoding="utf-8").splitlines(keepends=True)[:150]))
    test.write_text("".join(WIKI_TEST.read_text(encoding="utf-8").splitlines(keepends=True)[:60]))
    rows = [json.loads(line) for line in CNN.read_text(encoding="utf-8").splitlines()[:6]]
    pairs.write_text("".join(json.dumps({"article": r["article"][:600], "highlights": r["highlights"]}) + "\n"
                             for r in rows))
    return {"calib": calib, "test": test, "pairs": pairs}


def raw_recipe(model_dir: Path, data: dict[str, Path], run_dir: Path, bits: int = 4) -> dict:
    return {
        "name": "evaluation_test", "seed": 0, "device": "cpu", "model": {"id": str(model_dir)},
        "calibration": {"dataset": {"source": str(data["calib"])}, "num_samples": 4, "seq_len": 32},
        "stages": [{"rtn": {"weights": {"bits": bits, "symmetric": False, "group_size": 32}}}],
        "evaluate": {
            "perplexity": {"dataset": {"source": str(data["test"])}, "seq_len": 32, "max_windows": 2},
            "rouge": {"dataset": {"source": str(data["pairs"])}, "num_samples": 5, "max_input_tokens": 48,
                      "max_new_tokens": 8, "batch_size": 2},
        },
        "output": {"dir": str(run_dir)},
    }


@pytest.fixture(scope="module")
def finished(tiny_model_dir, data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("runs") / "w4"
    run_recipe(validate_recipe(raw_recipe(tiny_model_dir, data, run_dir)))
    return run_dir


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_rouge_stages_write_samples_scores_and_the_paired_difference(finished):
    rouge = json.loads((finished / stages.ROUGE).read_text())
    assert set(rouge) == {"float", "quantized", "difference", "identical_summaries"}
    for label, path in (("float", stages.ROUGE_FLOAT), ("quantized", stages.ROUGE_QUANT)):
        meta, *rows = read_jsonl(finished / path)
        assert meta["meta"]["model"] == label and meta["meta"]["generator"] == "runner"
        assert meta["meta"]["prompt"] == "plain" and meta["meta"]["tokenize"] == "words"
        assert [r["index"] for r in rows] == list(range(5)) and all(r["prompt"].endswith("TL;DR:") for r in rows)
        assert all(0 < r["new_tokens"] <= 8 and r["prompt_tokens"] <= 48 + 8 for r in rows)
        mean = sum(r["rouge1"] for r in rows) / len(rows)
        assert rouge[label]["rouge1"] == pytest.approx(mean, abs=1e-3)
    floats, quants = read_jsonl(finished / stages.ROUGE_FLOAT)[1:], read_jsonl(finished / stages.ROUGE_QUANT)[1:]
    diff = sum(q["rouge1"] - f["rouge1"] for f, q in zip(floats, quants)) / len(floats)
    d = rouge["difference"]["rouge1"]
    assert d["mean"] == pytest.approx(diff, abs=1e-3) and d["ci95"][0] <= d["mean"] <= d["ci95"][1]
    report = (finished / stages.REPORT_MD).read_text()
    assert "## ROUGE" in report and "## Linear output error" in report


def test_linear_errors_cover_every_quantized_linear(finished):
    errors = json.loads((finished / stages.LINEAR_ERRORS).read_text())["linears"]
    config = json.loads((finished / "quantized" / "quant_config.json").read_text())
    assert set(errors) == set(config["modules"])
    assert all(0 < e["rtn"] < 1 and 0 < e["quantized"] < 1 for e in errors.values())
    # q/k/v read the block's input directly: as quantized (RTN) is exactly plain rounding
    assert errors["model.layers.0.self_attn.q_proj"]["quantized"] == pytest.approx(
        errors["model.layers.0.self_attn.q_proj"]["rtn"], rel=1e-3)


def test_html_report_is_one_self_contained_file(finished):
    page = (finished / stages.REPORT_HTML).read_text()
    refs = external_references(page)
    assert refs.external == [] and refs.images >= 3  # ROUGE difference, per-layer error, stage times
    assert "Summaries side by side" in page and "Per-layer quantization error" in page


def test_runner_batches_generate_what_transformers_generate_does(tiny_model_dir):
    model = tiny_model("llama")
    prompts = [[5, 9, 100, 7, 3, 44], [12, 13], [300, 301, 302, 9]]
    runner = from_hf_model(model)
    ours = continuations(runner, prompts, 10)
    theirs = summaries.hf_generator(model, 10, stop=[], pad_id=0)(prompts)
    assert ours == theirs


def test_eval_reruns_evaluation_only(finished, monkeypatch):
    def must_not_run(_ctx) -> None:
        raise AssertionError("quantlab eval must not calibrate or quantize")

    monkeypatch.setattr(stages, "calibrate", must_not_run)
    monkeypatch.setattr(stages, "quantize", must_not_run)
    before = json.loads((finished / "manifest.json").read_text())["stages"]
    evaluate_run(finished, ["evaluate.rouge.num_samples=3"])
    after = json.loads((finished / "manifest.json").read_text())["stages"]
    assert len(read_jsonl(finished / stages.ROUGE_QUANT)) == 1 + 3
    assert after["quantize"] == before["quantize"] and after["evaluate_quantized"] == before["evaluate_quantized"]
    with pytest.raises(UserError, match="stages.0.rtn.weights.bits: quantlab eval changes only"):
        evaluate_run(finished, ["stages.0.rtn.weights.bits=8"])
    with pytest.raises(UserError, match="not a run directory"):
        evaluate_run(finished / "reports")


def test_sibling_run_reuses_float_baselines_and_compare_tables_both(finished, tiny_model_dir, data):
    sibling = finished.parent / "w8"
    run_recipe(validate_recipe(raw_recipe(tiny_model_dir, data, sibling, bits=8)))
    evaluated = json.loads((sibling / "manifest.json").read_text())["stages"]
    assert evaluated["evaluate_float"]["reused_from"] == str(finished)
    assert "reused_from" not in evaluated["quantize"]
    float_rows = [r["summary"] for r in read_jsonl(sibling / stages.ROUGE_FLOAT)[1:]]
    assert len(float_rows) == 5  # the w4 run was re-evaluated on 3 samples: its float stage differs now
    rows = compare.compare_rows([finished, sibling])
    assert [r["run"] for r in rows] == ["w4", "w8"] and rows[1]["scheme"].startswith("W8")
    assert rows[1]["KL mean"] < rows[0]["KL mean"]
    assert "| w8 |" in compare.markdown(rows)
    assert external_references(compare_page(rows)).external == []
    from typer.testing import CliRunner

    from quantlab.cli import app

    out = finished.parent / "compare.json"
    assert CliRunner().invoke(app, ["compare", str(finished), str(sibling), "--json", str(out)]).exit_code == 0
    assert json.loads(out.read_text()) == json.loads(json.dumps(rows))
    with pytest.raises(UserError, match="no reports/report.json"):
        compare.compare_rows([finished / "quantized"])


def test_a_runner_cannot_build_falls_back_to_transformers(tiny_model_dir, data, tmp_path, monkeypatch):
    from quantlab.runner import load

    def unsupported(*_a, **_k):
        raise UserError("model: the runner supports llama, qwen2, mistral")

    monkeypatch.setattr(load, "from_hf_model", unsupported)
    monkeypatch.setattr(load, "load_runner", unsupported)
    raw = raw_recipe(tiny_model_dir, data, tmp_path / "run")
    raw["evaluate"]["rouge"]["num_samples"] = 2
    run_recipe(validate_recipe(raw))
    meta = read_jsonl(tmp_path / "run" / stages.ROUGE_QUANT)[0]["meta"]
    assert meta["generator"] == "transformers" and torch.isfinite(torch.tensor(meta["rouge1"]))


def test_bad_summarization_input_is_a_one_line_error(data, tiny_model_dir, tmp_path):
    from quantlab.data.sources import load_summary_pairs
    from quantlab.recipe import SummaryDataSpec

    with pytest.raises(UserError, match=r"evaluate.rouge.dataset.document_field: .* has no field 'body'; "
                                        r"fields: article, highlights"):
        load_summary_pairs(SummaryDataSpec(source=str(data["pairs"]), document_field="body"), "evaluate.rouge.dataset")
    pairs, fields = load_summary_pairs(SummaryDataSpec(source=str(data["pairs"])), "evaluate.rouge.dataset")
    assert len(pairs) == 6 and fields == {"document_field": "article", "reference_field": "highlights", "split": None}
    raw = raw_recipe(tiny_model_dir, data, tmp_path / "run")
    raw["evaluate"]["rouge"]["template"] = "Summarize:"
    with pytest.raises(UserError, match=r"evaluate.rouge.template.*must contain \{document\} exactly once"):
        validate_recipe(raw)
