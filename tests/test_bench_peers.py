"""The peers benchmark's derived columns: time ratios pair rows of one machine only, and a
peer stopped by --timeout turns quantlab's wall ratio into an upper bound."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import peers_cpu as pc  # noqa: E402


def row(tool: str, method: str, status: str, wall: float, cpu: str, quantize: float | None = None,
        ppl: float | None = None) -> pc.Result:
    r = pc.Result(f"{tool}:{method}", method, tool, 64, False, status=status, perplexity=ppl, wall_s=wall,
                  quantize_s=quantize)
    r.cpu = cpu
    return r


def test_ratios_pair_finished_peers_on_the_same_cpu():
    float_row = row("float", "float", "ok", 60, "A", ppl=20.0)
    ours = row("quantlab", "gptq", "ok", 250, "A", quantize=200, ppl=28.0)
    same = row("llmcompressor", "gptq", "ok", 270, "A", quantize=210, ppl=29.0)
    other = row("gptqmodel", "gptq", "ok", 100, "B", quantize=90)  # faster, but another machine
    pc.derive([float_row, ours, same, other])
    assert ours.quantize_ratio == round(200 / 210, 2) and ours.wall_ratio == round(250 / 270, 2)
    assert not ours.wall_ratio_is_bound
    assert ours.delta_vs_float_pct == 40.0


def test_a_stopped_peer_bounds_the_wall_ratio():
    ours = row("quantlab", "awq", "ok", 180, "A", quantize=120)
    stopped = row("llmcompressor", "awq", "stopped", 900, "A")
    pc.derive([ours, stopped])
    assert ours.wall_ratio == 0.2 and ours.wall_ratio_is_bound
    assert ours.quantize_ratio is None  # a stopped peer has no quantize time to compare with
    assert pc.cells(ours)[9] == "<0.20"


def test_a_finished_peer_slower_than_a_stopped_ones_bound_keeps_the_exact_ratio():
    ours = row("quantlab", "awq", "ok", 180, "A")
    stopped = row("gptqmodel", "awq", "stopped", 300, "A")
    finished = row("llmcompressor", "awq", "ok", 200, "A")
    pc.derive([ours, stopped, finished])
    assert ours.wall_ratio == 0.9 and not ours.wall_ratio_is_bound
