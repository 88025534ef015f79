"""The memory plan (quantlab.memory_plan): the estimate's behaviour on real model shapes, the one-line
refusal through the CLI, and that offloading calibration activations changes no code."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from conftest import WIKI_TRAIN, tiny_model
from quantlab.algorithms import AWQ, GPTQ
from quantlab.cli import app
from quantlab.engine.linear_error import LinearErrors
from quantlab.engine.sequential import run_sequential
from quantlab.errors import UserError
from quantlab.memory_plan import GiB, check_fits, device_capacity, estimate, parse_size, rank_samples
from quantlab.models.arch import arch_spec_for
from quantlab.plan import build_plan
from quantlab.quant.scheme import WeightScheme
from quantlab.recipe import validate_recipe

QWEN2_7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
            "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}
QWEN2_72B = {"model_type": "qwen2", "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 152064, "tie_word_embeddings": False}
CONFIGS = pytest.mark.parametrize("config", [QWEN2_7B, QWEN2_72B], ids=["7B", "72B"])
GPTQ_W4 = {"gptq": {"weights": "W4A16"}}


def raw_recipe(stage: dict | None = None, offload: str = "none", num_samples: int = 128, **top) -> dict:
    return {"name": "plan", "seed": 0, "model": {"id": "m", "dtype": "bfloat16"},
            "calibration": {"dataset": {"source": str(WIKI_TRAIN)}, "num_samples": num_samples, "seq_len": 2048,
                            "offload": offload},
            "stages": [stage or GPTQ_W4], **top}


def recipe(stage: dict | None = None, offload: str = "none", num_samples: int = 128, **top):
    return validate_recipe(raw_recipe(stage, offload, num_samples, **top))


# ----------------------------------------------------------------------------- the estimate


@CONFIGS
def test_monotone_in_num_samples(config) -> None:
    for offload in ("none", "cpu"):
        plans = [estimate(config, recipe(offload=offload, num_samples=n)) for n in (8, 32, 128, 512)]
        gpu, host = [p.gpu_bytes for p in plans], [p.host_bytes for p in plans]
        assert gpu == sorted(gpu) and host == sorted(host)
        assert gpu[-1] > gpu[0] if offload == "none" else host[-1] > host[0]


@CONFIGS
def test_more_ranks_need_less_gpu_each_and_more_host(config) -> None:
    """Samples split over ranks (each holds its share on its GPU); the ranks share one host."""
    plans = [estimate(config, recipe(num_samples=512), world_size=w) for w in (1, 2, 4, 8)]
    gpu, host = [p.gpu_bytes for p in plans], [p.host_bytes for p in plans]
    assert gpu == sorted(gpu, reverse=True) and gpu[0] > gpu[-1]
    assert host == sorted(host) and host[-1] == 8 * plans[0].host_bytes


def test_rank_samples_follow_whole_batches() -> None:
    assert rank_samples(128, 1) == 128
    assert rank_samples(128, 2) == 64
    assert rank_samples(128, 3) == 48  # 16 batches over 3 ranks: 6 batches for the largest share
    assert rank_samples(4, 3) == 2  # fewer batches than ranks: samples


@CONFIGS
@pytest.mark.parametrize("stage", [GPTQ_W4, {"awq": {"weights": "W4A16"}}, {"act_ranges": {}}],
                         ids=["gptq", "awq", "act_ranges"])
def test_offload_lowers_gpu_and_adds_only_the_offloaded_activations_to_host(config, stage) -> None:
    none, cpu = estimate(config, recipe(stage)), estimate(config, recipe(stage, offload="cpu"))
    assert cpu.gpu_bytes < none.gpu_bytes - GiB
    extra = {k: v for k, v in cpu.host.items() if none.host.get(k) != v}
    assert list(extra) == ["offloaded activations"]
    n, seq, hidden = 128, 2048, config["hidden_size"]
    assert 2 * n * seq * hidden * 2 <= extra["offloaded activations"] < 2.1 * n * seq * hidden * 2


@CONFIGS
def test_gptq_needs_more_than_rtn(config) -> None:
    gptq, rtn = estimate(config, recipe()), estimate(config, recipe({"rtn": {"weights": "W4A16"}}))
    assert gptq.gpu_bytes > rtn.gpu_bytes
    assert gptq.gpu_phase == "quantize: gptq" and "gptq solve" in gptq.gpu


# torch.cuda.max_memory_allocated over run_sequential on an H200, with these layer shapes (2 and 1
# layers, the full vocabulary), 128 × 2048 samples, bf16, GPTQ W4 g128 as the recipe defaults it, the
# solve consuming its Hessian: the estimate must stay within ±20 % (it is within 3.1 %).
MEASURED_GPTQ_GIB = {("7B", "none"): 9.34, ("7B", "cpu"): 7.58, ("72B", "none"): 27.82, ("72B", "cpu"): 23.80}


@pytest.mark.parametrize("model,offload", list(MEASURED_GPTQ_GIB), ids=[" ".join(k) for k in MEASURED_GPTQ_GIB])
def test_gptq_estimate_within_20_percent_of_measured(model, offload) -> None:
    plan = estimate(QWEN2_7B if model == "7B" else QWEN2_72B, recipe(offload=offload))
    assert abs(plan.gpu_bytes / GiB / MEASURED_GPTQ_GIB[model, offload] - 1) < 0.2, plan.render()


def test_lazy_loading_and_a_cpu_run() -> None:
    lazy, whole = estimate(QWEN2_72B, recipe()), estimate(QWEN2_72B, recipe(), lazy=False)
    assert whole.host_bytes - lazy.host_bytes > 120 * GiB  # the other 79 layers in bf16
    cpu = estimate(QWEN2_7B, recipe(), device="cpu")
    assert cpu.device == "cpu" and cpu.gpu_bytes == 0
    cuda = estimate(QWEN2_7B, recipe())
    assert max(cuda.gpu_bytes, cuda.host_bytes) < cpu.host_bytes < cuda.gpu_bytes + cuda.host_bytes


def test_evaluation_with_divergence_holds_a_whole_float_model_only_when_not_lazy() -> None:
    """The fake-quant model is always read layer by layer (its canonical shards)."""
    ppl = {"perplexity": {"dataset": {"source": str(WIKI_TRAIN)}, "seq_len": 2048}}
    plan = estimate(QWEN2_72B, recipe(evaluate=ppl), lazy=False)
    assert plan.gpu_phase == "evaluate" and 135 * GiB < plan.gpu_bytes < 2 * 135 * GiB
    assert estimate(QWEN2_72B, recipe(evaluate=ppl)).gpu_bytes < 40 * GiB
    one = estimate(QWEN2_72B, recipe(evaluate={"perplexity": {**ppl["perplexity"], "kl_divergence": False}}),
                   lazy=False)
    assert one.gpu_bytes < plan.gpu_bytes / 1.9


def test_render_and_dict() -> None:
    plan = estimate(QWEN2_7B, recipe(offload="cpu"))
    line = plan.render()
    assert line.startswith("memory plan: GPU ~") and "\n" not in line and "GiB" in line and "host ~" in line
    assert json.loads(json.dumps(plan.to_dict()))["gpu_bytes"] == plan.gpu_bytes


def test_offload_is_not_part_of_any_stage_key() -> None:
    keys = [[s.key for s in build_plan(recipe(offload=o))] for o in ("none", "cpu")]
    assert keys[0] == keys[1]


# ----------------------------------------------------------------------------- capacity and the check


def test_parse_size_and_the_size_variables(monkeypatch) -> None:
    assert parse_size("16GiB", "x") == 16 * GiB and parse_size("8GB", "x") == 8 * 10**9
    assert parse_size("1.5 gib", "x") == 3 * GiB // 2 and parse_size("512", "x") == 512
    monkeypatch.setenv("QUANTLAB_GPU_MEMORY", "16GiB")
    monkeypatch.setenv("QUANTLAB_HOST_MEMORY", "8GB")
    assert device_capacity(torch.device("cuda")) == (16 * GiB, 8 * 10**9)
    assert device_capacity("cpu") == (None, 8 * 10**9)
    monkeypatch.setenv("QUANTLAB_HOST_MEMORY", "plenty")
    with pytest.raises(UserError, match="QUANTLAB_HOST_MEMORY 'plenty'"):
        device_capacity("cpu")


def test_check_names_the_remedies_that_apply() -> None:
    plan = estimate(QWEN2_7B, recipe())
    with pytest.raises(UserError) as info:
        check_fits(plan, (8 * GiB, None))
    assert str(info.value) == ("memory plan: quantize needs ~8.4 GiB on cuda but 8.0 GiB is available; set "
                               "calibration.offload: cpu (saves 1.7 GiB), lower calibration.num_samples to 96 or "
                               "fewer, or use more GPUs (--gpus 2)")
    with pytest.raises(UserError) as info:  # GPTQ's solve alone does not fit: fewer samples help, not enough
        check_fits(plan, (6 * GiB, None))
    assert str(info.value).endswith("set calibration.offload: cpu (saves 1.7 GiB), or lower calibration.num_samples")
    check_fits(plan, (9 * GiB, None))
    with pytest.raises(UserError) as info:  # offloaded activations on a small host: back on the GPU
        check_fits(estimate(QWEN2_7B, recipe(offload="cpu")), (None, 6 * GiB))
    assert "on the host" in str(info.value) and "calibration.offload: none" in str(info.value)
    with pytest.raises(UserError, match="no single recipe setting lowers it"):  # RTN: no calibration to trim
        check_fits(estimate(QWEN2_72B, recipe({"rtn": {"weights": "W4A16"}})), (4 * GiB, None))


# ----------------------------------------------------------------------------- through the CLI


@pytest.fixture(scope="module")
def qwen2_7b_dir(tmp_path_factory) -> Path:
    """Only Qwen2-7B's config.json: the plan needs no weights."""
    path = tmp_path_factory.mktemp("qwen2-7b")
    (path / "config.json").write_text(json.dumps(QWEN2_7B))
    return path


def _write(tmp_path: Path, model_dir: Path, **top) -> None:
    raw = raw_recipe(**top)
    raw["model"]["id"] = str(model_dir)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))


def _one_line_exit_2(result, *needles: str) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_validate_prints_the_plan(qwen2_7b_dir, tmp_path, monkeypatch) -> None:
    _write(tmp_path, qwen2_7b_dir, device="cpu")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QUANTLAB_HOST_MEMORY", "1000GiB")
    result = CliRunner().invoke(app, ["validate", "recipe.yaml"])
    assert result.exit_code == 0, result.output
    assert "memory plan (CPU run): host ~" in result.stdout and "ok: plan" in result.stdout


def test_validate_refuses_a_plan_the_host_cannot_hold(qwen2_7b_dir, tmp_path, monkeypatch) -> None:
    _write(tmp_path, qwen2_7b_dir, device="cpu")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QUANTLAB_HOST_MEMORY", "8GiB")
    line = _one_line_exit_2(CliRunner().invoke(app, ["validate", "recipe.yaml"]),
                            "the host (CPU run)", "8.0 GiB is available", "calibration.num_samples")
    assert "calibration.offload" not in line  # placement means nothing on a CPU run
    assert os.listdir(tmp_path) == ["recipe.yaml"]


def test_run_refuses_a_plan_the_gpu_cannot_hold_before_writing_anything(qwen2_7b_dir, tmp_path, monkeypatch) -> None:
    _write(tmp_path, qwen2_7b_dir)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QUANTLAB_GPU_MEMORY", "1GiB")
    monkeypatch.setattr("quantlab.pipeline.pick_device", lambda _name: torch.device("cuda"))
    _one_line_exit_2(CliRunner().invoke(app, ["run", "recipe.yaml"]), "on cuda but 1.0 GiB is available",
                     "calibration.offload: cpu")
    assert os.listdir(tmp_path) == ["recipe.yaml"]


@pytest.mark.parametrize("variable", ["QUANTLAB_GPU_MEMORY", "QUANTLAB_HOST_MEMORY"])
def test_a_bad_size_variable_is_one_line(variable, qwen2_7b_dir, tmp_path, monkeypatch) -> None:
    _write(tmp_path, qwen2_7b_dir, device="cpu")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(variable, "16 gigs")
    _one_line_exit_2(CliRunner().invoke(app, ["validate", "recipe.yaml"]), variable, "16 gigs")


# ----------------------------------------------------------------------------- offload changes nothing


class _Placement:
    """Records whether the engine handed each layer offloaded batches."""

    data_free = False

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def apply(self, ctx) -> dict:
        self.seen += [b.offloaded for b in ctx.batches]
        return {}


def test_offload_gives_bit_identical_codes(one_thread) -> None:
    model = tiny_model("llama")
    ids = torch.randint(0, 512, (24, 16), generator=torch.Generator().manual_seed(0))  # 3 batches of 8
    scheme = WeightScheme(bits=4, symmetric=False, group_size=32)
    runs = []
    for offload in (False, True):
        spy = _Placement()
        algorithms = [spy, AWQ(scheme, grid=4, clip_grid=4), GPTQ(scheme, mse_clip=False)]
        quantized = run_sequential(copy.deepcopy(model), arch_spec_for(model), ids, algorithms, torch.device("cpu"),
                                   head_algorithms=[GPTQ(scheme, mse_clip=False)], errors=LinearErrors(),
                                   offload=offload)
        assert spy.seen and set(spy.seen) == {offload}
        runs.append(quantized)
    plain, offloaded = runs
    assert plain.keys() == offloaded.keys() and "lm_head" in plain
    for name in plain:
        assert torch.equal(plain[name].codes, offloaded[name].codes), name
        assert torch.equal(plain[name].scales, offloaded[name].scales), name
