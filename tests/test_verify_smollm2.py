"""Issue 6 bar 4 on the CPU (slow): the bundled runner against the fake-quant model on real
SmolLM2 runs — W4A16 AWQ, W4A16 GPTQ with act_order, W8A8 SmoothQuant, FP8 with an int8 KV
cache — through benchmarks/verify_runner.py at a small size (8 prompts × 32 greedy tokens,
8 calibration samples).

Perplexity is taken on 16 windows of 512, not fewer: FP8 with an int8 KV cache is chaotic in
float32 (a last-bit difference flips an e4m3 code and the flip grows through 30 layers), so on
few tokens its perplexity is mostly rounding. On a Xeon, the fake-quant model's own 4-window
perplexity sits 0.48 % from its float64 copy, and the runner's sits 0.63 % from the fake-quant
model's; on 8 windows it sits 0.31 % away, on 16 windows 0.10 %. The CPU model decides which
codes flip, so a 4-window bar passes or fails by machine.

Weight-only schemes must agree on ≥ 99 % of greedy tokens. Schemes that round activations
have a floor below that: the fake-quant model disagrees with its own float64 copy where a
last-bit difference flips a code (`quantlab.runner.verify`), so for them the runner must sit at
that floor (within 3 points), which a runner computing anything else would miss by far. In
float64 (`verify.precision`) no code flips on rounding, and those schemes too agree ≥ 99 %.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow
WEIGHT_ONLY = ("w4a16-awq", "w4a16-gptq-act_order")


ROUNDING = ("w8a8-smoothquant", "fp8-int8-kv")


def verify_rows(work, *extra: str, windows: int = 16) -> dict[str, dict]:
    out = work / "result.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "verify_runner.py"), "--device", "cpu",
                           "--prompts", "8", "--new-tokens", "32", "--windows", str(windows), "--calib-samples", "8",
                           "--work", str(work), "--out", str(out), *extra],
                          capture_output=True, text=True, cwd=REPO, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["case"]: r for r in json.loads(out.read_text())["rows"]}


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[str, dict]:
    return verify_rows(tmp_path_factory.mktemp("verify_runner"))


def test_runner_perplexity_matches_fake_quant_within_half_a_percent(rows):
    assert set(rows) == {*WEIGHT_ONLY, "w8a8-smoothquant", "fp8-int8-kv"}
    for case, r in rows.items():
        assert abs(r["perplexity_delta_pct"]) <= 0.5, (case, r["perplexity_delta_pct"])


def test_weight_only_runner_agrees_on_99_percent_of_greedy_tokens(rows):
    for case in WEIGHT_ONLY:
        assert rows[case]["greedy_agreement"] >= 0.99, (case, rows[case]["greedy_agreement"])
        assert rows[case]["verify"]["logits"]["rel"] < 1e-4, case  # float32 on CPU: the same computation


def test_activation_rounding_runner_sits_at_the_reference_floor(rows):
    for case in ROUNDING:
        r = rows[case]
        assert r["greedy_agreement"] >= r["floor_agreement"] - 0.03, (case, r["greedy_agreement"], r["floor_agreement"])
        # the runner's logit error is the size of the reference's own rounding sensitivity
        floor = r["verify"]["reference_floor"]["logits_rel"]
        assert r["verify"]["logits"]["rel"] <= 1.5 * floor, (case, r["verify"]["logits"]["rel"], floor)


def test_activation_rounding_runner_matches_in_float64(tmp_path):
    """verify.precision float64: with rounding out of the way the runner computes what the
    fake-quant model computes — the same logits to float64 rounding, ≥ 99 % of greedy tokens
    (in fact all) and the same perplexity."""
    rows64 = verify_rows(tmp_path, "--precision", "float64", "--only", ",".join(ROUNDING), windows=4)
    assert set(rows64) == set(ROUNDING)
    for case, r in rows64.items():
        assert r["greedy_agreement"] >= 0.99 and r["meets_bar"], (case, r["greedy_agreement"])
        assert r["verify"]["logits"]["rel"] < 1e-10, (case, r["verify"]["logits"]["rel"])
        assert abs(r["perplexity_delta_pct"]) < 1e-6, (case, r["perplexity_delta_pct"])
