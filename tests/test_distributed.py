"""Calibration over several processes (`quantlab.engine.distributed`), as two gloo processes
on the CPU, against the same calibration in one process.

Each process captures its share of the samples (whole batches of 8), so every batch computes
exactly what it computes in one process; the statistics are then summed or maxed over the
processes. A max is exact in any order, but a sum of fp32 Hessians / Grams added as
(b0 + b1) + (b2 + b3) instead of ((b0 + b1) + b2) + b3 differs in its last bits, and a code
whose value sits on a rounding boundary (or an AWQ clip ratio on a near-tie) can land on the
other side; the written-back weights then differ in the last bits and the next layer's inputs
with them. So the codes must agree except for a tiny fraction, and every process must write
back exactly the same weights (solves are broadcast from the process that ran them, searched
parameters from rank 0).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from conftest import WIKI_TRAIN, tiny_model
from quantlab.algorithms.act_ranges import ActRanges
from quantlab.algorithms.awq import AWQ
from quantlab.algorithms.gptq import GPTQ
from quantlab.algorithms.smoothquant import SmoothQuant
from quantlab.engine import distributed
from quantlab.engine.distributed import World
from quantlab.engine.sequential import run_sequential
from quantlab.errors import UserError
from quantlab.models.arch import arch_spec_for
from quantlab.models.moe import unfuse_experts
from quantlab.quant.scheme import ActivationScheme, KVCacheScheme, WeightScheme

SCHEME = WeightScheme(bits=4, symmetric=False, group_size=32)  # down_proj (in 96) gets 3 groups
STATIC = ActivationScheme(dynamic=False, granularity="tensor")
PROCESSES = 2


def calibrate_dense() -> dict[str, Any]:
    """SmoothQuant (searched) → AWQ (block objective over 3 of the 4 batches, Grams over a
    2-batch subsample: both straddle the two shares) → GPTQ (act_order, true_sequential) →
    act_ranges (static absmax, C8) on a tiny llama."""
    model = tiny_model("llama")
    ids = torch.randint(0, 512, (32, 32), generator=torch.Generator().manual_seed(0))  # 4 batches of 8
    gptq = GPTQ(SCHEME, act_order=True, true_sequential=True)
    awq = AWQ(SCHEME, objective="block", block_tokens=768, max_tokens=512, grid=10, clip_grid=10)
    stages = [SmoothQuant(search=True, grid=4, max_tokens=256, activations=STATIC), awq, gptq,
              ActRanges(STATIC, KVCacheScheme())]
    return _calibrate(model, ids, stages, gptq, awq)


def calibrate_moe() -> dict[str, Any]:
    """AWQ → GPTQ (act_order) on a tiny Qwen2-MoE: per-expert Hessians and Grams of the tokens
    routed to each expert in each share, and the routed-token counts."""
    model = tiny_model("qwen2_moe")
    unfuse_experts(model)
    ids = torch.randint(0, 512, (24, 8), generator=torch.Generator().manual_seed(1))  # 3 batches of 8
    gptq, awq = GPTQ(SCHEME, act_order=True), AWQ(SCHEME, grid=10, clip_grid=10)
    return _calibrate(model, ids, [awq, gptq], gptq, awq)


def _calibrate(model: torch.nn.Module, ids: torch.Tensor, stages: list, gptq: GPTQ, awq: AWQ) -> dict[str, Any]:
    """What a process ends up with."""
    scales: dict[str, torch.Tensor] = {}
    routed: dict[str, list[int]] = {}
    quantized = run_sequential(model, arch_spec_for(model), ids, stages, torch.device("cpu"), scales=scales,
                               routed=routed)
    return {"codes": {name: qw.codes for name, qw in quantized.items()}, "weights": model.state_dict(),
            "scales": scales, "routed": routed, "stats": gptq.stats,
            "alphas": [r.get("alpha") for r in awq.records]}


CASES = {"dense": calibrate_dense, "moe": calibrate_moe}


def calibrate_all() -> dict[str, dict[str, Any]]:
    return {case: run() for case, run in CASES.items()}


def _process(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(PROCESSES),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    distributed.init_from_env("cpu")
    try:
        torch.save(calibrate_all(), Path(out) / f"rank{rank}.pt")
    finally:
        distributed.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Both cases in one process, and in two (one start-up for both)."""
    out = tmp_path_factory.mktemp("distributed")
    torch.multiprocessing.spawn(_process, args=(_free_port(), str(out)), nprocs=PROCESSES)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = calibrate_all()
    finally:
        torch.set_num_threads(threads)
    return single, [torch.load(out / f"rank{r}.pt") for r in range(PROCESSES)]


@pytest.mark.parametrize("case", CASES)
def test_every_process_writes_back_the_same_weights(runs, case: str) -> None:
    _, ranks = runs
    first, second = (r[case] for r in ranks)
    assert first["weights"].keys() == second["weights"].keys()
    for name, w in first["weights"].items():
        assert torch.equal(w, second["weights"][name]), name
    for name, codes in first["codes"].items():
        assert torch.equal(codes, second["codes"][name]), name
    assert first["stats"] == second["stats"]


@pytest.mark.parametrize("case", CASES)
def test_codes_match_one_process(runs, case: str) -> None:
    single, (first, _) = runs[0][case], (r[case] for r in runs[1])
    assert first["codes"].keys() == single["codes"].keys()
    differ = sum(int((first["codes"][n] != c).sum()) for n, c in single["codes"].items())
    total = sum(c.numel() for c in single["codes"].values())
    assert differ / total < 1e-3, f"{differ} of {total} codes differ"
    # every Hessian saw the tokens of both shares, every expert's count is the sum of both
    assert {n: s["tokens"] for n, s in first["stats"].items()} == {n: s["tokens"] for n, s in single["stats"].items()}
    assert first["routed"] == single["routed"]
    assert first["alphas"] == single["alphas"]


def test_ranges_match_one_process(runs) -> None:
    single, first = runs[0]["dense"], runs[1][0]["dense"]
    assert first["scales"].keys() == single["scales"].keys()
    for name, value in single["scales"].items():
        torch.testing.assert_close(first["scales"][name], value, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("n, size, expected", [
    (32, 2, [(0, 16), (16, 32)]),  # 4 batches: 2 each
    (20, 2, [(0, 8), (8, 20)]),  # 3 batches, the last one short
    (12, 4, [(0, 3), (3, 6), (6, 9), (9, 12)]),  # fewer batches than processes: samples
    (0, 2, [(0, 0), (0, 0)]),
])
def test_share_is_contiguous_whole_batches(n: int, size: int, expected: list[tuple[int, int]]) -> None:
    shares = [distributed.share(n, 8, World(rank, size)) for rank in range(size)]
    assert [(s.start, s.stop) for s in shares] == expected


def test_share_refuses_fewer_samples_than_processes() -> None:
    with pytest.raises(UserError, match=r"calibration.num_samples: 3 samples cannot be split over 4 processes"):
        distributed.share(3, 8, World(0, 4))


@pytest.mark.parametrize("args, needle", [
    (["--gpus", "2"], "error: --gpus 2: 0 CUDA device(s) here"),
    (["--gpus", "0"], "error: --gpus 0: give 1 or more"),
])
def test_gpus_bad_input_is_one_line_exit_2(tmp_path, monkeypatch, args: list[str], needle: str) -> None:
    """Checked before any process starts (a machine without CUDA, unless the gloo override)."""
    from typer.testing import CliRunner

    from quantlab.cli import app

    monkeypatch.delenv(distributed.BACKEND_ENV, raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "gpus", "seed": 0, "model": {"id": str(tmp_path)},
        "calibration": {"dataset": {"source": str(WIKI_TRAIN)}, "num_samples": 4, "seq_len": 32},
        "stages": [{"gptq": {"weights": {"bits": 4, "group_size": 32}}}]}))
    result = CliRunner().invoke(app, ["run", str(recipe), *args])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith(needle), result.stderr
