"""Recipe loading: schema defaults, presets, overrides, error messages, resolved dump."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from quantlab.errors import UserError
from quantlab.quant.scheme import PRESETS, WeightScheme
from quantlab.recipe import Recipe, dump_recipe, load_recipe, validate_recipe, yaml_path
from conftest import REPO

SHIPPED = sorted((REPO / "recipes").glob("*.yaml"))


def minimal() -> dict:
    return {"name": "r", "seed": 0, "model": {"id": "m"}, "stages": [{"rtn": None}]}


def write(tmp_path: Path, raw: dict | str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_recipes_validate(path: Path) -> None:
    recipe = load_recipe(path)
    assert recipe.name == path.stem  # `quantlab run <name>` finds it by file name
    assert recipe.stages and recipe.evaluate.perplexity is not None


def test_w8_preset_is_per_channel_symmetric() -> None:
    recipe = load_recipe(REPO / "recipes" / "smollm2_rtn_w8a16.yaml")
    assert recipe.stages[0].config.weights == WeightScheme(bits=8, symmetric=True, group_size=None)


def test_defaults_and_null_stage_body() -> None:
    recipe = validate_recipe(minimal())
    assert recipe.stages[0].kind == "rtn"
    assert recipe.stages[0].config.weights == PRESETS["W4A16"]
    assert recipe.calibration is None and recipe.evaluate.perplexity is None
    assert recipe.run_dir == Path("runs/r") and recipe.device == "auto"


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_by_name(preset: str) -> None:
    raw = minimal() | {"stages": [{"rtn": {"weights": preset}}]}
    assert validate_recipe(raw).stages[0].config.weights == PRESETS[preset]


def test_overrides_apply_before_validation(tmp_path: Path) -> None:
    raw = minimal() | {"calibration": {"dataset": {"source": "x.txt"}}}
    path = write(tmp_path, raw)
    recipe = load_recipe(path, ["calibration.num_samples=64", "stages.0.rtn.weights=W8A16",
                                "evaluate.perplexity.dataset.source=wikitext2", "output.dir=/tmp/out"])
    assert recipe.calibration.num_samples == 64  # YAML-typed: an int, not "64"
    assert recipe.stages[0].config.weights == PRESETS["W8A16"]
    assert recipe.evaluate.perplexity.dataset.source == "wikitext2"  # intermediate mappings created
    assert recipe.run_dir == Path("/tmp/out")
    recipe = load_recipe(path, ["stages.0.rtn.weights.group_size=null"])
    assert recipe.stages[0].config.weights.group_size is None
    # the file itself is untouched
    assert yaml.safe_load(path.read_text()) == raw


@pytest.mark.parametrize("override,needle", [
    ("calibration.num_samples=0", "calibration.num_samples: got 0"),
    ("calibration.dataset=null", "calibration.dataset: got None"),
    ("stages.1.rtn=null", "--set stages.1.rtn: '1' is not an index of a 1-item list"),
    ("stages.0.rtn.weights.bits=6", "stages[0].rtn.weights.bits: got 6"),
    ("seed", "--set 'seed': expected key.path=value"),
])
def test_bad_overrides_raise_user_error(tmp_path: Path, override: str, needle: str) -> None:
    raw = minimal() | {"calibration": {"dataset": {"source": "x.txt"}}}
    with pytest.raises(UserError) as info:
        load_recipe(write(tmp_path, raw), [override])
    assert needle in str(info.value)


def test_unknown_keys_list_what_is_allowed() -> None:
    raw = minimal() | {"stages": [{"rtn": {"weights": {"bits": 4, "grp": 8}}}]}
    with pytest.raises(UserError) as info:
        validate_recipe(raw, origin="r.yaml")
    assert str(info.value).startswith("r.yaml: stages[0].rtn.weights.grp: unknown key; allowed here: "
                                      "bits, symmetric, group_size")
    raw = minimal() | {"calibration": {"dataset": {"source": "x", "fields": "t"}}}
    with pytest.raises(UserError, match=r"calibration\.dataset\.fields: unknown key; allowed here: source, subset"):
        validate_recipe(raw)
    with pytest.raises(UserError, match=r"^recipe: colour: unknown key; allowed here: name, seed, device, model"):
        validate_recipe(minimal() | {"colour": "red"})


def test_several_problems_are_counted_on_one_line() -> None:
    raw = {"name": "bad name", "seed": -1, "stages": []}
    with pytest.raises(UserError) as info:
        validate_recipe(raw)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("recipe: name: ") and "(and 3 more problems)" in message


def test_yaml_path() -> None:
    assert yaml_path(("stages", 0, "rtn", "weights", "group_size")) == "stages[0].rtn.weights.group_size"
    assert yaml_path(()) == "(top level)"


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_resolved_dump_loads_back_identically(path: Path) -> None:
    """recipe.resolved.yaml in a run dir must be a valid recipe that means the same thing."""
    recipe = load_recipe(path, ["calibration.num_samples=3"])
    raw = yaml.safe_load(dump_recipe(recipe))
    assert all(len(stage) == 1 for stage in raw["stages"])
    again = validate_recipe(raw)
    assert again == recipe
    assert isinstance(again, Recipe) and again.calibration.num_samples == 3


def test_resolved_dump_keeps_per_channel() -> None:
    recipe = validate_recipe(minimal() | {"stages": [{"rtn": {"weights": "W8A16"}}]})
    raw = yaml.safe_load(dump_recipe(recipe))
    assert raw["stages"] == [{"rtn": {"weights": PRESETS["W8A16"].model_dump(mode="json"), "ignore": [],
                                      "lm_head": False}}]
    assert raw["stages"][0]["rtn"]["weights"]["group_size"] is None
    assert validate_recipe(raw).stages[0].config.weights.group_size is None


@pytest.mark.parametrize("override,needle", [
    # a field of a preset: replacing "W8A16" by {bits: 4} would silently drop per-channel
    ("stages.0.rtn.weights.bits=4", "--set stages.0.rtn.weights.bits: stages.0.rtn.weights is a value ('W8A16')"),
    ("name.sub=1", "--set name.sub: name is a value ('r')"),
])
def test_override_through_a_scalar_is_refused(tmp_path: Path, override: str, needle: str) -> None:
    raw = minimal() | {"stages": [{"rtn": {"weights": "W8A16"}}]}
    with pytest.raises(UserError) as info:
        load_recipe(write(tmp_path, raw), [override])
    assert str(info.value).startswith(needle)


def test_override_through_null_creates_the_mapping(tmp_path: Path) -> None:
    raw = minimal() | {"output": None}
    assert load_recipe(write(tmp_path, raw), ["output.dir=out"]).run_dir == Path("out")
