"""The real SmolLM2-135M-Instruct runs that the end-to-end, runner-verification and
export-engine tests share: each shipped recipe a test needs runs once per test session through
the real CLI, and every test that needs it reads the same run directory.

A test names the runs it reads with `@pytest.mark.smollm2("case", ...)`. When such tests are
selected, the runs start at the beginning of the session on a pool of two workers, each running
single-threaded processes, while the unit tests run beside them (the tests that read runs are
ordered last, conftest.py); a test blocks only on the runs it reads. Much of a run does not use a second thread (the GPTQ column sweep, Python overhead):
a GPTQ run took 78 s on one thread and 59 s on two, so two one-thread runs side by side do
~1.5× the work of one two-thread run.

Sizes are small where the assertions keep their power. 4 calibration samples of 512 tokens
(and a SmoothQuant α search on 512 of them): what the runner and the engines must reproduce is
the run's own fake-quant model, whatever the calibration's quality. The AWQ + GPTQ run, whose
GGUF Q4_0 must beat llama.cpp's Q4_0 of the float model, takes 8: on the 8 evaluation windows
llama.cpp's float Q4_0 scored 37.3, AWQ + GPTQ from 8 samples 36.1, from 4 samples 37.8. 8 evaluation windows of 512 tokens for the engines'
perplexities (GGUF Q8_0 sat 0.4–0.7 % from float on 8, under a 1 % bar). 8 verify prompts ×
32 greedy tokens. The runner's perplexity is compared on 16 windows for the schemes that round
activations (FP8 is chaotic in float32: a last-bit difference flips an e4m3 code and the flip
grows through 30 layers; with an int8 KV cache the runner sat 0.63 % from fake-quant on 4
windows, 0.31 % on 8, 0.10 % on 16 on a Xeon) and on 4 for weight-only schemes (the same
computation: Δ 0.000 %).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from conftest import REPO, WIKI_TEST, WIKI_TRAIN

sys.path.insert(0, str(REPO / "benchmarks"))
import export_engines  # noqa: E402  (benchmarks/: the scoring the export-engine benchmark does)
import verify_runner  # noqa: E402

WINDOWS = 8
PROMPTS, NEW_TOKENS = 8, 32
FLOAT64_WINDOWS = 2
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass(frozen=True)
class Case:
    """One shipped recipe run with `sets`, its exports scored by their engines and, with
    `verify_windows`, the bundled runner verified against the fake-quant model."""

    id: str
    recipe: str
    sets: tuple[str, ...] = ()
    exports: tuple[str, ...] = ()
    verify_windows: int = 0
    float64: bool = False  # also verify in float64 (no activation code flips on rounding)
    calib_samples: int = 4
    baseline: bool = False  # evaluate the float model too
    shipped: bool = False  # run as shipped apart from data paths, windows and output dir

    def cli_sets(self, run_dir: Path) -> list[str]:
        sets = [*self.sets, f"output.dir={run_dir}", f"evaluate.perplexity.max_windows={WINDOWS}",
                f"calibration.dataset.source={WIKI_TRAIN}", f"evaluate.perplexity.dataset.source={WIKI_TEST}"]
        if self.shipped:
            return sets
        sets += [f"calibration.num_samples={self.calib_samples}", f"export=[{','.join(self.exports)}]"]
        if not self.baseline:
            sets.append("evaluate.perplexity.baseline=false")
        if self.verify_windows:
            sets += [f"verify.num_prompts={PROMPTS}", f"verify.max_new_tokens={NEW_TOKENS}",
                     f"verify.perplexity_windows={self.verify_windows}"]
        return sets


CASES = {c.id: c for c in [
    # the quickstart recipe as shipped; W8 beside it is the nearly lossless reference
    Case("rtn-w4", "smollm2_rtn_w4a16", exports=("compressed-tensors",), shipped=True),
    Case("rtn-w8-per-channel", "smollm2_rtn_w8a16", exports=("gguf-q8_0",), baseline=True),
    Case("awq-gptq-w4-g32-sym", "smollm2_gguf_q4_0", exports=("awq", "gptq", "compressed-tensors", "gguf-q4_0"),
         verify_windows=4, calib_samples=8),
    Case("gptq-w4-g64-asym-act_order", "smollm2_gptq_w4a16", ("stages.0.gptq.weights.symmetric=false",),
         exports=("gptq",), verify_windows=4),
    Case("smoothquant-w8a8-dynamic", "smollm2_smoothquant_a8w8", ("stages.0.smoothquant.max_tokens=512",),
         exports=("compressed-tensors",),
         verify_windows=16, float64=True),
    Case("fp8-static-fp8-kv", "smollm2_fp8_static", exports=("compressed-tensors",), verify_windows=16,
         float64=True),
]}
FLOAT_GGUF = "float-gguf"  # the float model's GGUF baselines, scored on rtn-w8-per-channel's windows
# notebooks/ executed at small settings (QUANTLAB_NOTEBOOK_SMALL=1) as pool jobs: "notebook:<name>"
NOTEBOOKS = sorted(p.stem for p in (REPO / "notebooks").glob("*.ipynb"))
NOTEBOOK_JOBS = [f"notebook:{name}" for name in NOTEBOOKS]
# the longest first: the pool's wall time is at least its longest run
ORDER = ["awq-gptq-w4-g32-sym", "smoothquant-w8a8-dynamic", "fp8-static-fp8-kv", "gptq-w4-g64-asym-act_order",
         *NOTEBOOK_JOBS, "rtn-w8-per-channel", "rtn-w4", FLOAT_GGUF]


@dataclass
class Run:
    """What one case left: its run directory, the CLI's result, scored exports, verify reports."""

    case: Case
    dir: Path
    proc: subprocess.CompletedProcess
    rows: list[dict[str, Any]] = field(default_factory=list)
    verify: dict[str, Any] | None = None
    verify64: dict[str, Any] | None = None

    @property
    def cwd(self) -> Path:
        """The directory the CLI ran from (the run directory's parent)."""
        return self.dir.parent

    def report(self) -> dict[str, Any]:
        return json.loads((self.dir / "reports" / "report.json").read_text())


def cli(case: Case, sets: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`python -m quantlab run` on the case's shipped recipe from `cwd` (as a user would); one
    thread, through the environment `SmolLM2Runs.start` sets."""
    args = ["run", str(REPO / "recipes" / f"{case.recipe}.yaml")]
    for s in sets:
        args += ["--set", s]
    return quantlab(args, cwd)


def child_env() -> dict[str, str]:
    """The environment of the runs' processes: this one's without TRITON_INTERPRET, which
    tests/test_kernels.py sets for itself (under it the runner's decode attention would run
    through the Triton interpreter on the CPU)."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def quantlab(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "quantlab", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=3600, env=child_env())
    if proc.returncode != 0:
        raise RuntimeError(f"quantlab {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc


def verify_summary(run_dir: Path) -> dict[str, Any]:
    return verify_runner.summary(json.loads((run_dir / "reports" / "verify.json").read_text()))


class SmolLM2Runs:
    """The pool: `start(ids)` submits runs, `get(id)` waits for one and returns it."""

    def __init__(self, root: Path):
        self.root = root
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="smollm2")
        self.futures: dict[str, Future] = {}
        self.lock = threading.Lock()

    def start(self, ids: set[str]) -> None:
        if FLOAT_GGUF in ids:
            ids = ids | {"rtn-w8-per-channel"}
        # subprocesses the jobs start (engines included) run on one thread, like the CLI runs
        os.environ.update(ONE_THREAD)
        for case_id in sorted(ids, key=ORDER.index):
            self._submit(case_id)

    def _submit(self, case_id: str) -> Future:
        with self.lock:
            if case_id not in self.futures:
                if case_id == FLOAT_GGUF:
                    job: Callable[[], Any] = self._float_gguf
                elif case_id in NOTEBOOK_JOBS:
                    job = lambda: self._notebook(case_id.removeprefix("notebook:"))  # noqa: E731
                else:
                    job = lambda: self._run(CASES[case_id])  # noqa: E731
                self.futures[case_id] = self.pool.submit(job)
            return self.futures[case_id]

    def get(self, case_id: str) -> Any:
        return self._submit(case_id).result()

    def _run(self, case: Case) -> Run:
        run_dir = self.root / case.id / "run"
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        run = Run(case, run_dir, cli(case, case.cli_sets(run_dir), run_dir.parent))
        if case.shipped and case.exports:  # as a user exports a finished run
            formats = [a for fmt in case.exports for a in ("--format", fmt)]
            quantlab(["export", str(run_dir), *formats], run_dir.parent)
        if case.verify_windows:
            run.verify = verify_summary(run_dir)
        if case.exports:
            run.rows = export_engines.score_case(export_engines.Case(case.id, case.recipe, case.sets, case.exports),
                                                 run_dir)
        if case.float64:
            run.verify64 = self._verify_float64(case, run_dir)
        return run

    def _verify_float64(self, case: Case, run_dir: Path) -> dict[str, Any]:
        """The same run again with `verify.precision=float64` (4 prompts × 16 tokens, 2 perplexity
        windows: the comparison is exact, so size adds no power): the content keys reuse every
        finished stage, only verify and the report rerun."""
        sets = [s for s in case.cli_sets(run_dir) if not s.startswith("verify.")]
        sets += ["verify.precision=float64", "verify.num_prompts=4", "verify.max_new_tokens=16",
                 f"verify.perplexity_windows={FLOAT64_WINDOWS}"]
        proc = cli(case, sets, run_dir.parent)
        return {**verify_summary(run_dir), "stderr": proc.stderr}

    def _float_gguf(self) -> list[dict[str, Any]]:
        w8 = self.get("rtn-w8-per-channel")
        return export_engines.float_baselines(w8.dir, self.root / FLOAT_GGUF, qtypes=("q4_0",))

    def _notebook(self, name: str) -> Any:
        """Execute notebooks/<name>.ipynb at small settings, its runs under the pool's root;
        a failing cell raises (nbclient's CellExecutionError names the cell and its traceback)."""
        import nbclient
        import nbformat

        nb = nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)
        env = {**child_env(), "QUANTLAB_NOTEBOOK_SMALL": "1", "QUANTLAB_NOTEBOOK_RUNS": str(self.root / "notebooks")}
        client = nbclient.NotebookClient(nb, timeout=1800, kernel_name="python3",
                                         resources={"metadata": {"path": str(REPO / "notebooks")}})
        return client.execute(env=env)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
