"""Hostile recipes and damaged or crafted input files through the real CLI, one subprocess each:
the product's promise is one stderr line naming the field, file or value, exit code 2, no
traceback, no hang, and nothing written or left behind.

    python benchmarks/hostile_inputs.py                      # every case, 2 workers
    python benchmarks/hostile_inputs.py --class gguf --limit 20
    python benchmarks/hostile_inputs.py --list               # case ids and classes, run nothing

Every case is regenerated from `--seed` (default 0): recipes by mutating every field of every
shipped recipe (`recipes/*.yaml`, data paths made absolute) with a wrong type, an out-of-range
value, a null, an unknown key, a removed required key (distinct field × mutation once), plus
the hand-listed hostile YAML, `output.dir`, `model.id`, data source and `--set` variants; files
by damaging a small valid GGUF (written with the `gguf` package), crafting GGUF and
safetensors headers, and writing garbage export directories and data files. Each case runs
from its own scratch directory under `--work` (default /tmp/quantlab-hostile); the fixture
files sit in a sentinel directory outside it. Checked per case:

* exit code 2 (or the case's own expectation, recorded with its reason),
* exactly one non-empty stderr line, and no "Traceback" in stdout or stderr,
* wall time under 15 s (the child is killed at 15 s) and its max RSS (`os.wait4`) under 1 GiB,
* the scratch directory tree and the sentinel directory byte-identical before and after (paths,
  types, modes, contents, link targets), and no path the case names outside them (a hostile
  `output.dir`) created or changed. Anything a case leaves outside is removed after recording.

Writes `benchmarks/results/hostile_inputs_cpu.{json,md}` (or `--out DIR`): one table per class,
and every failing case with its command and stderr tail.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import typing
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
DATA = (REPO / ".." / "shared" / "data").resolve()
TRAIN = DATA / "wikitext-2-raw-v1" / "wiki.train.first1MB.raw"
TEST = DATA / "wikitext-2-raw-v1" / "wiki.test.raw"
MODEL = "smollm2-135m-instruct"
MODEL_CACHE = Path.home() / ".cache" / "quantlab" / "models" / MODEL
HIDDEN = 576  # SmolLM2-135M's hidden size: the smallest Linear input width
WALL_LIMIT_S = 15.0
RSS_LIMIT_KIB = 1 << 20  # 1 GiB
CLASSES = ("recipe-type", "recipe-range", "recipe-key", "recipe-yaml", "output-dir", "model-id", "data-source",
           "set-override", "gguf", "safetensors", "export-dir", "data-file")
# A mutation's stand-ins, per type of the value it replaces
NAMES = {str: "string", int: "int", float: "float", bool: "bool", list: "list", dict: "mapping", type(None): "null"}


@dataclasses.dataclass
class Case:
    id: str
    cls: str
    args: list[str]  # after `quantlab`; run from the case's scratch directory
    files: dict[str, bytes] = dataclasses.field(default_factory=dict)  # written into the scratch dir
    links: dict[str, str] = dataclasses.field(default_factory=dict)  # scratch-relative name -> target
    watch: list[str] = dataclasses.field(default_factory=list)  # outside paths that must not change
    expect_exit: int = 2
    one_line: bool = True  # False: one stderr line or more (a documented list of failures)
    why: str = ""  # the reason, where the expectation is not exit 2 with one line

    def command(self) -> str:
        return "quantlab " + " ".join(_quote(a) for a in self.args)


def _quote(arg: str) -> str:
    import shlex

    text = arg if arg.isprintable() else arg.encode("unicode_escape").decode()
    return shlex.quote(text if len(text) <= 200 else text[:200] + "...")


def _yaml(raw: Any) -> bytes:
    return yaml.safe_dump(raw, sort_keys=False, allow_unicode=True, width=10**6).encode("utf-8", "surrogatepass")


def recipe_case(id_: str, cls: str, raw: Any, command: str = "run", sets: list[str] | None = None,
                **kw: Any) -> Case:
    text = raw if isinstance(raw, bytes) else _yaml(raw)
    args = [command, "recipe.yaml"] + [a for s in sets or [] for a in ("--set", s)]
    return Case(id_, cls, args, files={"recipe.yaml": text, **kw.pop("files", {})}, **kw)


# --------------------------------------------------------------------------- shipped recipes


def shipped() -> dict[str, dict[str, Any]]:
    """Every shipped recipe with its relative data paths made absolute (they resolve against the
    repository root) and no output.dir (a run would go to runs/<name> in the scratch cwd)."""
    out = {}
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())

        def fix(node: Any) -> Any:
            if isinstance(node, dict):
                return {k: (str((REPO / v).resolve()) if k == "source" and isinstance(v, str) and v.startswith(".")
                            else fix(v)) for k, v in node.items()}
            return [fix(v) for v in node] if isinstance(node, list) else node

        raw = fix(raw)
        raw.pop("output", None)
        out[path.stem] = raw
    return out


def _schema_at(path: tuple[Any, ...]) -> tuple[Any, Any]:
    """(annotation, pydantic FieldInfo or None) of the field at `path` in the recipe schema."""
    from quantlab.recipe import Recipe

    annotation: Any = Recipe
    info = None
    for part in path:
        model = _model_in(annotation)
        if isinstance(part, int):
            annotation = _list_item(annotation)
            continue
        if model is None or part not in model.model_fields:
            return None, None
        info = model.model_fields[part]
        annotation = info.annotation
    return annotation, info


def _model_in(annotation: Any) -> Any:
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _list_item(annotation: Any) -> Any:
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is list:
            return typing.get_args(arg)[0]
    return None


def _nullable(annotation: Any) -> bool:
    return annotation is None or type(None) in typing.get_args(annotation)


def _literal(annotation: Any) -> bool:
    return typing.get_origin(annotation) is typing.Literal or any(
        typing.get_origin(a) is typing.Literal for a in typing.get_args(annotation))


# Fields where 0 is out of range (seed and perplexity_windows take 0)
ZERO_INVALID = {"num_samples", "seq_len", "max_windows", "group_size", "bits", "block_size", "grid", "clip_grid",
                "max_tokens", "block_tokens", "num_prompts", "prompt_tokens", "max_new_tokens", "max_input_tokens",
                "batch_size", "damp_percent", "max_shrink", "percentile"}


def mutations(path: tuple[Any, ...], value: Any) -> list[tuple[str, str, Any]]:
    """(class, mutation name, new value) for the value at `path`; every one is invalid by the
    schema (`Strict` models validate strictly: "64", 64.0 and true are not integers)."""
    annotation, info = _schema_at(path)
    key = next((p for p in reversed(path) if isinstance(p, str)), "")
    out: list[tuple[str, str, Any]] = []
    if isinstance(value, bool):
        out += [("recipe-type", "string 'true'", "true"), ("recipe-type", "int 1", 1),
                ("recipe-type", "list", [value]), ("recipe-type", "mapping", {"value": value})]
    elif isinstance(value, int):
        out += [("recipe-type", "string digits", str(value)), ("recipe-type", "float", float(value)),
                ("recipe-type", "bool true", True), ("recipe-type", "list", [value]),
                ("recipe-type", "mapping", {"value": value}),
                ("recipe-range", "negative", -1), ("recipe-range", "2**64", 2**64),
                ("recipe-range", "5000 digits", "INT5000")]
        if key in ZERO_INVALID:
            out.append(("recipe-range", "zero", 0))
    elif isinstance(value, float):
        out += [("recipe-type", "string digits", str(value)), ("recipe-type", "bool true", True),
                ("recipe-type", "list", [value]), ("recipe-range", "negative", -1.0),
                ("recipe-range", "1e300", 1e300), ("recipe-range", "nan", float("nan")),
                ("recipe-range", "inf", float("inf"))]
    elif isinstance(value, str):
        out += [("recipe-type", "int", 123), ("recipe-type", "float", 1.5), ("recipe-type", "bool true", True),
                ("recipe-type", "list", [value]), ("recipe-type", "mapping", {"value": value})]
        if _literal(annotation) or key == "weights":  # a Literal, or a preset name
            out.append(("recipe-range", "unknown choice", "no-such-choice"))
        if info is not None and any(getattr(m, "min_length", None) for m in info.metadata):
            out.append(("recipe-range", "empty string", ""))
        if key == "name":
            out += [("recipe-range", "path in name", "../../evil name"), ("recipe-range", "129 chars", "n" * 129)]
    elif isinstance(value, list):
        out += [("recipe-type", "string", "x"), ("recipe-type", "int", 5), ("recipe-type", "mapping", {"x": 1})]
        if key in ("ignore", "clip_skip", "skip", "prompts", "export"):
            out.append(("recipe-type", "list of ints", [1, 2]))
    elif isinstance(value, dict):
        out += [("recipe-type", "string", "NOPE"), ("recipe-type", "int", 5), ("recipe-type", "list", [1, 2])]
    if not isinstance(value, type(None)) and not _nullable(annotation) and info is not None:
        out.append(("recipe-type", "null", None))
    return out


def _leaves(node: Any, path: tuple[Any, ...] = ()):
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, path + (i,))


def _set(raw: Any, path: tuple[Any, ...], value: Any) -> Any:
    import copy

    raw = copy.deepcopy(raw)
    node = raw
    for part in path[:-1]:
        node = node[part]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return raw


_DELETE = object()


def _norm(path: tuple[Any, ...]) -> str:
    return ".".join("N" if isinstance(p, int) else str(p) for p in path)


def field_cases(recipes: dict[str, dict[str, Any]]) -> list[Case]:
    """Every field of every shipped recipe, mutated: each (field, mutation) pair once, from the
    first recipe (alphabetically) that has the field; a field whose pairs all ran already gets
    one of its mutations, in turn, so every recipe's every field is covered."""
    seen: set[tuple[str, str]] = set()
    cases = []
    for stem, raw in recipes.items():
        for path, value in list(_leaves(raw)):
            if not path:
                continue
            options = mutations(path, value)
            fresh = [m for m in options if (_norm(path), m[1]) not in seen]
            if not fresh and options:  # every field of every recipe: one mutation, in turn, if none is new
                fresh = [options[len(cases) % len(options)]]
            for cls, name, new in fresh:
                seen.add((_norm(path), name))
                text = _yaml(_set(raw, path, new))
                if new == "INT5000":
                    text = text.replace(b"INT5000", b"9" * 5000)
                cases.append(recipe_case(f"{stem}:{_norm(path)}={name}", cls, text,
                                         command="validate" if len(cases) % 5 == 0 else "run"))
            if isinstance(value, dict):
                sig = (_norm(path), "unknown key")
                if sig not in seen:
                    seen.add(sig)
                    cases.append(recipe_case(f"{stem}:{_norm(path)}+no_such_key", "recipe-key",
                                             _set(raw, path + ("no_such_key",), 1)))
                for k in value:
                    _, info = _schema_at(path + (k,))
                    sig = (_norm(path + (k,)), "missing")
                    if info is not None and info.is_required() and sig not in seen:
                        seen.add(sig)
                        cases.append(recipe_case(f"{stem}:{_norm(path + (k,))} missing", "recipe-key",
                                                 _set(raw, path + (k,), _DELETE)))
        for top in ("name", "seed", "model", "stages"):
            sig = (top, "missing")
            if sig not in seen:
                seen.add(sig)
                cases.append(recipe_case(f"{stem}:{top} missing", "recipe-key", _set(raw, (top,), _DELETE)))
    return cases


# --------------------------------------------------------------------------- hand-listed recipe cases


def special_recipe_cases(base: dict[str, Any], gptq: dict[str, Any], fx: dict[str, str],
                         rng: random.Random) -> list[Case]:
    body = _yaml(base)
    c: list[Case] = []

    def add(id_, cls, raw, **kw):
        c.append(recipe_case(id_, cls, raw, **kw))

    # ---- keys and stage kinds
    add("stage kind unknown", "recipe-key", _set(base, ("stages",), [{"no_such_stage": {}}]))
    add("stage two kinds", "recipe-key", _set(base, ("stages",), [{"rtn": {}, "gptq": {}}]))
    add("stage empty mapping", "recipe-key", _set(base, ("stages",), [{}]))
    add("stage as string", "recipe-key", _set(base, ("stages",), ["rtn"]))
    add("stages empty list", "recipe-range", _set(base, ("stages",), []))
    add("stage kind with weights unknown key", "recipe-key",
        _set(base, ("stages",), [{"rtn": {"weights": {"bits": 4, "group_size": 64, "no_such_key": 1}}}]))
    add("top-level unknown key", "recipe-key", _set(base, ("no_such_key",), 1))
    add("gptq without calibration", "recipe-key", _set(gptq, ("calibration",), _DELETE))
    # ---- ranges that need the stage schema or the model
    for g, cls in ((3, "recipe-range"), (100, "recipe-range"), (-64, "recipe-range"), (2**40, "recipe-range"),
                   (2**64, "recipe-range"), (4096, "recipe-range"), (1024, "recipe-range")):
        raw = _set(base, ("stages",), [{"rtn": {"weights": {"bits": 4, "symmetric": False, "group_size": g}}}])
        # 4096 and 1024 are powers of two the schema takes, but wider than SmolLM2's 576 inputs
        add(f"group_size {g}", cls, raw)
        if g in (4096, 2**40):
            add(f"group_size {g} (validate)", cls, raw, command="validate")
    add("gptq group_size 4096 (model-dependent)", "recipe-range",
        _set(gptq, ("stages",), [{"gptq": {"weights": {"bits": 4, "group_size": 4096}}}]))
    add("bits 4.0", "recipe-type", _set(base, ("stages",), [{"rtn": {"weights": {"bits": 4.0}}}]))
    add("bits '4'", "recipe-type", _set(base, ("stages",), [{"rtn": {"weights": {"bits": "4"}}}]))
    add("bits 16", "recipe-range", _set(base, ("stages",), [{"rtn": {"weights": {"bits": 16}}}]))
    add("seed 2**64", "recipe-range", _set(base, ("seed",), 2**64))
    add("seed 64.0", "recipe-type", _set(base, ("seed",), 64.0))
    add("seed true", "recipe-type", _set(base, ("seed",), True))
    add("seed '64'", "recipe-type", _set(base, ("seed",), "64"))
    add("device cuda (no CUDA here)", "recipe-range", _set(base, ("device",), "cuda"))
    add("device cuda (validate)", "recipe-range", _set(base, ("device",), "cuda"), command="validate")
    add("device tpu", "recipe-range", _set(base, ("device",), "tpu"))
    add("seq_len above the model's context", "recipe-range", _set(base, ("evaluate", "perplexity", "seq_len"), 131072))
    # ---- YAML itself
    add("duplicate stages key", "recipe-yaml", body + b"stages:\n  - gptq: {}\n")
    add("duplicate nested key", "recipe-yaml", body.replace(b"model:\n", b"model:\n  id: x\n", 1))
    for tag in (b"!!python/object/apply:os.system ['touch PWNED']", b"!!python/name:os.system",
                b"!!python/object:os.stat_result {}", b"!!binary aGVsbG8=", b"!!set {a, b}", b"!custom 1",
                b"!!timestamp 2001-02-30"):
        add(f"tag {tag.split()[0].decode()}", "recipe-yaml", body.replace(b"name: ", b"name: " + tag + b" #", 1))
    laughs = b"a: &a [lol,lol,lol,lol,lol,lol,lol,lol,lol]\n" + b"".join(
        b"%s: &%s [*%s,*%s,*%s,*%s,*%s,*%s,*%s,*%s,*%s]\n" % ((chr(98 + i).encode(), chr(98 + i).encode())
                                                            + (chr(97 + i).encode(),) * 9) for i in range(9))
    add("billion laughs (extra keys)", "recipe-yaml", laughs + body)
    add("billion laughs in name", "recipe-yaml",
        laughs.replace(b"\n", b"\n", 1) + body.replace(b"name: smollm2_rtn_w4a16", b"name: *j", 1))
    add("billion laughs in seed (wrong type)", "recipe-yaml", laughs + body.replace(b"seed: 0", b"seed: *j", 1))
    add("alias to mapping as seed", "recipe-yaml", body.replace(b"seed: 0", b"seed: *m", 1).replace(
        b"model:\n", b"model: &m\n", 1))
    add("deep nesting 500 flow", "recipe-yaml", body.replace(b"seed: 0", b"seed: " + b"[" * 500 + b"]" * 500, 1))
    add("deep nesting 500 block", "recipe-yaml",
        body + b"".join(b"  " * i + b"k%d:\n" % i for i in range(500)) + b"  " * 500 + b"v\n")
    add("deep nesting 100000 flow", "recipe-yaml", b"[" * 100000 + b"]" * 100000)
    add("file over 1 MiB (comment)", "recipe-yaml", body + b"# " + b"x" * (1 << 20) + b"\n")
    add("file over 1 MiB (one string)", "recipe-yaml", body.replace(b"name: smollm2_rtn_w4a16", b"name: " + b"n" * (1 << 20)))
    add("500k-element flow list", "recipe-yaml", body + b"extra: [" + b"1," * 400000 + b"1]\n")
    add("NUL byte raw", "recipe-yaml", body.replace(b"seed: 0", b"seed: 0\x00", 1))
    add("NUL escape in name", "recipe-yaml", body.replace(b"name: smollm2_rtn_w4a16", b'name: "a\\0b"', 1))
    add("lone surrogate escape in model.id", "recipe-yaml", body.replace(b"id: " + MODEL.encode(), b'id: "\\udc80"', 1))
    add("lone surrogate escape in source", "recipe-yaml",
        body.replace(str(TRAIN).encode(), b'"/tmp/\\ud800.txt"', 1))
    add("invalid UTF-8 byte", "recipe-yaml", body.replace(b"name: smollm2", b"name: \xff\xfesmollm2", 1))
    add("UTF-8 encoded surrogate", "recipe-yaml", body.replace(b"name: smollm2", b"name: \xed\xa0\x80smollm2", 1))
    add("UTF-16 file", "recipe-yaml", body.decode().encode("utf-16"))
    for i, n in enumerate((64, 4096, 70000)):
        add(f"binary garbage {n} bytes", "recipe-yaml", rng.randbytes(n))
    add("empty file", "recipe-yaml", b"")
    add("whitespace only", "recipe-yaml", b"\n   \n\t\n")
    add("comment only", "recipe-yaml", b"# nothing\n")
    add("top level list", "recipe-yaml", _yaml([base]))
    add("top level scalar", "recipe-yaml", b"42\n")
    add("top level string", "recipe-yaml", b"hello\n")
    add("top level null", "recipe-yaml", b"~\n")
    add("two documents", "recipe-yaml", body + b"---\n" + body)
    add("tab indentation", "recipe-yaml", body.replace(b"  id:", b"\tid:", 1))
    add("unclosed flow", "recipe-yaml", body + b"extra: [1, 2\n")
    add("merge key from scalar", "recipe-yaml", body + b"x: &s 1\nevaluate2:\n  <<: *s\n")
    add("invalid date in seed", "recipe-yaml", body.replace(b"seed: 0", b"seed: 2001-02-30", 1))
    add("int with 5000 digits in seed", "recipe-yaml", body.replace(b"seed: 0", b"seed: " + b"9" * 5000, 1))
    add("mapping as key", "recipe-yaml", body + b"? {a: 1}\n: 2\n")
    c.append(Case("recipe path is a directory", "recipe-yaml", ["run", "adir"], files={"adir/keep": b""}))
    c.append(Case("recipe file missing", "recipe-yaml", ["run", "missing.yaml"]))
    c.append(Case("recipe /dev/null", "recipe-yaml", ["run", "/dev/null"]))
    c.append(Case("recipe /dev/zero", "recipe-yaml", ["validate", "/dev/zero"]))
    c.append(Case("recipe a FIFO-like /proc file", "recipe-yaml", ["run", "/proc/self/status"]))
    c.append(Case("recipe named .yaml that is a link to /dev/zero", "recipe-yaml", ["run", "z.yaml"],
                  links={"z.yaml": "/dev/zero"}))
    # ---- output.dir
    home = str(Path.home())
    for d, watch in (("/", []), ("/etc/x", ["/etc/x"]), ("../../..", []), (".", []), ("..", []),
                     ("~/x", [home + "/x"]), ("~", []), ("/dev/null/run", []), ("/proc/x", ["/proc/x"]),
                     ("/sys/x", ["/sys/x"]), (home, []), ("linked", []), ("existing", []),
                     (fx["unrelated"], []), (fx["unrelated"] + "/../unrelated", []), ("recipe.yaml", []),
                     ("recipe.yaml/run", []), ("a\x00b", []), ("", [])):
        files = {"existing/precious.txt": b"keep me\n"} if d == "existing" else {}
        links = {"linked": fx["unrelated"]} if d == "linked" else {}
        for command in ("run", "validate"):
            add(f"output.dir {d!r} ({command})", "output-dir", _set(base, ("output",), {"dir": d}),
                command=command, files=files, links=links, watch=watch)
    add("output.dir int", "output-dir", _set(base, ("output",), {"dir": 5}))
    add("output.dir list", "output-dir", _set(base, ("output",), {"dir": ["a"]}))
    add("output as string", "output-dir", _set(base, ("output",), "/tmp/x"))
    # ---- model.id
    for mid, extra in ((" ", {}), ("\x00", {}), ("a\x00b", {}), ("/dev/null", {}), ("README.md", {}),
                       (fx["unrelated"], {}), (fx["unrelated"], {"gguf_file": "model.gguf"}),
                       (fx["unrelated"], {"gguf_file": "../../../etc/passwd"}),
                       (fx["unrelated"], {"gguf_file": "precious.txt"}),
                       ("nobody/no-such-model", {}), ("nobody/no-such-model", {"revision": "main"}),
                       ("no-such-alias", {}), ("/nonexistent/dir", {}), ("~/no-such-model", {}),
                       ("modelscope:nobody/no-such-model", {}), ("../../../../../../../etc", {}),
                       ("/proc/self", {}), ("x" * 5000, {}), ("https://example.invalid/model", {})):
        model = {"id": mid, **extra}
        for command in ("run", "validate"):
            label = mid.replace(str(Path(fx["unrelated"]).parent), "$SENTINEL")[:40]
            add(f"model.id {label!r} {extra} ({command})", "model-id", _set(base, ("model",), model),
                command=command, files={"README.md": b"# not a model\n"})
    add("model.dtype int8", "model-id", _set(base, ("model",), {"id": MODEL, "dtype": "int8"}))
    add("model.trust_remote_code 'yes'", "model-id", _set(base, ("model",), {"id": MODEL, "trust_remote_code": "yes"}))
    # ---- data sources in the recipe (files made by `fixtures`)
    for name in DATA_FILES:
        path = fx[f"data/{name}"]
        add(f"calibration source {name}", "data-source",
            _set(gptq, ("calibration", "dataset", "source"), path))
        add(f"evaluation source {name}", "data-source",
            _set(base, ("evaluate", "perplexity", "dataset", "source"), path))
    for src in ("/nonexistent.txt", fx["unrelated"], "/dev/null", "/dev/zero", "/proc/self/status",
                "file.csv", "", "nobody/no-such-dataset", "modelscope:nobody/none"):
        add(f"calibration source {src!r}", "data-source", _set(gptq, ("calibration", "dataset", "source"), src))
    add("calibration text_field missing in jsonl", "data-source",
        _set(gptq, ("calibration", "dataset"), {"source": str(DATA / "c4" / "c4_demo_300docs.jsonl"),
                                                "text_field": "no_such_field"}))
    add("rouge source binary", "data-source",
        _set(base, ("evaluate", "rouge"), {"dataset": {"source": fx["data/binary.jsonl"]}}))
    add("rouge source empty jsonl", "data-source",
        _set(base, ("evaluate", "rouge"), {"dataset": {"source": fx["data/empty.jsonl"]}}))
    add("rouge template without {document}", "data-source",
        _set(base, ("evaluate", "rouge"), {"dataset": {"source": "cnn_dailymail"}, "template": "no doc"}))
    # ---- --set
    sets = [("unicode digit index", "stages.\u00b2.rtn.weights.bits=4"),
            ("unicode digit key", "seed\u0660=1"),
            ("500-deep list", "seed=" + "[" * 500 + "]" * 500),
            ("500-deep mapping", "seed=" + "{a: " * 500 + "1" + "}" * 500),
            ("no such path", "no.such.path=1"), ("no such nested path", "model.no_such=1"),
            ("seed 2**64", f"seed={2**64}"), ("seed 5000 digits", "seed=" + "9" * 5000),
            ("no equals", "seed"), ("empty key", "=1"), ("empty", ""), ("dots only", "...=1"),
            ("index out of range", "stages.5.rtn.weights.bits=4"), ("huge index", "stages.99999999999.rtn=1"),
            ("negative index", "stages.-1.rtn=1"), ("through a scalar", "seed.x=1"),
            ("through a preset", "stages.0.rtn.weights.bits.x=1"),
            ("yaml tag value", "seed=!!python/object/apply:os.system [true]"),
            ("alias bomb value", "seed=" + laughs.decode().replace("\n", "\n")),
            ("NUL escape in value", 'name="a\\0b"'), ("surrogate escape in value", 'model.id="\\udc80"'),
            ("space key", "see d=1"),
            ("bits string", "stages.0.rtn.weights.bits=four"), ("output.dir root", "output.dir=/"),
            ("device cuda", "device=cuda"), ("stages null", "stages=null"), ("model null", "model=~"),
            ("value 120 KiB", "name=" + "n" * (120 << 10)), ("unclosed flow", "seed=[1,")]
    for i, (label, s) in enumerate(sets):
        add(f"--set {label}", "set-override", base, sets=[s], command="validate" if i % 4 == 3 else "run")
    return c


# --------------------------------------------------------------------------- damaged files


DATA_FILES = ("dir.txt", "binary.txt", "latin1.txt", "nul.txt", "invalid-line.jsonl", "empty.jsonl",
              "arrays.jsonl", "null-text.jsonl", "garbage.parquet", "eval-too-short.txt", "calib-too-short.txt",
              "empty.txt", "newlines.raw", "garbage.json", "binary.jsonl", "huge-line.jsonl", "bom-garbage.txt",
              "nested.jsonl")


def gguf_valid_bytes(tmp: Path) -> bytes:
    """A small, valid GGUF: llama metadata (strings, a string array, an int array) and 3 tensors."""
    import numpy as np
    import gguf

    path = tmp / "valid.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("hostile-fixture")
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_token_list([f"t{i}" for i in range(16)])
    w.add_array("test.ints", list(range(32)))
    rng = np.random.default_rng(0)
    for name, shape in (("token_embd.weight", (16, 8)), ("blk.0.attn_q.weight", (8, 8)), ("output_norm.weight", (8,))):
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _gstr(s: bytes | str) -> bytes:
    s = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(s)) + s


def _ghead(version: int = 3, tensors: int = 0, kvs: int = 1) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, kvs)


def gguf_files(valid: bytes, rng: random.Random) -> dict[str, bytes]:
    kv_arch = _gstr("general.architecture") + struct.pack("<I", 8) + _gstr("llama")
    header_end = valid.find(b"output_norm.weight") + 80
    out = {"valid-base.gguf": valid}  # not a case: the base of the damaged ones (also inspected once)
    for n in (0, 3, 4, 8, 16, 23, 24, 40, 100, header_end // 2, header_end, len(valid) // 2, len(valid) - 1):
        out[f"truncated-{n}.gguf"] = valid[:n]
    for n in (16, 4096, 65536):
        out[f"random-{n}.gguf"] = rng.randbytes(n)
    out["random-magic.gguf"] = b"GGUF" + rng.randbytes(4092)
    out["bad-magic.gguf"] = b"GGUX" + valid[4:]
    for v in (0, 1, 4, 2**32 - 1):
        out[f"version-{v}.gguf"] = valid[:4] + struct.pack("<I", v) + valid[8:]
    out["tensors-2e62.gguf"] = _ghead(tensors=2**62, kvs=1) + kv_arch
    out["kvs-2e62.gguf"] = _ghead(tensors=0, kvs=2**62) + kv_arch
    out["key-string-2e60.gguf"] = _ghead() + struct.pack("<Q", 2**60) + b"general.architecture"
    out["value-string-2e60.gguf"] = _ghead() + _gstr("general.name") + struct.pack("<IQ", 8, 2**60) + b"x" * 64
    out["array-2e61-u8.gguf"] = _ghead() + _gstr("test.a") + struct.pack("<IIQ", 9, 0, 2**61) + b"\0" * 64
    out["array-2e61-strings.gguf"] = _ghead() + _gstr("test.a") + struct.pack("<IIQ", 9, 8, 2**61) + _gstr("x") * 4
    out["array-nested-100.gguf"] = _ghead() + _gstr("test.a") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 100
    out["kv-type-99.gguf"] = _ghead() + _gstr("test.a") + struct.pack("<I", 99) + b"\0" * 16
    tensor = lambda dims, shape, off=0: (_gstr("t") + struct.pack("<I", dims) + b"".join(
        struct.pack("<Q", s) for s in shape) + struct.pack("<IQ", 0, off))
    out["tensor-dims-2e31.gguf"] = _ghead(tensors=1) + kv_arch + tensor(2**31, [1, 1])
    out["tensor-dim-2e40.gguf"] = _ghead(tensors=1) + kv_arch + tensor(2, [2**40, 2**40]) + b"\0" * 64
    out["tensor-offset-2e62.gguf"] = _ghead(tensors=1) + kv_arch + tensor(1, [4], 2**62) + b"\0" * 64
    out["tensor-type-999.gguf"] = (_ghead(tensors=1) + kv_arch + _gstr("t") + struct.pack("<IQIQ", 1, 4, 999, 0)
                                   + b"\0" * 64)
    out["header-only.gguf"] = _ghead(tensors=0, kvs=0)
    return out


SAFETENSORS = ("header-2e62", "header-past-end", "offsets-past-end", "offsets-reversed", "offsets-strings",
               "truncated", "non-json", "json-list", "random", "empty", "seven-bytes", "shape-mismatch",
               "dtype-bogus", "header-nul")


def safetensors_bytes(kind: str, rng: random.Random) -> bytes:
    def st(header: Any, data: bytes = b"\0" * 16, raw: bytes | None = None) -> bytes:
        h = raw if raw is not None else json.dumps(header).encode()
        return struct.pack("<Q", len(h)) + h + data

    t = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    return {
        "header-2e62": struct.pack("<Q", 2**62) + b"{}" + b"\0" * 32,
        "header-past-end": struct.pack("<Q", 4096) + b'{"a":' + b"\0" * 32,
        "offsets-past-end": st({"model.embed_tokens.weight": {**t, "data_offsets": [0, 2**40]}}),
        "offsets-reversed": st({"model.embed_tokens.weight": {**t, "data_offsets": [16, 0]}}),
        "offsets-strings": st({"model.embed_tokens.weight": {**t, "data_offsets": ["0", "16"]}}),
        "truncated": st({"model.embed_tokens.weight": {**t, "shape": [49152, 576],
                                                       "data_offsets": [0, 49152 * 576 * 4]}})[:4096],
        "non-json": st(None, raw=b"this is not json at all"),
        "json-list": st([1, 2, 3]),
        "random": rng.randbytes(8192),
        "empty": b"",
        "seven-bytes": b"\x10\0\0\0\0\0\0",
        "shape-mismatch": st({"model.embed_tokens.weight": {**t, "shape": [100000, 100000]}}),
        "dtype-bogus": st({"model.embed_tokens.weight": {**t, "dtype": "Q99"}}),
        "header-nul": st(None, raw=b"\0" * 64),
    }[kind]


def data_file(name: str, rng: random.Random) -> bytes | None:
    return {
        "dir.txt": None,
        "binary.txt": rng.randbytes(20000),
        "latin1.txt": ("Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e. " * 2000).encode("latin-1"),
        "nul.txt": (b"Some text\x00 with NUL bytes\x00 in it.\n" * 2000),
        "invalid-line.jsonl": b'{"text": "ok line"}\n{"text": broken\n{"text": "fine"}\n' * 200,
        "empty.jsonl": b"",
        "arrays.jsonl": b'["a", "b"]\n[1, 2, 3]\n' * 200,
        "null-text.jsonl": b'{"text": null}\n' * 500,
        "garbage.parquet": b"PAR1" + rng.randbytes(5000) + b"PAR1",
        "eval-too-short.txt": b"Too short to fill one window.\n",
        "calib-too-short.txt": b"Short.\n",
        "empty.txt": b"",
        "newlines.raw": b"\n" * 5000,
        "garbage.json": b"{\"text\": [" + rng.randbytes(3000).replace(b"\n", b" ") + b"\n",
        "binary.jsonl": rng.randbytes(20000),
        "huge-line.jsonl": b'{"text": "' + b"a" * (3 << 20) + b'"',  # one 3 MiB line, no newline, unterminated
        "bom-garbage.txt": b"\xef\xbb\xbf" + rng.randbytes(3000),
        "nested.jsonl": b'{"text": ' + b"[" * 100000 + b"]" * 100000 + b"}\n",
    }[name]


def fixtures(root: Path, seed: int) -> dict[str, str]:
    """Write the damaged and crafted files under `root` (the sentinel directory); returns
    name -> absolute path. Deterministic from `seed`."""
    rng = random.Random(seed * 7919 + 1)
    root.mkdir(parents=True, exist_ok=True)
    fx: dict[str, str] = {}
    unrelated = root / "unrelated"
    unrelated.mkdir(exist_ok=True)
    (unrelated / "precious.txt").write_bytes(b"data that is not a run\n")
    fx["unrelated"] = str(unrelated)
    with tempfile.TemporaryDirectory() as tmp:
        valid = gguf_valid_bytes(Path(tmp))
    (root / "gguf").mkdir(exist_ok=True)
    for name, data in gguf_files(valid, rng).items():
        (root / "gguf" / name).write_bytes(data)
        fx[f"gguf/{name}"] = str(root / "gguf" / name)
    (root / "gguf" / "dir.gguf").mkdir(exist_ok=True)
    fx["gguf/dir.gguf"] = str(root / "gguf" / "dir.gguf")
    config = (MODEL_CACHE / "config.json").read_bytes() if (MODEL_CACHE / "config.json").is_file() else json.dumps(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN}).encode()
    for kind in SAFETENSORS:
        d = root / "safetensors" / kind
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_bytes(config)
        for tok in ("tokenizer.json", "tokenizer_config.json"):
            if (MODEL_CACHE / tok).is_file() and not (d / tok).is_symlink():
                (d / tok).symlink_to(MODEL_CACHE / tok)
        (d / "model.safetensors").write_bytes(safetensors_bytes(kind, rng))
        fx[f"safetensors/{kind}"] = str(d)
    for name, files in export_dirs(config).items():
        d = root / "export" / name
        d.mkdir(parents=True, exist_ok=True)
        for fname, data in files.items():
            (d / fname).write_bytes(data)
        fx[f"export/{name}"] = str(d)
    (root / "data").mkdir(exist_ok=True)
    for name in DATA_FILES:
        data = data_file(name, rng)
        if data is None:
            (root / "data" / name).mkdir(exist_ok=True)
        else:
            (root / "data" / name).write_bytes(data)
        fx[f"data/{name}"] = str(root / "data" / name)
    return fx


def export_dirs(config: bytes) -> dict[str, dict[str, bytes]]:
    """Export and canonical directories whose JSON is garbage (for `quantlab inspect`)."""
    tiny = struct.pack("<Q", 2) + b"{}"
    cfg = json.loads(config)
    dirs = {}
    for label, qc in (("not-json", b"{not json"), ("empty", b""), ("list", b"[1, 2]"), ("nul", b"\0" * 32),
                      ("empty-object", b"{}"), ("wrong-types", b'{"format": 5, "linears": "x", "scheme": []}'),
                      ("deep", b"[" * 100000 + b"]" * 100000), ("binary", bytes(range(256)) * 4)):
        dirs[f"canonical-quant-config-{label}"] = {"quant_config.json": qc, "config.json": config,
                                                   "model.safetensors": tiny}
    for label, qcfg in (("string", "gptq"), ("gptq-missing-fields", {"quant_method": "gptq"}),
                        ("gptq-bits-string", {"quant_method": "gptq", "bits": "four", "group_size": "x"}),
                        ("awq-null", {"quant_method": "awq", "bits": None, "group_size": None}),
                        ("ct-garbage", {"quant_method": "compressed-tensors", "config_groups": "x"})):
        dirs[f"config-quantization-{label}"] = {"config.json": json.dumps({**cfg, "quantization_config": qcfg}).encode(),
                                                "model.safetensors": tiny}
    dirs["config-not-json"] = {"config.json": b"{{{", "model.safetensors": tiny}
    dirs["config-list"] = {"config.json": b"[]", "model.safetensors": tiny}
    dirs["sidecar-gguf-no-file"] = {"quantlab_export.json": b'{"format": "gguf-q8_0"}'}
    dirs["sidecar-not-json"] = {"quantlab_export.json": b"\xff\xfe garbage", "config.json": b"{{{"}
    dirs["sidecar-format-int"] = {"quantlab_export.json": b'{"format": 5}', "config.json": config}
    dirs["canonical-with-garbage-config"] = {"quant_config.json": b'{"format": "quantlab"}', "config.json": b"{{{",
                                             "model.safetensors": tiny}
    return dirs


# `quantlab inspect` documents "exit 1 if broken": an export it recognises and reads, but which
# breaks its format's rules, is listed rule by rule on stderr (cli.inspect_cmd), exit 1. These
# inputs are well-formed JSON / GGUF that are recognised (a llama GGUF missing most metadata; a
# GPTQ / AWQ quantization_config with missing or mistyped fields), so exit 1 with one stderr line
# per failed rule is the promised outcome; garbage that cannot be read is still expected to exit 2.
INSPECT_BROKEN = "inspect: recognised and readable, breaks its format's rules: exit 1, one line per failed rule"
RULE_BREAKING = {"config-quantization-gptq-missing-fields", "config-quantization-gptq-bits-string",
                 "config-quantization-awq-null"}


def file_cases(fx: dict[str, str], base: dict[str, Any], gptq: dict[str, Any]) -> list[Case]:
    c: list[Case] = []
    for key, path in fx.items():
        group, _, name = key.partition("/")
        if group == "gguf":
            c.append(Case(f"inspect {name}", "gguf", ["inspect", path]))
            if name == "valid-base.gguf":
                c[-1].expect_exit, c[-1].one_line, c[-1].why = 1, False, INSPECT_BROKEN
            c.append(recipe_case(f"run model.id={name}", "gguf", _set(base, ("model",), {"id": path})))
            if name in ("truncated-100.gguf", "tensors-2e62.gguf", "array-2e61-u8.gguf", "random-4096.gguf",
                        "tensor-dim-2e40.gguf"):
                c.append(recipe_case(f"run model.id=dir gguf_file={name}", "gguf", _set(
                    base, ("model",), {"id": str(Path(path).parent), "gguf_file": name})))
        elif group == "safetensors":
            c.append(Case(f"inspect {name}", "safetensors", ["inspect", path]))
            c.append(recipe_case(f"run model.id=<dir with {name} model.safetensors>", "safetensors",
                                 _set(base, ("model",), {"id": path})))
        elif group == "export":
            c.append(Case(f"inspect {name}", "export-dir", ["inspect", path]))
            if name in RULE_BREAKING:
                c[-1].expect_exit, c[-1].one_line, c[-1].why = 1, False, INSPECT_BROKEN
            c.append(Case(f"export {name}", "export-dir", ["export", path, "--format", "gptq", "--out", "out"]))
        elif group == "data":
            pass  # through the recipe's dataset source: special_recipe_cases (class data-source)
    # the valid base GGUF is not a model quantlab can read (three tensors): expected to be refused too
    for name in DATA_FILES:
        # the file itself as a recipe, and as a model
        c.append(Case(f"data file {name} as recipe", "data-file", ["validate", fx[f"data/{name}"]]))
    for name in ("binary.txt", "garbage.parquet", "nul.txt", "invalid-line.jsonl", "null-text.jsonl",
                 "arrays.jsonl", "empty.jsonl", "latin1.txt", "huge-line.jsonl", "nested.jsonl"):
        c.append(recipe_case(f"verify dataset {name}", "data-file", _set(
            base, ("verify",), {"dataset": {"source": fx[f"data/{name}"]}, "num_prompts": 2, "perplexity_windows": 1})))
        c.append(recipe_case(f"calibration chat {name}", "data-file", _set(
            gptq, ("calibration", "dataset"), {"source": fx[f"data/{name}"], "format": "chat"})))
    return c


# --------------------------------------------------------------------------- generation


def generate(seed: int, fx: dict[str, str]) -> list[Case]:
    """Every case, deterministically from `seed` and the fixture paths; no subprocess."""
    rng = random.Random(seed)
    recipes = shipped()
    base, gptq = recipes["smollm2_rtn_w4a16"], recipes["smollm2_gptq_w4a16"]
    cases = field_cases(recipes) + special_recipe_cases(base, gptq, fx, rng) + file_cases(fx, base, gptq)
    count: dict[str, int] = {}
    for c in cases:  # the same mutation of one field from two recipes: #2, #3, ...
        c.id = c.id.replace(str(Path(fx["unrelated"]).parent), "$SENTINEL")
        count[c.id] = count.get(c.id, 0) + 1
        c.id += f" #{count[c.id]}" if count[c.id] > 1 else ""
    for i, c in enumerate(cases):
        c.id = f"{i:04d} {c.id}"
    return cases


# --------------------------------------------------------------------------- running


def snapshot(root: Path) -> dict[str, Any]:
    """Every entry under `root`: type, mode, content hash or link target (not times)."""
    out: dict[str, Any] = {}
    if not os.path.lexists(root):
        return {"": None}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("dir", st.st_mode)
            else:
                h = hashlib.sha256()
                with open(p, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        h.update(chunk)
                out[rel] = ("file", st.st_mode, st.st_size, h.hexdigest())
    return out


def watched(paths: list[str]) -> dict[str, Any]:
    out = {}
    for p in paths:
        try:
            out[p] = snapshot(Path(p)) if os.path.isdir(p) and not os.path.islink(p) else (
                "exists" if os.path.lexists(p) else None)
        except OSError as exc:
            out[p] = f"unreadable {exc.errno}"
    return out


def _diff(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    return sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))


def run_case(case: Case, work: Path, sentinel: Path, quantlab: list[str], lock: threading.Lock) -> dict[str, Any]:
    cwd = work / "cases" / case.id.split()[0]
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    for name, data in case.files.items():
        (cwd / name).parent.mkdir(parents=True, exist_ok=True)
        (cwd / name).write_bytes(data)
    for name, target in case.links.items():
        (cwd / name).symlink_to(target)
    before_cwd, before_watch = snapshot(cwd), watched(case.watch)
    with lock:  # the sentinel is shared by the workers: compare it around each case under the lock's view
        before_sentinel = snapshot(sentinel)
    out_f, err_f = cwd.parent / f"{cwd.name}.stdout", cwd.parent / f"{cwd.name}.stderr"
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    start = time.perf_counter()
    with open(out_f, "wb") as out, open(err_f, "wb") as err:
        proc = subprocess.Popen(quantlab + case.args, cwd=cwd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
        killed = []

        def kill() -> None:
            killed.append(True)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(WALL_LIMIT_S, kill)
        timer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything the CLI left running in its session
    except (ProcessLookupError, PermissionError):
        pass
    stdout = out_f.read_bytes().decode("utf-8", "replace")
    stderr = err_f.read_bytes().decode("utf-8", "replace")
    out_f.unlink()
    err_f.unlink()
    after_cwd, after_watch = snapshot(cwd), watched(case.watch)
    with lock:
        after_sentinel = snapshot(sentinel)
    left = ([f"cwd:{p}" for p in _diff(before_cwd, after_cwd)] + [f"sentinel:{p}" for p in _diff(before_sentinel, after_sentinel)]
            + [p for p in case.watch if before_watch.get(p) != after_watch.get(p)])
    for p in case.watch:  # remove what a case created outside its scratch directory
        if before_watch.get(p) is None and os.path.lexists(p):
            try:
                shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
            except OSError:
                pass
    lines = [line for line in stderr.splitlines() if line.strip()]
    result = {
        "id": case.id, "class": case.cls, "command": case.command(), "expect_exit": case.expect_exit,
        "expect_one_line": case.one_line, "why": case.why, "exit": proc.returncode, "wall_s": round(wall, 2), "max_rss_mib": round(usage.ru_maxrss / 1024, 1),
        "stderr_lines": len(lines), "traceback": "Traceback" in stdout or "Traceback" in stderr,
        "timed_out": bool(killed), "left_behind": left[:10],
        "stderr_tail": stderr[-600:], "stdout_tail": stdout[-300:] if proc.returncode != case.expect_exit else "",
    }
    result["ok_exit"] = proc.returncode == case.expect_exit
    result["ok_one_line"] = len(lines) == 1 if case.one_line else len(lines) >= 1
    result["ok"] = (result["ok_exit"] and result["ok_one_line"] and not result["traceback"] and not killed
                    and wall < WALL_LIMIT_S and usage.ru_maxrss < RSS_LIMIT_KIB and not left)
    shutil.rmtree(cwd, ignore_errors=True)
    return result


def guarded(case: Case, work: Path, sentinel: Path, quantlab: list[str], lock: threading.Lock) -> dict[str, Any]:
    """`run_case`, or a failed result saying why the harness could not run it."""
    try:
        return run_case(case, work, sentinel, quantlab, lock)
    except Exception as exc:  # noqa: BLE001 - recorded as the case's failure
        return {"id": case.id, "class": case.cls, "command": case.command(), "expect_exit": case.expect_exit,
                "exit": None, "wall_s": 0.0, "max_rss_mib": 0.0, "stderr_lines": 0, "traceback": False,
                "timed_out": False, "left_behind": [], "stderr_tail": f"harness: {type(exc).__name__}: {exc}",
                "stdout_tail": "", "ok_exit": False, "ok_one_line": False, "ok": False}


def table(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for cls in [*CLASSES, "all"]:
        rs = [r for r in results if cls in ("all", r["class"])]
        if not rs:
            continue
        rows.append({"class": cls, "cases": len(rs), "exit 2": sum(r["ok_exit"] for r in rs),
                     "one line": sum(r["ok_one_line"] for r in rs),
                     "no traceback": sum(not r["traceback"] for r in rs),
                     "max wall s": max(r["wall_s"] for r in rs), "max RSS MiB": max(r["max_rss_mib"] for r in rs),
                     "left behind": sum(bool(r["left_behind"]) for r in rs),
                     "failures": sum(not r["ok"] for r in rs)})
    return rows


def markdown(rows: list[dict[str, Any]], results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    cols = list(rows[0])
    lines = ["# Hostile and damaged input through the CLI (CPU)", "", f"`{meta['command']}`", "",
             f"{meta['cases']} cases ({meta['recipes']} recipe cases, {meta['files']} damaged or crafted files), "
             f"{meta['workers']} workers, {meta['wall_s']} s wall; quantlab {meta['commit']}. A case passes with exit 2, "
             "one non-empty stderr line, no traceback, under 15 s and 1 GiB max RSS, and its scratch directory, "
             "the sentinel directory and any outside path it names unchanged.", "",
             "| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    lines += ["", "`exit 2` and `one line` count cases that met their expectation: exit 2 with exactly one "
              "stderr line, except the cases below, each with its reason.", ""]
    lines += [f"- {r['id']}: expected exit {r['expect_exit']}, one or more stderr lines ({r['why']})"
              for r in results if r.get("why")]
    failing = [r for r in results if not r["ok"]]
    lines += ["", f"## Failing cases ({len(failing)})", ""]
    for r in failing:
        why = []
        if not r["ok_exit"]:
            why.append(f"exit {r['exit']} (expected {r['expect_exit']})")
        if not r["ok_one_line"]:
            why.append(f"{r['stderr_lines']} stderr lines")
        if r["traceback"]:
            why.append("traceback")
        if r["timed_out"] or r["wall_s"] >= WALL_LIMIT_S:
            why.append(f"hang ({r['wall_s']} s, killed)" if r["timed_out"] else f"{r['wall_s']} s")
        if r["max_rss_mib"] * 1024 >= RSS_LIMIT_KIB:
            why.append(f"{r['max_rss_mib']} MiB RSS")
        if r["left_behind"]:
            why.append("left behind: " + ", ".join(r["left_behind"][:4]))
        tail = [t for t in r["stderr_tail"].strip().splitlines() if t.strip(" ^~")][-3:] or ["(empty stderr)"]
        lines += [f"- **{r['id']}** [{r['class']}]: {'; '.join(why)}", f"  - `{r['command'][:300]}`"]
        lines += ["  - stderr: `" + t[:300].replace("`", "'") + "`" for t in tail]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--limit", type=int, default=None, help="run only the first N cases (after --class)")
    p.add_argument("--class", dest="cls", action="append", default=[], choices=CLASSES, help="run only this class")
    p.add_argument("--match", default=None, help="run only cases whose id contains this text")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="results directory")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "quantlab-hostile")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--list", action="store_true", help="print the case ids and classes, run nothing")
    args = p.parse_args()
    work = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    sentinel = work / "sentinel"
    fx = fixtures(sentinel, args.seed)
    all_cases = generate(args.seed, fx)
    n_recipes = sum(1 for c in all_cases if c.cls not in ("gguf", "safetensors", "export-dir", "data-file"))
    n_files = sum(1 for k in fx if k != "unrelated")
    cases = [c for c in all_cases if (not args.cls or c.cls in args.cls) and (not args.match or args.match in c.id)]
    cases = cases[: args.limit] if args.limit else cases
    if args.list:
        for c in cases:
            print(f"{c.cls:14} {c.id}  ::  {c.command()[:120]}")
        print(f"{len(all_cases)} cases ({n_recipes} recipe cases, {n_files} files)")
        return
    exe = Path(sys.executable).parent / "quantlab"
    quantlab = [str(exe)] if exe.is_file() else [sys.executable, "-m", "quantlab"]
    lock = threading.Lock()
    start = time.perf_counter()
    results: list[dict[str, Any]] = []
    with ThreadPoolExecutor(args.workers) as pool:
        for r in pool.map(lambda c: guarded(c, work, sentinel, quantlab, lock), cases):
            results.append(r)
            mark = "ok  " if r["ok"] else "FAIL"
            print(f"{mark} {str(r['exit']):>4} {r['wall_s']:6.2f}s {r['max_rss_mib']:7.1f}MiB {r['id'][:110]}", flush=True)
    wall = round(time.perf_counter() - start, 1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "quantlab"], cwd=REPO, capture_output=True, text=True).stdout
    command = " ".join(["python benchmarks/hostile_inputs.py"] + sys.argv[1:])
    meta = {"command": command, "seed": args.seed, "cases": len(results), "recipes": n_recipes, "files": n_files,
            "workers": args.workers, "wall_s": wall, "commit": commit + ("+dirty" if dirty else "")}
    rows = table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "hostile_inputs_cpu"
    out.with_suffix(".json").write_text(json.dumps({**meta, "table": rows, "cases": results}, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(rows, results, meta))
    print(markdown(rows, [], meta).split("## Failing")[0])
    print(f"{sum(not r['ok'] for r in results)} failing; wrote {out}.md and .json")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
