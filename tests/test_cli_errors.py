"""Malformed recipes through the real CLI: exit 2, one line on stderr naming the YAML path of
the bad field, no traceback, and no run directory left behind."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from typer.testing import CliRunner

from quantlab.cli import app
from conftest import REPO, WIKI_TEST, WIKI_TRAIN


@pytest.fixture(scope="module")
def fake_model_dir(tmp_path_factory) -> Path:
    """Passes the pre-run model checks (a directory with config.json) but cannot be loaded,
    so a recipe that wrongly validates fails fast instead of running a model."""
    path = tmp_path_factory.mktemp("fake-model")
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


def good_recipe(model_dir: Path) -> dict[str, Any]:
    return {
        "name": "cli_test",
        "seed": 0,
        "model": {"id": str(model_dir)},
        "calibration": {"dataset": {"source": str(WIKI_TRAIN)}, "num_samples": 4, "seq_len": 32},
        "stages": [{"rtn": {"weights": {"bits": 4, "symmetric": False, "group_size": 64}}}],
        "evaluate": {"perplexity": {"dataset": {"source": str(WIKI_TEST)}, "seq_len": 64, "max_windows": 2}},
    }


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def apply(raw: dict) -> None:
        *parents, last = path.split(".")
        node: Any = raw
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[int(last) if isinstance(node, list) else last] = value
    return apply


def _del(path: str) -> Callable[[dict], None]:
    def apply(raw: dict) -> None:
        *parents, last = path.split(".")
        node: Any = raw
        for part in parents:
            node = node[part]
        del node[last]
    return apply


# (id, mutation of the good recipe, YAML path the error must name)
MALFORMED: list[tuple[str, Callable[[dict], None], str]] = [
    ("seed-wrong-type", _set("seed", "abc"), "seed"),
    ("seed-missing", _del("seed"), "seed"),
    ("seed-negative", _set("seed", -1), "seed"),
    ("name-bad-chars", _set("name", "a/b"), "name"),
    ("unknown-top-key", _set("extra", 1), "extra"),
    ("unknown-model-key", _set("model.revison", "main"), "model.revison"),
    ("unknown-dataset-key", _set("calibration.dataset.path", "x"), "calibration.dataset.path"),
    ("unknown-weights-key", _set("stages.0.rtn.weights.group", 64), "stages[0].rtn.weights.group"),
    ("unknown-stage-kind", _set("stages", [{"frobnicate": {}}]), "stages[0].frobnicate"),
    ("model-missing", _del("model"), "model"),
    ("model-not-mapping", _set("model", "smollm2"), "model"),
    ("model-id-missing", _set("model", {"dtype": "float32"}), "model.id"),
    ("model-id-empty", _set("model.id", ""), "model.id"),
    ("bad-dtype", _set("model.dtype", "float8"), "model.dtype"),
    ("group-size-100", _set("stages.0.rtn.weights.group_size", 100), "stages[0].rtn.weights.group_size"),
    ("group-size-0", _set("stages.0.rtn.weights.group_size", 0), "stages[0].rtn.weights.group_size"),
    ("group-size-neg", _set("stages.0.rtn.weights.group_size", -64), "stages[0].rtn.weights.group_size"),
    ("group-size-str", _set("stages.0.rtn.weights.group_size", "big"), "stages[0].rtn.weights.group_size"),
    ("bits-5", _set("stages.0.rtn.weights.bits", 5), "stages[0].rtn.weights.bits"),
    ("unknown-preset", _set("stages.0.rtn.weights", "W5A16"), "stages[0].rtn.weights"),
    ("ignore-not-list", _set("stages.0.rtn.ignore", 3), "stages[0].rtn.ignore"),
    ("num-samples-zero", _set("calibration.num_samples", 0), "calibration.num_samples"),
    ("num-samples-negative", _set("calibration.num_samples", -8), "calibration.num_samples"),
    ("seq-len-tiny", _set("calibration.seq_len", 4), "calibration.seq_len"),
    ("bad-strategy", _set("calibration.strategy", "shuffle"), "calibration.strategy"),
    ("calibration-dataset-missing", _del("calibration.dataset"), "calibration.dataset"),
    ("max-windows-zero", _set("evaluate.perplexity.max_windows", 0), "evaluate.perplexity.max_windows"),
    ("bad-format", _set("evaluate.perplexity.dataset.format", "html"), "evaluate.perplexity.dataset.format"),
    ("bad-device", _set("device", "tpu"), "device"),
    ("stage-two-keys", _set("stages", [{"rtn": {}, "gptq": {}}]), "stages[0]"),
    ("stage-not-mapping", _set("stages", ["rtn"]), "stages[0]"),
    ("stages-empty", _set("stages", []), "stages"),
    ("stages-not-list", _set("stages", "rtn"), "stages"),
    ("stages-missing", _del("stages"), "stages"),
    # checks made before the run starts (files), not by the schema
    ("calib-file-missing", _set("calibration.dataset.source", "/nonexistent/calib.txt"), "calibration.dataset.source"),
    ("eval-file-missing", _set("evaluate.perplexity.dataset.source", "./missing.jsonl"),
     "evaluate.perplexity.dataset.source"),
    ("model-path-missing", _set("model.id", "/nonexistent/model-dir"), "model.id"),
]


def assert_user_error(exit_code: int, stdout: str, stderr: str, field: str) -> str:
    assert exit_code == 2, (exit_code, stdout, stderr)
    assert "Traceback" not in stdout + stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    line = lines[0]
    assert line.startswith("error: ")
    # the path appears as a whole field name: "…: field:" or "… field …"
    assert f" {field}:" in line or f" {field} " in line, line
    return line


def invoke(args: list[str]) -> Any:
    return CliRunner().invoke(app, args)


@pytest.mark.parametrize("case_id,mutate,field", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_recipe_is_one_line_exit_2_and_leaves_nothing(
    case_id, mutate, field, fake_model_dir, tmp_path, monkeypatch
) -> None:
    raw = copy.deepcopy(good_recipe(fake_model_dir))
    mutate(raw)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    result = invoke(["run", "recipe.yaml"])
    assert_user_error(result.exit_code, result.stdout, result.stderr, field)
    assert sorted(os.listdir(tmp_path)) == ["recipe.yaml"]


def test_at_least_fourteen_malformed_cases() -> None:
    assert len(MALFORMED) >= 14


@pytest.mark.parametrize("text,needle", [
    ("- name: a\n- seed: 0\n", "YAML mapping"),
    ("", "YAML mapping"),
    ("just a string\n", "YAML mapping"),
    ("name: [unclosed\nseed: 0\n", "not valid YAML at line"),
    ("name: a\n\tseed: 0\n", "not valid YAML"),
])
def test_not_a_recipe_mapping(text: str, needle: str, tmp_path, monkeypatch) -> None:
    (tmp_path / "recipe.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)
    result = invoke(["run", "recipe.yaml"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert len(result.stderr.splitlines()) == 1 and needle in result.stderr
    assert "recipe.yaml" in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["recipe.yaml"]


def test_missing_recipe_file_and_unknown_shipped_name(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for arg, needle in (("nope.yaml", "recipe file not found"), ("no_such_recipe", "shipped")):
        result = invoke(["run", arg])
        assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1 and needle in result.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("override,field", [
    ("stages.3.rtn.weights=W8A16", "stages.3.rtn.weights"),  # index beyond the list
    ("stages.x.rtn=null", "stages.x.rtn"),  # a list needs an index
    ("calibration.bogus=1", "calibration.bogus"),  # unknown key, caught by the schema
    ("calibration.num_samples=-1", "calibration.num_samples"),
    ("calibration.num_samples=many", "calibration.num_samples"),
    ("stages.0.rtn.weights.group_size=96", "stages[0].rtn.weights.group_size"),
    ("name.sub=1", "name"),  # a scalar is not a mapping
    ("noequals", "--set 'noequals'"),
    ("=5", "--set '=5'"),
])
def test_bad_set_override(override: str, field: str, fake_model_dir, tmp_path, monkeypatch) -> None:
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(good_recipe(fake_model_dir)))
    monkeypatch.chdir(tmp_path)
    for command in ("run", "validate"):
        result = invoke([command, "recipe.yaml", "--set", override])
        line = assert_user_error(result.exit_code, result.stdout, result.stderr, field)
        if field.startswith(("stages.", "--set")):
            assert "--set" in line
    assert sorted(os.listdir(tmp_path)) == ["recipe.yaml"]


def test_validate_good_recipe_and_override_applies(fake_model_dir, tmp_path, monkeypatch) -> None:
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(good_recipe(fake_model_dir)))
    monkeypatch.chdir(tmp_path)
    result = invoke(["validate", "recipe.yaml"])
    assert result.exit_code == 0, result.output
    assert "ok: cli_test" in result.stdout and "runs/cli_test" in result.stdout
    assert "calibration → evaluate_float → quantize → evaluate_quantized → report" in result.stdout

    result = invoke(["validate", "recipe.yaml", "--set", "calibration.num_samples=64",
                     "--set", "output.dir=elsewhere/run1"])
    assert result.exit_code == 0, result.output
    assert "run dir elsewhere/run1" in result.stdout
    result = invoke(["validate", "recipe.yaml", "--set", "calibration.num_samples=0"])
    assert_user_error(result.exit_code, result.stdout, result.stderr, "calibration.num_samples")
    assert sorted(os.listdir(tmp_path)) == ["recipe.yaml"]  # validate never creates a run dir


def test_validate_shipped_recipe_by_name(monkeypatch) -> None:
    monkeypatch.chdir(REPO)  # shipped recipes use data paths relative to the repo root
    result = invoke(["validate", "smollm2_rtn_w4a16"])
    assert result.exit_code == 0, result.output
    assert "ok: smollm2_rtn_w4a16" in result.stdout


# A few cases through a real subprocess: the exit code, stderr and stdout the user sees.
SUBPROCESS_CASES = [c for c in MALFORMED if c[0] in ("group-size-100", "unknown-weights-key", "model-path-missing")]


@pytest.mark.parametrize("case_id,mutate,field", SUBPROCESS_CASES, ids=[c[0] for c in SUBPROCESS_CASES])
def test_subprocess_cli(case_id, mutate, field, fake_model_dir, tmp_path) -> None:
    raw = copy.deepcopy(good_recipe(fake_model_dir))
    mutate(raw)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))
    proc = subprocess.run([sys.executable, "-m", "quantlab", "run", "recipe.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout == ""
    assert_user_error(proc.returncode, proc.stdout, proc.stderr, field)
    assert sorted(os.listdir(tmp_path)) == ["recipe.yaml"]


def test_subprocess_invalid_yaml_and_bad_set(fake_model_dir, tmp_path) -> None:
    (tmp_path / "bad.yaml").write_text("name: x\nstages: [\n")
    (tmp_path / "good.yaml").write_text(yaml.safe_dump(good_recipe(fake_model_dir)))
    proc = subprocess.run([sys.executable, "-m", "quantlab", "run", "bad.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.splitlines()) == 1
    assert "bad.yaml: not valid YAML at line" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "quantlab", "run", "good.yaml", "--set", "calibration.seq_len=abc"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert_user_error(proc.returncode, proc.stdout, proc.stderr, "calibration.seq_len")
    assert sorted(os.listdir(tmp_path)) == ["bad.yaml", "good.yaml"]


def unsupported_gguf(path: Path) -> Path:
    """A GGUF file holding only its header: the architecture a real Gemma 2 GGUF declares, no tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "gemma2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("source", ["config", "gguf"])
def test_unsupported_architecture_is_refused_before_any_weight_is_read(source, tmp_path) -> None:
    """From config.json or the GGUF header alone (neither file holds a weight to load): validate and run
    both answer in one line naming the supported architectures, within seconds, leaving nothing behind."""
    import time

    model = tmp_path / "model"
    model.mkdir()
    if source == "config":
        (model / "config.json").write_text(json.dumps({"model_type": "phi3", "num_hidden_layers": 32}))
        model_id, declared = str(model), "phi3"
    else:
        model_id, declared = str(unsupported_gguf(model / "gemma-2-2b.Q8_0.gguf")), "gemma2"
    work = tmp_path / "work"
    work.mkdir()
    (work / "recipe.yaml").write_text(yaml.safe_dump({**good_recipe(model), "model": {"id": model_id}}))
    for command in ("validate", "run"):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "quantlab", command, "recipe.yaml"], cwd=work,
                              capture_output=True, text=True, timeout=120)
        line = assert_user_error(proc.returncode, proc.stdout, proc.stderr, "model")
        assert f"architecture {declared!r}" in line
        assert "supported: gemma3_text, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe" in line
        assert time.perf_counter() - start < 10
    assert sorted(os.listdir(work)) == ["recipe.yaml"]


def _validate_and_run_refuse(raw: dict, tmp_path: Path, monkeypatch, field: str, *args: str) -> str:
    """`validate` and `run` both answer one line naming `field`, and write nothing."""
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    for command in ("validate", "run"):
        result = invoke([command, "recipe.yaml", *args])
        line = assert_user_error(result.exit_code, result.stdout, result.stderr, field)
    assert sorted(os.listdir(tmp_path)) == ["recipe.yaml"]
    return line


def test_group_size_wider_than_a_quantized_layer_is_refused(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """The tiny llama's narrowest inputs are 64 wide (hidden_size): a group of 128 spans no group."""
    line = _validate_and_run_refuse(good_recipe(tiny_model_dir), tmp_path, monkeypatch,
                                    "stages.0.rtn.weights.group_size", "--set", "stages.0.rtn.weights.group_size=128")
    assert "128 exceeds the input width 64 of model.layers.0.self_attn.q_proj" in line
    assert "at most 64" in line


def test_group_size_is_checked_once_a_hub_models_config_arrives(tiny_model_dir, monkeypatch) -> None:
    """A hub model not in the cache: preflight cannot know its widths, the run's admission
    (model_dir given) fetches config.json and refuses before calibration."""
    import huggingface_hub

    from quantlab.admission import admit
    from quantlab.errors import UserError
    from quantlab.recipe import validate_recipe

    raw = {**good_recipe(tiny_model_dir), "model": {"id": "nobody/no-such-model"}}
    raw["stages"][0]["rtn"]["weights"]["group_size"] = 128
    recipe = validate_recipe(raw)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: str(tiny_model_dir / "config.json"))
    monkeypatch.setattr("quantlab.models.sources.hub_unreachable", lambda: None)  # as if online
    with pytest.raises(UserError, match=r"stages\.0\.rtn\.weights\.group_size: 128 exceeds the input width 64"):
        admit(recipe, Path(recipe.model.id))


def test_device_cuda_without_cuda_is_refused_in_preflight(fake_model_dir, tmp_path, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = _validate_and_run_refuse(good_recipe(fake_model_dir), tmp_path, monkeypatch, "device",
                                    "--set", "device=cuda")
    assert "use 'cpu' or 'auto'" in line
    assert invoke(["validate", "recipe.yaml", "--set", "device=auto"]).exit_code == 0


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("offline_env", [False, True])
def test_unreachable_hub_is_refused_in_seconds(offline_env, fake_model_dir, tmp_path, monkeypatch) -> None:
    """No ~47 s of retries: HF_HUB_OFFLINE, or one probe of the endpoint (a closed local port here)."""
    import time

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline_env)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline_env else "0")
    raw = {**good_recipe(fake_model_dir), "model": {"id": "nobody/no-such-model"}}
    start = time.perf_counter()
    line = _validate_and_run_refuse(raw, tmp_path, monkeypatch, "model.id")
    assert time.perf_counter() - start < 5
    assert ("HF_HUB_OFFLINE is set" if offline_env else "no answer from http://127.0.0.1") in line


def test_hub_probe_reachable_and_closed() -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from quantlab.models.sources import _probe

    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)  # answers HEAD with 501
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert _probe(f"http://127.0.0.1:{server.server_address[1]}") is None  # any HTTP answer: reachable
    finally:
        server.shutdown()
        server.server_close()
    assert "ConnectError" in _probe(f"http://127.0.0.1:{_closed_port()}")


@pytest.mark.parametrize("model,field,needle", [
    ({"id": " "}, "model.id", "neither an existing local path nor a hub id"),
    ({"id": "/dev/null"}, "model.id", "a device or special file"),
    ({"id": "a\x00b"}, "model.id", "NUL"),
    ({"gguf_file": "model.bin"}, "model.gguf_file", "not a .gguf file"),
])
def test_bad_model_ids_are_one_line(model, field, needle, tmp_path, monkeypatch) -> None:
    """Including a directory without config.json plus a gguf_file, which got a bogus hub URL."""
    empty = tmp_path / "no-config"
    empty.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    raw = {**good_recipe(empty), "model": {"id": str(empty), **model}}
    assert needle in _validate_and_run_refuse(raw, work, monkeypatch, field)


def test_local_load_error_drops_the_hub_hint() -> None:
    from quantlab.models.sources import _local_reason

    exc = OSError("/m does not appear to have a file named x.bin. Checkout 'https://huggingface.co//m/tree/main' "
                  "for available files.")
    assert _local_reason(exc) == "/m does not appear to have a file named x.bin."


def test_calibration_source_directory_is_named_a_directory(fake_model_dir, tmp_path, monkeypatch) -> None:
    data = tmp_path / "data"
    data.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    raw = good_recipe(fake_model_dir)
    raw["calibration"]["dataset"]["source"] = str(data)
    line = _validate_and_run_refuse(raw, work, monkeypatch, "calibration.dataset.source")
    assert "is a directory" in line and "not found" not in line


def _short_eval(raw: dict, short: str) -> None:
    raw["evaluate"]["perplexity"]["dataset"]["source"] = short


def _short_calibration(raw: dict, short: str) -> None:
    raw["calibration"]["dataset"]["source"] = short


def _few_chunks(raw: dict, short: str) -> None:
    raw["calibration"].update(strategy="concat_chunk", num_samples=4, dataset={"source": short})


@pytest.mark.parametrize("mutate,field,needle", [
    (_short_eval, "evaluate.perplexity.seq_len", "fewer than one window of 64 tokens"),
    (_short_calibration, "calibration.seq_len", "fewer than one sample of 32 tokens"),
    (_few_chunks, "calibration.num_samples", "fewer than 4 windows of 32 tokens"),
])
def test_too_little_data_is_found_in_preflight(mutate, field, needle, tiny_model_dir, tmp_path, monkeypatch) -> None:
    """Counted with the model's tokenizer before calibration, before any run directory exists."""
    short = tmp_path / "short.txt"
    short.write_text("a few words\n")
    work = tmp_path / "work"
    work.mkdir()
    raw = good_recipe(tiny_model_dir)
    mutate(raw, str(short))
    assert needle in _validate_and_run_refuse(raw, work, monkeypatch, field)
