"""Side-by-side CPU benchmark: quantlab against GPTQModel and llm-compressor on SmolLM2-135M-Instruct.

Two kinds of rows share one table: 4-bit weight-only (RTN, GPTQ, AWQ at a group size), and
activation / KV-cache quantization (W8A8 with and without SmoothQuant, static FP8 with an FP8
KV cache, C8), where quantlab runs the `stages` of a shipped recipe (ACT_METHODS).

Every tool calibrates on exactly the same token ids and is scored on exactly the same test
tokens with quantlab's own perplexity function:

  * calibration: 128 × 512 tokens, random windows, seed 0, from WikiText-2 train (first 1 MB),
    drawn once by quantlab's sampler and saved as safetensors; quantlab's rows re-draw them
    from the same recipe settings and the benchmark asserts the ids are identical;
  * evaluation: WikiText-2 test joined with "\\n\\n", windows of 2048 tokens, the first
    `--windows` of them (all windows take ~12 min per model on a 2-core CPU);
  * peers run in their own virtualenvs (created on first use, torch pinned to the CPU build)
    through the small scripts in benchmarks/peers/, which quantize and then score the model
    in the same process and write a JSON result.

Each row is one child process; the benchmark measures its wall time and peak RSS
(`os.wait4`), and takes the tool's own quantize time from inside the process.

    /work/venv/bin/python benchmarks/peers_cpu.py --out benchmarks/results/peers_cpu.json
    ... --only 'float,quantlab:*'     # fnmatch patterns over row ids (tool:method-gG[-asym])
    ... --skip-peers --reuse          # rerun quantlab rows, keep saved peer rows
    ... --only 'float,*:smoothquant-*,*:fp8-kv'   # activation / KV rows (ids tool:method)
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quantlab import toolenv
from quantlab.toolenv import ToolEnv

REPO = Path(__file__).resolve().parents[1]
PEER_SCRIPTS = REPO / "benchmarks" / "peers"
RECIPES = REPO / "recipes"
DATA = REPO.parent / "shared" / "data" / "wikitext-2-raw-v1"
TRAIN_FILE = DATA / "wiki.train.first1MB.raw"
TEST_FILE = DATA / "wiki.test.raw"
MODEL_ALIAS = "smollm2-135m-instruct"
SEED, CALIB_SAMPLES, CALIB_SEQ_LEN, EVAL_SEQ_LEN = 0, 128, 512, 2048
DAMP = 0.01


# --------------------------------------------------------------------------- peers and rows


@dataclass(frozen=True)
class PeerEnv:
    """A peer's tool environment and the script that runs it."""

    env: ToolEnv
    script: str
    run_env: tuple[tuple[str, str], ...] = ()
    # (method, script) for methods `script` does not run; not part of spec(): the venv is the same
    method_scripts: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return self.env.name

    def spec(self) -> dict[str, Any]:
        return self.env.spec()

    def script_for(self, method: str) -> str:
        return dict(self.method_scripts).get(method, self.script)

    def runs(self, method: str) -> bool:
        """Whether the peer has a row for an activation / KV method (weight methods: all_rows)."""
        return method in dict(self.method_scripts)


PEERS = {
    p.name: p
    for p in [
        PeerEnv(toolenv.GPTQMODEL, "gptqmodel_run.py", run_env=(("GPTQMODEL_CPU_WORKERS", "2"),)),
        # 0.14 pins transformers<=5.17 and compressed-tensors 0.19: it needs its own environment.
        PeerEnv(ToolEnv("llmcompressor", ("llmcompressor==0.14.0.1",)), "llmcompressor_run.py",
                method_scripts=(("smoothquant-w8a8", "llmcompressor_actquant_run.py"),
                                ("fp8-kv", "llmcompressor_actquant_run.py"))),
    ]
}


@dataclass(frozen=True)
class ActMethod:
    """An activation / KV-cache row. quantlab runs the `stages` of a shipped recipe, read at
    run time, so the benchmark measures exactly what the recipe ships."""

    recipe: str  # recipes/<recipe>.yaml
    scheme: str  # the table's scheme cell


ACT_METHODS = {
    "smoothquant-w8a8": ActMethod("smollm2_smoothquant_a8w8", "SmoothQuant + W8 per-channel, A8 per-token dynamic"),
    "a8w8-static": ActMethod("smollm2_a8w8_static", "W8 per-channel, A8 per-tensor static"),
    "smoothquant-a8w8-static": ActMethod("smollm2_smoothquant_a8w8_static",
                                         "SmoothQuant + W8 per-channel, A8 per-tensor static"),
    "fp8-kv": ActMethod("smollm2_fp8_static", "FP8 W and A per-tensor static, FP8 KV per-tensor"),
    "c8": ActMethod("smollm2_c8", "int8 KV per-head; W and A float"),
}


@dataclass(frozen=True)
class Row:
    tool: str  # float | quantlab | a PEERS key
    method: str  # float | rtn | gptq | awq | an ACT_METHODS key (no group size)
    group_size: int | None = None
    sym: bool | None = None

    @property
    def id(self) -> str:
        if self.method == "float":
            return "float"
        if self.group_size is None:
            return f"{self.tool}:{self.method}"
        return f"{self.tool}:{self.method}-g{self.group_size}{'' if self.sym else '-asym'}"

    @property
    def slug(self) -> str:
        return self.id.replace(":", "__")

    @property
    def is_peer(self) -> bool:
        return self.tool in PEERS


def all_rows() -> list[Row]:
    """Float, RTN (quantlab only), then GPTQ and AWQ with every tool at group 64 and 128, then
    each activation / KV method with quantlab and every peer that has a script for it.

    128 does not divide SmolLM2's 576 hidden size; the g128 rows record how each tool copes.
    Peer AWQ runs at g64 only (GPTQModel's AWQ is the slowest row by far).
    """
    peers = ("quantlab", *PEERS)
    rows = [Row("float", "float")]
    rows += [Row("quantlab", "rtn", g, sym) for g in (64, 128) for sym in (False, True)]
    rows += [Row(t, "gptq", g, True) for g in (64, 128) for t in peers]
    rows += [Row(t, "awq", 64, False) for t in peers] + [Row("quantlab", "awq", 128, False)]
    rows += [Row(t, m) for m in ACT_METHODS for t in peers if t == "quantlab" or PEERS[t].runs(m)]
    return rows


def select_rows(only: str | None) -> list[Row]:
    """Rows whose id matches one of the comma-separated fnmatch patterns (all rows by default)."""
    patterns = [p.strip() for p in only.split(",") if p.strip()] if only else ["*"]
    return [r for r in all_rows() if any(fnmatch.fnmatch(r.id, p) for p in patterns)]


# --------------------------------------------------------------------------- shared inputs


@dataclass
class Inputs:
    model_dir: Path
    calib: Path
    eval_tokens: Path
    eval_total_tokens: int
    digest: str  # hash of model + calibration ids + eval tokens


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def prepare_inputs(work: Path, samples: int) -> Inputs:
    """Draw the calibration ids and tokenize the test set once, with quantlab's own code."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from quantlab.data import sampling, sources
    from quantlab.models.builtin import float_checkpoint
    from quantlab.recipe import CalibrationSpec, DatasetSpec

    model_dir = float_checkpoint(MODEL_ALIAS)
    folder = work / "inputs"
    folder.mkdir(parents=True, exist_ok=True)
    calib, eval_tokens = folder / "calib.safetensors", folder / "eval_tokens.safetensors"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    spec = CalibrationSpec(dataset=DatasetSpec(source=str(TRAIN_FILE)), num_samples=samples,
                           seq_len=CALIB_SEQ_LEN, strategy="random_windows")
    docs = sources.load_documents(spec.dataset, "calibration.dataset", tokenizer)
    ids = sampling.sample(docs, tokenizer, spec, SEED).input_ids.contiguous()
    test_docs = sources.load_documents(DatasetSpec(source=str(TEST_FILE)), "evaluate.perplexity.dataset", tokenizer)
    stream = sampling.tokenize_joined(test_docs, tokenizer).contiguous()
    for path, tensor in ((calib, ids), (eval_tokens, stream)):
        # Rewritten only when different, and atomically: a concurrent benchmark may be reading it.
        if path.is_file() and torch.equal(load_file(str(path))["input_ids"], tensor):
            continue
        tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
        save_file({"input_ids": tensor}, str(tmp))
        os.replace(tmp, path)
    digest = hashlib.sha256()
    for part in (model_dir / "model.safetensors", model_dir / "config.json", calib, eval_tokens):
        digest.update(sha256_file(part).encode())
    return Inputs(model_dir, calib, eval_tokens, stream.numel(), digest.hexdigest()[:16])


def python_path_dir(work: Path) -> Path:
    """A PYTHONPATH entry holding only `quantlab` (a link to this checkout's package).

    Putting the repository root itself on PYTHONPATH would expose its other top-level folders
    (e.g. `kernels/`, which quantlab installs as `quantlab.kernels`) under their bare names,
    where transformers mistakes `kernels` for the Hugging Face `kernels` package and fails.
    """
    folder = work / "pythonpath"
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "quantlab"
    if not (link.is_symlink() and link.resolve() == (REPO / "quantlab").resolve()):
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(REPO / "quantlab")
    return folder


# --------------------------------------------------------------------------- peer virtualenvs


# --------------------------------------------------------------------------- measured child processes


@dataclass
class Measured:
    returncode: int
    wall_s: float
    peak_rss_mib: float
    timed_out: bool


def run_measured(cmd: list[str], env: dict[str, str], log: Path, cwd: Path, timeout: float) -> Measured:
    """Run a child to completion; its wall time and peak RSS (ru_maxrss, KiB on Linux)."""
    timed_out = threading.Event()
    with log.open("wb") as fh:
        fh.write(f"$ {' '.join(cmd)}\n".encode())
        fh.flush()
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd)

        def kill() -> None:
            timed_out.set()
            proc.kill()

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
    return Measured(proc.returncode, round(time.perf_counter() - start, 2), round(usage.ru_maxrss / 1024, 1),
                    timed_out.is_set())


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1",
               PYTHONDONTWRITEBYTECODE="1")
    env.update(extra)
    return env


# --------------------------------------------------------------------------- one row


@dataclass
class Result:
    id: str
    method: str
    tool: str
    group_size: int | None
    sym: bool | None
    status: str = "not run"  # ok | failed | stopped (by --timeout) | not available | skipped
    perplexity: float | None = None
    delta_vs_float_pct: float | None = None
    quantize_s: float | None = None
    eval_s: float | None = None
    wall_s: float | None = None
    peak_rss_mib: float | None = None
    quantize_ratio: float | None = None  # quantlab quantize time / fastest peer's, same method and group size
    wall_ratio: float | None = None
    wall_ratio_is_bound: bool = False  # the fastest peer was stopped: quantlab's wall ratio is below wall_ratio
    windows: int | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)
    tool_settings: Any = None  # the peer's own configuration objects, as it printed them
    load_avg: list[float] = field(default_factory=list)  # 1-min load average before and after: a busy CPU shows here
    cpu: str | None = None  # the machine the row ran on (cpu_name()); times are compared only within one
    inputs_hash: str | None = None
    reused: bool = False
    log: str | None = None

    @classmethod
    def for_row(cls, row: Row) -> "Result":
        return cls(row.id, row.method, row.tool, row.group_size, row.sym)


def source_hash(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            digest.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:16]


class Bench:
    def __init__(self, args: argparse.Namespace, inputs: Inputs, work: Path):
        self.args, self.inputs, self.work = args, inputs, work
        self.pythonpath = python_path_dir(work)
        self.published = published_rows(args.out)

    def row_hash(self, row: Row, recipe_text: str = "") -> str:
        if row.is_peer:
            # The row's own script and the peer's main one (a method script imports helpers from it).
            peer = PEERS[row.tool]
            scripts = dict.fromkeys([peer.script, peer.script_for(row.method)])
            tool = json.dumps(peer.spec()) + source_hash(PEER_SCRIPTS / "_common.py",
                                                         *(PEER_SCRIPTS / s for s in scripts))
        elif row.tool == "quantlab":
            tool = source_hash(*(d for d in (REPO / "quantlab", REPO / "kernels") if d.is_dir())) + recipe_text
        else:
            tool = source_hash(PEER_SCRIPTS / "_common.py", PEER_SCRIPTS / "float_run.py")
        tool += source_hash(REPO / "quantlab" / "eval" / "perplexity.py")
        parts = [asdict(row), self.inputs.digest, self.args.windows, EVAL_SEQ_LEN, DAMP, tool]
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def run(self, row: Row) -> Result:
        folder = self.work / "rows" / row.slug
        saved = folder / "result.json"
        if not saved.is_file() and row.id in self.published:
            # A fresh work dir (another machine): start from the row as last published in --out.
            folder.mkdir(parents=True, exist_ok=True)
            saved.write_text(json.dumps(self.published[row.id], indent=2) + "\n")
        recipe_text = quantlab_recipe(row, self.args, folder / "run") if row.tool == "quantlab" else ""
        digest = self.row_hash(row, recipe_text)
        if self.args.from_saved:
            return saved_result(row, saved, digest)
        if saved.is_file() and (self.args.reuse or (row.is_peer and self.args.skip_peers)):
            old = saved_result(row, saved, digest)
            if old.inputs_hash == digest and old.status == "ok":
                return old
        result = Result.for_row(row)
        result.inputs_hash = digest
        if row.is_peer and self.args.skip_peers:
            result.status, result.error = "skipped", "--skip-peers and no saved result for these inputs"
            return result
        if row.tool == "quantlab" and (missing := quantlab_missing(row)):
            result.status, result.error = "not available", missing
            return result
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        result.load_avg, result.cpu = [round(os.getloadavg()[0], 2)], cpu_name()
        try:
            if row.tool == "quantlab":
                self._run_quantlab(row, folder, recipe_text, result)
            else:
                self._run_script(row, folder, result)
        except Exception as exc:  # a peer that cannot even be installed is a row, not a crash
            result.status, result.error = "failed", f"{type(exc).__name__}: {exc}"
        result.load_avg.append(round(os.getloadavg()[0], 2))
        saved.write_text(json.dumps(asdict(result), indent=2) + "\n")
        return result

    def _run_script(self, row: Row, folder: Path, result: Result) -> None:
        if row.is_peer:
            peer = PEERS[row.tool]
            python = toolenv.ensure(peer.env, self.args.venvs)
            script = peer.script_for(row.method)
            env = child_env({"PYTHONPATH": str(self.pythonpath), **dict(peer.run_env)})
        else:
            python, script, env = Path(sys.executable), "float_run.py", child_env({"PYTHONPATH": str(self.pythonpath)})
        out = folder / "peer_result.json"
        cmd = [str(python), str(PEER_SCRIPTS / script), "--model", str(self.inputs.model_dir),
               "--calib", str(self.inputs.calib), "--eval", str(self.inputs.eval_tokens), "--method", row.method,
               "--seq-len", str(EVAL_SEQ_LEN), "--workdir", str(folder), "--out", str(out)]
        if row.method not in ACT_METHODS:  # weight-only settings (_common.parse_args)
            cmd += ["--damp", str(DAMP), "--no-act-order"]
        if row.method not in ACT_METHODS and row.method != "float":
            cmd += ["--bits", "4", "--group-size", str(row.group_size), "--sym" if row.sym else "--no-sym"]
        if self.args.windows:
            cmd += ["--windows", str(self.args.windows)]
        measured = self._measure(cmd, env, folder, result)
        if not out.is_file():
            result.status = "stopped" if result.status == "stopped" else "failed"  # _measure saw a timeout
            result.error = result.error or f"exit {measured.returncode}, no result; {tail(folder / 'log.txt')}"
            return
        payload = json.loads(out.read_text())
        result.versions = payload.get("versions", {})
        result.tool_settings = payload.get("config")
        result.notes += [f"{k}: {v}" for k, v in (("kernel", payload.get("kernel")),
                                                   ("torch threads", payload.get("torch_threads"))) if v]
        result.notes += payload.get("workarounds", []) + payload.get("notes", [])
        seconds = payload.get("seconds", {})
        result.quantize_s, result.eval_s = seconds.get("quantize"), seconds.get("eval")
        if payload.get("status") != "ok":
            result.status, result.error = "failed", payload.get("error") or tail(folder / "log.txt")
            return
        self._take_perplexity(payload["perplexity"], result)

    def _run_quantlab(self, row: Row, folder: Path, recipe_text: str, result: Result) -> None:
        from importlib.metadata import version

        recipe = folder / "recipe.yaml"
        recipe.write_text(recipe_text)
        cli = Path(sys.executable).with_name("quantlab")
        cmd = [str(cli), "run", str(recipe)] if cli.exists() else [sys.executable, "-m", "quantlab", "run", str(recipe)]
        result.versions = {"quantlab": version("quantlab"), "git": git_revision(), **torch_versions()}
        self._measure(cmd, child_env({}), folder, result)
        run = folder / "run"
        if result.status in ("failed", "stopped"):
            return
        self._check_calibration(run / "calib" / "tokens.safetensors", result)
        config = json.loads((run / "quantized" / "quant_config.json").read_text())
        ppl = json.loads((run / "reports" / "perplexity_quantized.json").read_text())
        result.quantize_s, result.eval_s = config.get("quantize_seconds"), ppl.get("seconds")
        if row.method in ACT_METHODS:
            check_quantlab_fake_quant(config, result)
        if result.status != "failed":
            self._take_perplexity(ppl, result)

    def _measure(self, cmd: list[str], env: dict[str, str], folder: Path, result: Result) -> Measured:
        log = folder / "log.txt"
        result.log = str(log)
        measured = run_measured(cmd, env, log, cwd=folder, timeout=self.args.timeout)
        result.wall_s, result.peak_rss_mib = measured.wall_s, measured.peak_rss_mib
        if measured.timed_out:
            # Not a failure: the row ran out of the time this benchmark gave it, and its wall time
            # so far is a lower bound on the tool's (see derive()).
            result.status = "stopped"
            result.error = f"stopped by --timeout {self.args.timeout:.0f} s; last output: {tail(log)}"
        elif measured.returncode != 0:
            result.status, result.error = "failed", f"exit {measured.returncode}: {tail(log)}"
        return measured

    def _check_calibration(self, tokens: Path, result: Result) -> None:
        """quantlab re-draws the calibration set from the recipe: it must be the shared one."""
        import torch
        from safetensors.torch import load_file

        if not torch.equal(load_file(str(tokens))["input_ids"], load_file(str(self.inputs.calib))["input_ids"]):
            result.status, result.error = "failed", "quantlab's calibration ids differ from the shared set"
        else:
            result.notes.append("calibration ids identical to the shared set")

    def _take_perplexity(self, ppl: dict[str, Any], result: Result) -> None:
        result.perplexity, result.windows = ppl["perplexity"], ppl["windows"]
        result.status = "ok"


def published_rows(out: Path) -> dict[str, dict[str, Any]]:
    """Rows of a previous run's `--out` JSON by id: a committed table seeds an empty work dir, so
    hours of peer rows are not rerun on a new machine when their inputs hash still matches."""
    try:
        payload = json.loads(out.read_text())
        rows = {r["id"]: r for r in payload["rows"] if r.get("status") in ("ok", "stopped")}
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    for r in rows.values():  # rows from before the per-row machine field ran on the table's machine
        r.setdefault("cpu", payload.get("machine", {}).get("cpu"))
    return rows


def saved_result(row: Row, saved: Path, digest: str) -> Result:
    """A row's last saved result as it is, flagged when its inputs hash no longer matches."""
    if not saved.is_file():
        result = Result.for_row(row)
        result.error = "no saved result"
        return result
    fields = set(Result.__dataclass_fields__)
    result = Result(**{k: v for k, v in json.loads(saved.read_text()).items() if k in fields})
    result.reused = True
    if result.inputs_hash != digest:
        result.notes.append("saved by other code or inputs (inputs hash differs from now)")
    return result


def check_quantlab_fake_quant(config: dict[str, Any], result: Result) -> None:
    """An activation / KV row must evaluate with quantized Linear inputs or K/V: quantlab's
    evaluation applies fake quant to the modules quant_config.json lists."""
    from quantlab.eval.fake_quant import describe

    linears = len((config.get("activations") or {}).get("modules", []))
    attns = len((config.get("kv_cache") or {}).get("modules", []))
    if linears + attns == 0:
        result.status, result.error = "failed", "quant_config.json lists no activation or KV modules to fake-quantize"
    else:
        result.notes.append(f"fake quant at evaluation: {describe(config)} on {linears} Linear inputs, "
                            f"{attns} attention modules")


def quantlab_stages(row: Row) -> list[dict[str, Any]]:
    """The row's recipe stages: a shipped recipe's as written for an activation / KV method,
    else one 4-bit weight stage."""
    import yaml

    if row.method in ACT_METHODS:
        path = RECIPES / f"{ACT_METHODS[row.method].recipe}.yaml"
        return yaml.safe_load(path.read_text(encoding="utf-8"))["stages"]
    weights = {"bits": 4, "symmetric": bool(row.sym), "group_size": row.group_size}
    stage: dict[str, Any] = {"weights": weights}
    if row.method == "gptq":
        stage.update(damp_percent=DAMP, act_order=False)
    return [{row.method: stage}]


def quantlab_recipe(row: Row, args: argparse.Namespace, run_dir: Path) -> str:
    """A recipe with the benchmark's settings; baseline off (the float row is measured once)."""
    import yaml

    perplexity: dict[str, Any] = {"dataset": {"source": str(TEST_FILE)}, "seq_len": EVAL_SEQ_LEN, "baseline": False}
    if args.windows:
        perplexity["max_windows"] = args.windows
    recipe = {
        "name": f"bench_{row.slug}".replace("__", "_"), "seed": SEED, "device": "cpu",
        "model": {"id": MODEL_ALIAS},
        "calibration": {"dataset": {"source": str(TRAIN_FILE)}, "num_samples": args.calib_samples,
                        "seq_len": CALIB_SEQ_LEN, "strategy": "random_windows"},
        "stages": quantlab_stages(row),
        "evaluate": {"perplexity": perplexity},
        "output": {"dir": str(run_dir)},
    }
    return yaml.safe_dump(recipe, sort_keys=False)


def quantlab_missing(row: Row) -> str | None:
    """Why quantlab cannot run the row yet (a stage of its recipe is missing), else None."""
    kinds = [next(iter(stage)) for stage in quantlab_stages(row)]
    return next((why for kind in kinds if (why := quantlab_missing_stage(kind))), None)


def quantlab_missing_stage(method: str) -> str | None:
    """Why quantlab cannot run `method` yet (its stage or algorithm is missing), else None."""
    from quantlab.algorithms import build_algorithm
    from quantlab.recipe import StageEntry

    if method not in StageEntry.model_fields:
        return f"quantlab has no `{method}` recipe stage yet"
    try:
        build_algorithm(StageEntry.model_validate({method: {}}))
    except (NotImplementedError, ImportError) as exc:
        return f"quantlab's `{method}` stage has no algorithm yet ({exc})"
    return None


# --------------------------------------------------------------------------- derived columns, output


def derive(results: list[Result]) -> None:
    """Δ vs float, and quantlab's time over the fastest peer's for the same method and group
    (activation / KV rows have no group: the method alone pairs them)."""
    base = next((r.perplexity for r in results if r.method == "float" and r.status == "ok"), None)
    for r in results:
        r.delta_vs_float_pct = r.quantize_ratio = r.wall_ratio = None  # a reused row's were for another table
        r.wall_ratio_is_bound = False
        if base and r.perplexity is not None and r.method != "float":
            r.delta_vs_float_pct = round(100 * (r.perplexity / base - 1), 2)
    for r in results:
        if r.tool != "quantlab" or r.status != "ok":
            continue
        # Times compare only on one machine: a peer row kept from another CPU pairs with nothing.
        peers = [p for p in results if p.tool in PEERS and (p.method, p.group_size) == (r.method, r.group_size)
                 and p.cpu == r.cpu]
        finished = [p for p in peers if p.status == "ok"]
        for attr, ratio in (("quantize_s", "quantize_ratio"), ("wall_s", "wall_ratio")):
            times = [getattr(p, attr) for p in finished if getattr(p, attr)]
            if times and getattr(r, attr):
                setattr(r, ratio, round(getattr(r, attr) / min(times), 2))
        # A stopped peer's wall time at the stop is a lower bound on its whole wall time, so when
        # it is the fastest known, quantlab's wall ratio is an upper bound (shown as "<").
        stopped = [p.wall_s for p in peers if p.status == "stopped" and p.wall_s]
        if stopped and r.wall_s and (r.wall_ratio is None or r.wall_s / min(stopped) > r.wall_ratio):
            r.wall_ratio, r.wall_ratio_is_bound = round(r.wall_s / min(stopped), 2), True


COLUMNS = ["method", "tool", "scheme", "perplexity", "Δ vs float", "quantize s", "wall s", "peak RSS MiB",
           "quantize ×peer", "wall ×peer", "status"]


def cells(r: Result) -> list[str]:
    def num(v: float | None, fmt: str) -> str:
        return "—" if v is None else format(v, fmt)

    if r.method in ACT_METHODS:
        scheme = ACT_METHODS[r.method].scheme
    else:
        scheme = "—" if r.group_size is None else f"W4 g{r.group_size} {'sym' if r.sym else 'asym'}"
    stale = any("hash differs" in n for n in r.notes)
    status = r.status + (" (reused)" if r.reused else "") + (" (stale)" if stale else "") + (f": {r.error}" if r.error and r.status != "ok" else "")
    delta = "—" if r.delta_vs_float_pct is None else f"{r.delta_vs_float_pct:+.2f}%"
    return [r.method, r.tool, scheme, num(r.perplexity, ".3f"), delta, num(r.quantize_s, ".1f"), num(r.wall_s, ".1f"),
            num(r.peak_rss_mib, ".0f"), num(r.quantize_ratio, ".2f"),
            ("<" if r.wall_ratio_is_bound else "") + num(r.wall_ratio, ".2f"), status]


def print_table(results: list[Result], subtitle: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(*COLUMNS, title="quantlab vs peers — SmolLM2-135M-Instruct, CPU", caption=subtitle)
    for r in results:
        table.add_row(*cells(r))
    Console(width=200).print(table)


def markdown(payload: dict[str, Any], results: list[Result]) -> str:
    m = payload["machine"]
    recipes = [f"- `{a}`: quantlab `recipes/{ACT_METHODS[a].recipe}.yaml`"
               for a in dict.fromkeys(r.method for r in results) if a in ACT_METHODS]
    lines = [
        "# quantlab vs peers on CPU — SmolLM2-135M-Instruct", "",
        f"- evaluation: {payload['evaluation']['description']}",
        f"- calibration: {payload['calibration']['description']}",
        f"- machine: {m['cpu']} — {m['nproc']} CPUs, {m['mem_gib']} GiB, torch threads {m['torch_threads']}, "
        f"load average {m['load_avg_start']} at start, {m['load_avg_end']} at end",
        f"- total benchmark time: {payload['total_seconds']:.0f} s",
        "- the peers' AWQ rows take hours here and are `stopped`; their perplexity, quantized on a GPU with the "
        "same inputs and scorer, is in `peers_gpu_awq_<gpu>.md`", "",
        "quantize s = the tool's own time around its quantize call; wall s = the whole child process "
        "(load, calibration, quantize, evaluation); ×peer = quantlab's time over the fastest peer's "
        "for the same method and group size (`<x`: the fastest peer was stopped by --timeout, so its whole wall time exceeds what was measured and the ratio is below x). Activation / KV rows (no group): quantlab runs the `stages` of "
        "a shipped recipe (below); every tool's scored model quantizes Linear inputs and/or K/V in forward.", "",
        *([*recipes, ""] if recipes else []),
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" if i < 3 or i == len(COLUMNS) - 1 else "---:" for i in range(len(COLUMNS))) + "|",
    ]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells(r)) + " |" for r in results]
    def row_notes(r: Result) -> list[str]:
        elsewhere = [f"ran on another machine ({r.cpu}); its times pair with no row of this one"] \
            if r.cpu and r.cpu != m["cpu"] else []
        return [*elsewhere, *r.notes, *([r.error] if r.error else [])]

    notes = [f"- `{r.id}`: " + "; ".join(texts) for r in results if (texts := row_notes(r))]
    if notes:
        lines += ["", "## Notes", "", *notes]
    lines += ["", "## Versions", ""]
    lines += [f"- {tool}: " + ", ".join(f"{k} {v}" for k, v in versions.items())
              for tool, versions in payload["versions"].items()]
    return "\n".join(lines) + "\n"


def machine_info() -> dict[str, Any]:
    import torch

    cpu = cpu_name()
    mem = next((int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), 0)
    return {"cpu": cpu, "nproc": len(os.sched_getaffinity(0)), "mem_gib": round(mem / 2**20, 1),
            "torch_threads": torch.get_num_threads(), "platform": platform.platform(), "nice": os.nice(0),
            "load_avg_start": round(os.getloadavg()[0], 2)}


def device_slug(name: str) -> str:
    """A device's name as it appears in result file names (`NVIDIA H200` → `nvidia_h200`)."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def cpu_name() -> str:
    return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), platform.processor())


def torch_versions() -> dict[str, str]:
    from importlib.metadata import version

    return {"torch": version("torch"), "transformers": version("transformers")}


def git_revision() -> str:
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "quantlab"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def tail(log: Path, chars: int = 300) -> str:
    if not log.is_file():
        return ""
    lines = [l for l in log.read_text(errors="replace").splitlines() if l.strip()]
    return " | ".join(lines[-3:])[-chars:]


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from quantlab.models.builtin import cache_root

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "peers_cpu.json",
                   help="result JSON; the Markdown table is written next to it (.md)")
    p.add_argument("--windows", type=int, default=20,
                   help="score the first N windows of 2048 test tokens (0 = all 149; ~12 min per model)")
    p.add_argument("--only", help="comma-separated fnmatch patterns over row ids, e.g. 'float,quantlab:*,*:gptq-g64' "
                                  "(Δ vs float needs the float row); --list shows the ids")
    p.add_argument("--skip-peers", action="store_true",
                   help="run no peer; show a peer's saved result when its inputs hash matches")
    p.add_argument("--reuse", action="store_true", help="reuse any saved row result whose inputs hash matches")
    p.add_argument("--from-saved", action="store_true",
                   help="run nothing: tabulate each selected row's last saved result, flagging stale hashes")
    p.add_argument("--list", action="store_true", help="list the row ids and exit")
    p.add_argument("--calib-samples", type=int, default=CALIB_SAMPLES,
                   help=f"calibration windows (default {CALIB_SAMPLES}); fewer only for smoke tests of the plumbing")
    p.add_argument("--timeout", type=float, default=4 * 3600, help="seconds before a row's process is killed")
    p.add_argument("--work", type=Path, default=cache_root() / "bench" / "peers_cpu",
                   help="scratch: shared inputs, per-row logs, run dirs and saved results")
    p.add_argument("--venvs", type=Path, default=toolenv.default_root(),
                   help="where peer virtualenvs are built (env QUANTLAB_TOOL_ENVS)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = select_rows(args.only)
    if args.list:
        print("\n".join(r.id for r in all_rows()))
        return 0
    start = time.perf_counter()
    machine = machine_info()
    work = args.work.resolve()
    say(f"preparing shared inputs in {work}/inputs")
    inputs = prepare_inputs(work, args.calib_samples)
    bench = Bench(args, inputs, work)
    results = []
    for i, row in enumerate(rows, 1):
        say(f"[{i}/{len(rows)}] {row.id} ...")
        r = bench.run(row)
        results.append(r)
        ppl = "" if r.perplexity is None else f" ppl {r.perplexity:.3f}"
        say(f"[{i}/{len(rows)}] {row.id}: {r.status}{' (reused)' if r.reused else ''}{ppl}"
            f"{'' if r.wall_s is None else f' in {r.wall_s:.0f} s'}{'' if not r.error else ' — ' + r.error[:200]}")
    derive(results)
    machine["load_avg_end"] = round(os.getloadavg()[0], 2)
    available = inputs.eval_total_tokens // EVAL_SEQ_LEN
    used = min(args.windows, available) if args.windows else available
    subset = (f"WikiText-2 test, windows of {EVAL_SEQ_LEN} tokens: the first {used} of {available} "
              f"({used * (EVAL_SEQ_LEN - 1)} tokens scored of {inputs.eval_total_tokens})")
    versions: dict[str, dict[str, str]] = {}
    for r in results:
        if r.versions:
            versions.setdefault(r.tool, r.versions)
    payload = {
        "benchmark": "peers_cpu", "model": MODEL_ALIAS, "model_dir": str(inputs.model_dir),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "total_seconds": round(time.perf_counter() - start, 1),
        "machine": machine, "inputs_hash": inputs.digest,
        "calibration": {"file": str(TRAIN_FILE), "num_samples": args.calib_samples, "seq_len": CALIB_SEQ_LEN,
                        "strategy": "random_windows", "seed": SEED,
                        "description": f"{args.calib_samples} × {CALIB_SEQ_LEN} tokens, random windows, seed {SEED}, "
                                       f"from {TRAIN_FILE.name} (same ids for every tool)"},
        "evaluation": {"file": str(TEST_FILE), "seq_len": EVAL_SEQ_LEN, "windows": used,
                       "windows_available": available, "description": subset},
        "settings": {"bits": 4, "gptq": {"damp": DAMP, "act_order": False}, "lm_head": "float",
                     "activation_kv_rows": {m: {"quantlab_recipe": f"recipes/{a.recipe}.yaml", "scheme": a.scheme}
                                            for m, a in ACT_METHODS.items()}},
        "versions": versions,
        "rows": [asdict(r) for r in results],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(payload, results))
    print_table(results, subset)
    say(f"wrote {args.out} and {args.out.with_suffix('.md')} ({payload['total_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
