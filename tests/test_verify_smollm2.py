"""The bundled runner against the fake-quant model on real SmolLM2 runs (slow) — W4A16
AWQ + GPTQ, W4A16 GPTQ asymmetric with act_order, W8A8 SmoothQuant (dynamic per token), static
FP8 with an FP8 KV cache — read from the shared runs' `verify` reports (tests/smollm2_runs.py:
8 prompts × 32 greedy tokens; perplexity on 16 windows of 512 for the schemes that round
activations, 4 for weight-only ones). The int8 KV cache is verified on tiny models
(tests/test_act_quant.py, tests/test_runner.py).

Weight-only schemes must agree on ≥ 99 % of greedy tokens. Schemes that round activations
have a floor below that: the fake-quant model disagrees with its own float64 copy where a
last-bit difference flips a code (`quantlab.runner.verify`), so for them the runner must sit at
that floor (within 3 points), which a runner computing anything else would miss by far. In
float64 (`verify.precision`) no code flips on rounding, and those schemes too agree ≥ 99 %.
"""

from __future__ import annotations

import pytest

from smollm2_runs import FLOAT64_WINDOWS

WEIGHT_ONLY = ("awq-gptq-w4-g32-sym", "gptq-w4-g64-asym-act_order")
ROUNDING = ("smoothquant-w8a8-dynamic", "fp8-static-fp8-kv")

pytestmark = [pytest.mark.slow, pytest.mark.smollm2(*WEIGHT_ONLY, *ROUNDING)]


@pytest.fixture
def rows(smollm2) -> dict[str, dict]:
    return {case: smollm2(case).verify for case in (*WEIGHT_ONLY, *ROUNDING)}


def test_runner_perplexity_matches_fake_quant_within_half_a_percent(rows):
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


def test_activation_rounding_runner_matches_in_float64(smollm2):
    """verify.precision float64: with rounding out of the way the runner computes what the
    fake-quant model computes — the same logits to float64 rounding, ≥ 99 % of greedy tokens
    (in fact all) and the same perplexity. The rerun reuses the run's quantized model: only
    the verify stage and the report run again."""
    for case in ROUNDING:
        r = smollm2(case).verify64
        assert "skip quantize: done" in r["stderr"] and "skip evaluate_quantized: done" in r["stderr"], case
        assert r["verify"]["dtype"] == "float64" and r["verify"]["perplexity"]["runner"]["windows"] == FLOAT64_WINDOWS, case
        assert r["greedy_agreement"] >= 0.99 and r["meets_bar"], (case, r["greedy_agreement"])
        assert r["verify"]["logits"]["rel"] < 1e-10, (case, r["verify"]["logits"]["rel"])
        assert abs(r["perplexity_delta_pct"]) < 1e-6, (case, r["perplexity_delta_pct"])
