"""Score an export with the engine users deploy it with, on token windows the caller gives
(benchmarks/export_engines.py gives those a run's own evaluation scored, so the engine's
perplexity compares with quantlab's fake-quant perplexity of the same run number for number).

Each engine runs in its own environment (quantlab.toolenv) through a standalone script in
`quantlab/export/engines/`: AWQ through transformers with gptqmodel installed, GPTQ through
`GPTQModel.load`, compressed-tensors through transformers in this interpreter, GGUF through
llama-cpp-python.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quantlab.file_checks import read_json_object
from quantlab import toolenv
from quantlab.export.api import detect
from quantlab.toolenv import ToolEnv, run_script


@dataclass(frozen=True)
class Engine:
    env: ToolEnv | None  # None: this interpreter (its dependencies already hold the loader)
    script: str
    args: tuple[str, ...] = ()


ENGINES = {
    "awq": Engine(toolenv.GPTQMODEL, "hf_nll.py", ("--loader", "transformers", "--dtype", "float16")),
    # transformers builds MoE experts fused and loads no AWQ experts into them: gptqmodel's own
    # loader keeps them per expert (its MoE layout, `mlp.experts.{e}.gate_proj`)
    "awq-moe": Engine(toolenv.GPTQMODEL, "hf_nll.py", ("--loader", "gptqmodel", "--dtype", "float16")),
    "gptq": Engine(toolenv.GPTQMODEL, "hf_nll.py", ("--loader", "gptqmodel", "--dtype", "float16")),
    "compressed-tensors": Engine(None, "hf_nll.py", ("--loader", "transformers", "--dtype", "float32")),
    "gguf": Engine(toolenv.LLAMA_CPP, "gguf_nll.py"),
}


def _is_moe(export: Path) -> bool:
    from quantlab.models.arch import n_experts

    return n_experts(read_json_object(export / "config.json")) > 0


def python_for(engine: Engine, build: bool = True) -> Path | None:
    if engine.env is None:
        return Path(sys.executable)
    return toolenv.ensure(engine.env) if build else toolenv.python_of(engine.env)


def score(export: Path, windows: torch.Tensor, build: bool = True, logits: bool = False,
          backend: str | None = None) -> dict[str, Any]:
    """The engine's NLL and perplexity of `windows` under `export` (a directory or .gguf);
    with `logits`, also every window's logits (`result["logits"]`, every engine);
    `backend` picks a gptqmodel kernel (BACKEND member name)."""
    family = detect(export)
    engine = ENGINES[f"{family}-moe" if family == "awq" and _is_moe(export) else family]
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
        result = run_script(python, engine.script, args, out)
        if logits:
            result["logits"] = torch.from_numpy(np.load(Path(tmp) / "logits.npy"))
    return {"format": family, **result}
