"""The hostile-input benchmark's generator (benchmarks/hostile_inputs.py): at least 400
malformed recipes and 40 damaged or crafted files, every class represented, the same cases
from the same seed. No subprocess runs here; the benchmark itself runs them through the CLI."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hostile():
    spec = importlib.util.spec_from_file_location("hostile_inputs", REPO / "benchmarks" / "hostile_inputs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["hostile_inputs"] = module
    spec.loader.exec_module(module)
    return module


def _cases(hostile, root: Path, seed: int = 0):
    fx = hostile.fixtures(root / "sentinel", seed)
    return fx, hostile.generate(seed, fx)


@pytest.fixture(scope="module")
def generated(hostile, tmp_path_factory):
    root = tmp_path_factory.mktemp("a")
    return root, *_cases(hostile, root)


def test_counts_and_classes(hostile, generated):
    _, fx, cases = generated
    file_classes = {"gguf", "safetensors", "export-dir", "data-file"}
    recipes = [c for c in cases if c.cls not in file_classes]
    files = [k for k in fx if k != "unrelated"]
    assert len(recipes) >= 400
    assert len(files) >= 40
    assert {c.cls for c in cases} == set(hostile.CLASSES)
    assert len({c.id for c in cases}) == len(cases)
    assert all((c.expect_exit == 2 and c.one_line) or c.why for c in cases)  # any other expectation says why
    assert sum(bool(c.why) for c in cases) <= 5  # exceptions stay exceptions
    # every shipped recipe contributes mutated fields
    stems = {c.id.split()[1].split(":")[0] for c in cases if c.cls.startswith("recipe-") and ":" in c.id}
    assert {p.stem for p in (REPO / "recipes").glob("*.yaml")} <= stems
    # the crafted files the issue names are there
    for name in ("gguf/tensors-2e62.gguf", "gguf/kvs-2e62.gguf", "gguf/value-string-2e60.gguf",
                 "gguf/array-2e61-u8.gguf", "gguf/tensor-dim-2e40.gguf", "gguf/bad-magic.gguf",
                 "safetensors/header-2e62", "safetensors/offsets-past-end", "data/garbage.parquet"):
        assert name in fx


def test_deterministic(hostile, generated, tmp_path):
    root_a, _, a = generated
    fx_b, b = _cases(hostile, tmp_path / "b")
    # same cases, same bytes (fixture paths differ by root only)
    norm = lambda cs, root: [(c.id.replace(str(root), ""), c.cls, [x.replace(str(root), "") for x in c.args],
                              {k: v.replace(str(root).encode(), b"") for k, v in c.files.items()}) for c in cs]
    assert norm(a, root_a) == norm(b, tmp_path / "b")
    for name in ("gguf/random-4096.gguf", "gguf/truncated-100.gguf", "safetensors/random/model.safetensors"):
        assert (root_a / "sentinel" / name).read_bytes() == (tmp_path / "b" / "sentinel" / name).read_bytes()
