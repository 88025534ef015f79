"""Hostile recipes and `--set` values: every one ends in one `UserError` line naming the file
line or field, quickly, never a traceback, RecursionError or hang (pure Python, no model)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from quantlab.cli import app
from quantlab.errors import UserError
from quantlab.recipe import MAX_YAML_BYTES, load_recipe

BASE = "name: r\nseed: 0\nmodel: {id: m}\nstages: [{rtn: null}]\n"
DEEP = "[" * 500 + "]" * 500
# the classic "billion laughs": 9 levels of 9 aliases, ~630 bytes, 10^9 strings if expanded
BOMB = 'a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 9))


def _sub(old: str, new: str) -> str:
    assert old in BASE
    return BASE.replace(old, new)


WEIGHTS = "{rtn: {weights: {%s}}}"
# (id, recipe text, --set overrides, what the one-line message must contain)
CASES: list[tuple[str, str, list[str], str]] = [
    ("duplicate-key", BASE + "stages: [{gptq: null}]\n", [], "line 5: duplicate key 'stages'"),
    ("duplicate-nested-key", _sub("{id: m}", "{id: m, id: n}"), [], "line 3: duplicate key 'id'"),
    ("depth-bomb-file", _sub("seed: 0", "seed: " + DEEP), [], "line 2: nested more than 64 levels"),
    ("depth-bomb-set", BASE, ["seed=" + DEEP], "--set seed=...: nested more than 64 levels"),
    ("alias-bomb", BASE + BOMB, [], "aliases expand to more than 10000 nodes"),
    ("many-values", BASE + "x: [" + "1," * 30_000 + "1]\n", [], "more than 20000 values"),
    ("oversized", BASE + "# " + "x" * MAX_YAML_BYTES + "\n", [], "larger than 1 MiB"),
    ("int-as-string", _sub("seed: 0", "seed: '64'"), [], "seed: got '64'"),
    ("int-as-float", BASE, ["calibration.num_samples=64.0", "calibration.dataset.source=x"],
     "calibration.num_samples: got 64.0"),
    ("int-as-bool", _sub("seed: 0", "seed: true"), [], "seed: got True"),
    ("bits-as-float", _sub("{rtn: null}", WEIGHTS % "bits: 4.0"), [], "bits: got 4.0"),
    ("bool-as-string", _sub("{rtn: null}", "{rtn: {lm_head: 'true'}}"), [], "stages[0].rtn.lm_head: got 'true'"),
    ("seed-2**64", _sub("seed: 0", f"seed: {2**64}"), [], "seed: got 18446744073709551616: must be 0 <= seed"),
    ("seed-5000-digits", _sub("seed: 0", "seed: " + "9" * 5000), [], "line 2: cannot read value"),
    ("group-size-2**40", BASE, [f"stages.0.rtn.weights={{group_size: {2**40}}}"],
     "stages[0].rtn.weights: got {'group_size': 1099511627776}: group_size"),
    ("unicode-digit-path", BASE, ["stages.\u00b2.rtn=null"], "--set 'stages.\u00b2.rtn': a key path is ASCII"),
    ("empty-segment", BASE, ["stages..rtn=null"], "--set 'stages..rtn': a key path"),
    ("control-char-path", BASE, ["model.i\x01d=x"], "--set 'model.i\\x01d': a key path"),
    ("index-out-of-range", BASE, ["stages.7.rtn=null"], "--set stages.7.rtn: '7' is not an index"),
    ("nul-in-model-id", _sub("{id: m}", '{id: "m\\0"}'), [], "model.id: got 'm\\x00': text must not contain"),
    ("nul-in-output-dir", BASE, ["output.dir=a\x00b"], "output.dir: got 'a\\x00b'"),
    ("surrogate-in-source", BASE, ['calibration.dataset.source="\\ud800"'],
     "calibration.dataset.source: got '\\ud800'"),
    ("surrogate-argv-model-id", BASE, ["model.id=a\udcff"], "model.id: got 'a\\udcff'"),
    ("nul-in-key", BASE + '"a\\0b": 1\n', [], "a\\x00b: unknown key"),
    ("python-tag", BASE + "x: !!python/object/apply:os.system [ls]\n", [], "could not determine a constructor"),
    ("impossible-date", BASE + "x: 2001-02-30\n", [], "line 5: cannot read value"),
]


@pytest.mark.parametrize("text,overrides,needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_input_is_one_line_user_error(text: str, overrides: list[str], needle: str, tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    start = time.perf_counter()
    with pytest.raises(UserError) as info:
        load_recipe(path, overrides)
    assert time.perf_counter() - start < 1.0
    message = str(info.value)
    assert needle in message, message
    assert message.isprintable() and len(message) < 300, message  # one short printable line
    message.encode("utf-8")  # no lone surrogate reaches the terminal


def test_set_values_keep_their_lax_fallback_and_shipped_limits(tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(BASE)
    # a value that is not valid YAML is still taken as text; merge keys may override
    recipe = load_recipe(path, ["model.id=a: b: c", "output={<<: {dir: x}, dir: y}", f"seed={2**64 - 1}"])
    assert recipe.model.id == "a: b: c" and str(recipe.run_dir) == "y" and recipe.seed == 2**64 - 1
    assert load_recipe(path, [f"stages.0.rtn.weights={{group_size: {2**16}}}"]).stages[0].config.weights.group_size \
        == 2**16


@pytest.mark.parametrize("args,needle", [
    (["validate", "recipe.yaml"], "recipe.yaml: line 5: duplicate key 'stages'"),
    (["validate", "ok.yaml", "--set", "seed=" + DEEP], "--set seed=...: nested more than 64 levels"),
], ids=["duplicate-key", "depth-bomb-set"])
def test_cli_prints_one_line_and_exits_2(args: list[str], needle: str, tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "recipe.yaml").write_text(BASE + "stages: [{gptq: null}]\n")
    (tmp_path / "ok.yaml").write_text(BASE)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
