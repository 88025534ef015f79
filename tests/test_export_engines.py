"""Every export format loaded by the engine users deploy it with (slow) — transformers +
gptqmodel (AWQ, GPTQ), transformers + compressed-tensors, llama-cpp-python built from PyPI
(GGUF) — scores the run's own evaluation windows within the bar of quantlab's fake-quant
perplexity of the same run. The exports come from the shared SmolLM2 runs
(tests/smollm2_runs.py: 8 windows × 512, 4 calibration samples) and are scored by the same
functions as benchmarks/export_engines.py. W8A8 is scored in its dynamic per-token layout; the
static layout (`input_scale`) is loaded by tests/test_export_ct_quantized.py, like every other
compressed-tensors variant, and by the full benchmark. The engines' environments are built by quantlab.toolenv on
first use (`.ci/run` builds them up front).
"""

from __future__ import annotations

import pytest

from smollm2_runs import FLOAT_GGUF, WINDOWS

import export_engines  # benchmarks/, on sys.path through smollm2_runs

CASES = ("rtn-w4", "rtn-w8-per-channel", "awq-gptq-w4-g32-sym", "gptq-w4-g64-asym-act_order",
         "smoothquant-w8a8-dynamic", "fp8-static-fp8-kv")
pytestmark = [pytest.mark.slow, pytest.mark.smollm2(*CASES, FLOAT_GGUF)]


@pytest.fixture
def rows(smollm2) -> list[dict]:
    return [row for case in CASES for row in smollm2(case).rows] + smollm2(FLOAT_GGUF)


def test_every_hf_export_matches_fake_quant_within_half_a_percent(rows):
    hf = [r for r in rows if r["format"] in ("awq", "gptq", "compressed-tensors")]
    assert {r["format"] for r in hf} == {"awq", "gptq", "compressed-tensors"}
    # rtn-w4: the quickstart run, exported afterwards with `quantlab export` (asymmetric W4 g64)
    assert {r["case"] for r in hf if r["format"] == "compressed-tensors"} >= {
        "rtn-w4", "awq-gptq-w4-g32-sym", "smoothquant-w8a8-dynamic", "fp8-static-fp8-kv"}
    for r in hf:
        assert r["tokens"] == WINDOWS * 511
        assert abs(r["delta_vs_fake_quant_pct"]) <= 0.5, r
    # the int4 checkpoints run on gptqmodel's quantized layers, not dequantized Linears
    assert all(r["linear_class"] != "Linear" for r in hf if r["format"] in ("awq", "gptq"))


def test_gguf_q8_0_within_one_percent_of_float(rows):
    bars = export_engines.bars(rows)
    assert bars["q8_0_within_1pct"], bars
    by = {(r["case"], r["export"]): r for r in rows}
    # the scorer itself: llama.cpp on the float model's F16 file agrees with quantlab's float
    f16 = by[("float", "gguf-f16")]
    assert abs(f16["perplexity"] / f16["float_perplexity"] - 1) < 0.002


def test_gguf_q4_0_from_awq_beats_q4_0_from_float_at_equal_size(rows):
    bars = export_engines.bars(rows)
    assert bars["q4_0_awq_beats_float"], bars
    awq_bytes, float_bytes = bars["q4_0_bytes_awq_vs_float"]
    assert abs(awq_bytes - float_bytes) <= 0.001 * float_bytes  # same tensor types; metadata differs


def test_validation_and_the_exporters_agree_on_every_run(smollm2):
    """The cheap half of benchmarks/export_matrix.py: for each shared run and every format, the
    refusal `quantlab validate` computes from the recipe (quantlab.admission) is the one the
    exporter gives the run's real canonical form — the same formats allowed, the same reasons."""
    from quantlab.admission import allowed_formats, model_config
    from quantlab.errors import UserError
    from quantlab.export import api
    from quantlab.export.source import load_source
    from quantlab.formats import FORMATS
    from quantlab.recipe import load_recipe

    allowed = set()
    for case in CASES:
        run = smollm2(case)
        recipe = load_recipe(run.dir / "recipe.resolved.yaml")
        planned = allowed_formats(recipe, *model_config(recipe))
        src = load_source(run.dir / "quantized")
        for fmt in FORMATS:
            try:
                api.check_exportable(src, fmt)
                actual = None
            except UserError as exc:
                actual = str(exc)
            assert planned[fmt] == actual, (case, fmt)
            allowed |= {fmt} if actual is None else set()
    assert {"awq", "gptq", "compressed-tensors", "gguf-q4_0", "gguf-q8_0", "trtllm", "paddlenlp"} <= allowed
