"""Issue 5 bars 1 and 2 on the real SmolLM2 (slow): every export format loaded by the engine
users deploy it with — transformers + gptqmodel (AWQ, GPTQ), transformers + compressed-tensors,
llama-cpp-python built from PyPI (GGUF) — scores the run's own evaluation windows within the bar
of quantlab's fake-quant perplexity of the same run. Runs benchmarks/export_engines.py at a
small size (8 windows × 512, 8 calibration samples) and without the dynamic-W8A8 case (its
SmoothQuant search repeats the static case's; tests/test_export_ct_quantized.py loads that
layout); the engines' environments are built by quantlab.toolenv on first use (`.ci/run`
builds them up front).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def payload(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("export_engines")
    out = work / "result.json"
    cases = "rtn-w8-per-channel,awq-gptq-w4-g32-sym,gptq-w4-g64-asym-act_order,smoothquant-w8a8-static,fp8-static-fp8-kv"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "export_engines.py"), "--windows", "8",
                           "--calib-samples", "8", "--only", cases, "--work", str(work), "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_hf_export_matches_fake_quant_within_half_a_percent(payload):
    hf = [r for r in payload["rows"] if r["format"] in ("awq", "gptq", "compressed-tensors")]
    assert {r["format"] for r in hf} == {"awq", "gptq", "compressed-tensors"}
    assert {r["case"] for r in hf if r["format"] == "compressed-tensors"} >= {
        "awq-gptq-w4-g32-sym", "smoothquant-w8a8-static", "fp8-static-fp8-kv"}
    for r in hf:
        assert r["tokens"] == 8 * 511
        assert abs(r["delta_vs_fake_quant_pct"]) <= 0.5, r
    # the int4 checkpoints run on gptqmodel's quantized layers, not dequantized Linears
    assert all(r["linear_class"] != "Linear" for r in hf if r["format"] in ("awq", "gptq"))


def test_gguf_q8_0_within_one_percent_of_float(payload):
    bars = payload["bars"]
    assert bars["q8_0_within_1pct"], bars
    rows = {(r["case"], r["export"]): r for r in payload["rows"]}
    # the scorer itself: llama.cpp on the float model's F16 file agrees with quantlab's float
    f16 = rows[("float", "gguf-f16")]
    assert abs(f16["perplexity"] / f16["float_perplexity"] - 1) < 0.002


def test_gguf_q4_0_from_awq_beats_q4_0_from_float_at_equal_size(payload):
    bars = payload["bars"]
    assert bars["q4_0_awq_beats_float"], bars
    awq_bytes, float_bytes = bars["q4_0_bytes_awq_vs_float"]
    assert abs(awq_bytes - float_bytes) <= 0.001 * float_bytes  # same tensor types; metadata differs
