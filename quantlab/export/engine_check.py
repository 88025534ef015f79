"""Score an export with the engine users deploy it with, on the very token windows a run's own
evaluation scored, so the engine's perplexity compares with quantlab's fake-quant perplexity
of the same run number for number.

Each engine runs in its own environment (quantlab.toolenv) through a standalone script in
`quantlab/export/engines/`: AWQ through transformers with gptqmodel installed, GPTQ through
`GPTQModel.load`, compressed-tensors through transformers in this interpreter, GGUF through
llama-cpp-python.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quantlab import toolenv
from quantlab.export.api import detect
from quantlab.toolenv import ToolEnv

SCRIPTS = Path(__file__).parent / "engines"


@dataclass(frozen=True)
class Engine:
    env: ToolEnv | None  # None: this interpreter (its dependencies already hold the loader)
    script: str
    args: tuple[str, ...] = ()


ENGINES = {
    "awq": Engine(toolenv.GPTQMODEL, "hf_nll.py", ("--loader", "transformers", "--dtype", "float16")),
    "gptq": Engine(toolenv.GPTQMODEL, "hf_nll.py", ("--loader", "gptqmodel", "--dtype", "float16")),
    "compressed-tensors": Engine(None, "hf_nll.py", ("--loader", "transformers", "--dtype", "float32")),
    "gguf": Engine(toolenv.LLAMA_CPP, "gguf_nll.py"),
}


def eval_windows(run_dir: Path) -> torch.Tensor:
    """The `[windows, seq_len]` ids the run's perplexity stages scored."""
    from transformers import AutoTokenizer

    from quantlab.data.sampling import tokenize_joined
    from quantlab.data.sources import load_documents
    from quantlab.eval.perplexity import windows_of
    from quantlab.recipe import load_recipe
    from quantlab.stages import QUANTIZED

    recipe = load_recipe(run_dir / "recipe.resolved.yaml")
    ppl = recipe.evaluate.perplexity
    if ppl is None:
        raise ValueError(f"{run_dir}: the recipe has no evaluate.perplexity section")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / QUANTIZED)
    docs = load_documents(ppl.dataset, "evaluate.perplexity.dataset", tokenizer)
    return windows_of(tokenize_joined(docs, tokenizer), ppl.seq_len, ppl.max_windows)


def python_for(engine: Engine, build: bool = True) -> Path | None:
    if engine.env is None:
        return Path(sys.executable)
    return toolenv.ensure(engine.env) if build else toolenv.python_of(engine.env)


def _run(python: Path, script: str, args: list[str], out: Path) -> dict[str, Any]:
    proc = subprocess.run([str(python), str(SCRIPTS / script), *args], capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{script} {' '.join(args[:1])} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def score(export: Path, windows: torch.Tensor, build: bool = True, logits: bool = False,
          backend: str | None = None) -> dict[str, Any]:
    """The engine's NLL and perplexity of `windows` under `export` (a directory or .gguf);
    with `logits`, also every window's logits (`result["logits"]`, HF engines only);
    `backend` picks a gptqmodel kernel (BACKEND member name)."""
    family = detect(export)
    engine = ENGINES[family]
    python = python_for(engine, build)
    if python is None:
        raise RuntimeError(f"{family}: the {engine.env.name} environment is not built")  # type: ignore[union-attr]
    target = export
    if family == "gguf":
        from quantlab.export.gguf_file import gguf_path

        target = gguf_path(export)
    with tempfile.TemporaryDirectory() as tmp:
        ids, out = Path(tmp) / "windows.npy", Path(tmp) / "result.json"
        np.save(ids, windows.numpy().astype(np.int64))
        args = [str(target), str(ids), str(out), *engine.args]
        if family == "gguf":
            args.insert(0, "score")
        if backend:
            args += ["--backend", backend]
        if logits:
            args += ["--logits", str(Path(tmp) / "logits.npy")]
        result = _run(python, engine.script, args, out)
        if logits:
            result["logits"] = torch.from_numpy(np.load(Path(tmp) / "logits.npy"))
    return {"format": family, **result}


def llama_quantize(src: Path, dst: Path, qtype: str) -> dict[str, Any]:
    """llama.cpp's own quantizer (`llama-quantize`) applied to a GGUF file: the baseline a user
    gets from a float GGUF without quantlab."""
    python = toolenv.ensure(toolenv.LLAMA_CPP)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        return _run(python, "gguf_nll.py", ["quantize", str(src), str(dst), qtype, "--out", str(out)], out)
