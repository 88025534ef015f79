"""Virtualenvs of third-party tools: the peer quantizers we benchmark against and the engines
that load our exports (gptqmodel, llama-cpp-python).

Each tool gets its own environment because its pins conflict with ours (llm-compressor pins
transformers<=5.17, gptqmodel pins numpy 2.2.6) and some build from source (minutes). An
environment is built once per spec and reused; a marker file records the spec it was built
for, so a changed pin rebuilds it. Torch, when the tool needs it, is installed first and
pinned to the CPU build, so no dependency can pull a CUDA torch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

TORCH_PIN = "torch==2.13.0"  # the CPU build on this index; an unpinned torch pulls GBs of CUDA wheels
MARKER = "quantlab-toolenv.json"


@dataclass(frozen=True)
class ToolEnv:
    name: str
    packages: tuple[str, ...]
    pip_args: tuple[str, ...] = ()
    build_env: tuple[tuple[str, str], ...] = ()
    torch: str | None = TORCH_PIN

    def spec(self) -> dict[str, Any]:
        return {"torch": self.torch, "packages": list(self.packages), "pip_args": list(self.pip_args),
                "build_env": dict(self.build_env)}


# gptqmodel 7.6.0 is the last release that accepts torch 2.13; without BUILD_CUDA_EXT=0 it tries to
# compile CUDA kernels, and its build imports torch, hence no build isolation.
GPTQMODEL = ToolEnv("gptqmodel", ("gptqmodel==7.6.0",), pip_args=("--no-build-isolation",),
                    build_env=(("BUILD_CUDA_EXT", "0"),))
# llama.cpp compiled for this CPU, without the multimodal library (not needed to score text) and
# without AMX: -march=native turns it on where the CPU reports AMX, and ggml's AMX matmul then
# segfaults in sandboxes that do not grant the AMX tile state (seen here on Xeon, 0.3.36).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_CPP = ToolEnv("llama-cpp", ("llama-cpp-python==0.3.36",), torch=None,
                    build_env=(("CMAKE_ARGS", f"-DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS='{NO_AMX}' -DCMAKE_CXX_FLAGS='{NO_AMX}'"),
                               ("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))))


def default_root() -> Path:
    if env := os.environ.get("QUANTLAB_TOOL_ENVS"):
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("quantlab")) / "tool-envs"


def python_of(tool: ToolEnv, root: Path | None = None) -> Path | None:
    """The tool's interpreter if its environment is built for the current spec, else None."""
    venv = (root or default_root()) / tool.name
    marker = venv / MARKER
    python = venv / "bin" / "python"
    if python.exists() and marker.is_file() and json.loads(marker.read_text()).get("spec") == tool.spec():
        return python
    return None


def ensure(tool: ToolEnv, root: Path | None = None, log: Path | None = None) -> Path:
    """The tool's interpreter, building its environment on first use. A lock serializes
    concurrent builders; an environment built by hand with the pinned versions is adopted."""
    root = root or default_root()
    root.mkdir(parents=True, exist_ok=True)
    log = log or root / f"{tool.name}-install.log"
    with FileLock(root / f"{tool.name}.lock"):
        if python := python_of(tool, root):
            return python
        venv = root / tool.name
        python = venv / "bin" / "python"
        if python.exists() and installed_matches(python, tool):
            write_marker(python, tool, None)
            return python
        build(tool, root, log)
        return python


def installed_matches(python: Path, tool: ToolEnv) -> bool:
    """Whether the environment holds every pinned package at its version (and a CPU torch)."""
    pins = [*([tool.torch] if tool.torch else []), *tool.packages]
    code = ("import sys; from importlib.metadata import version\n"
            "ok = all(version(n) == v or version(n).split('+')[0] == v for n, v in (p.split('==') for p in sys.argv[1:]))\n"
            + ("import torch; ok = ok and torch.version.cuda is None\n" if tool.torch else "") + "print(ok)")
    check = subprocess.run([str(python), "-c", code, *pins], capture_output=True, text=True)
    return check.returncode == 0 and check.stdout.strip() == "True"


def write_marker(python: Path, tool: ToolEnv, seconds: float | None) -> None:
    freeze = subprocess.run([str(python), "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    (python.parent.parent / MARKER).write_text(json.dumps({"spec": tool.spec(), "install_seconds": seconds,
                                                          "freeze": freeze.splitlines()}, indent=2) + "\n")


def build(tool: ToolEnv, root: Path, log: Path) -> None:
    venv = root / tool.name
    python = venv / "bin" / "python"
    print(f"building the {tool.name} environment in {venv} (minutes; log {log})", file=sys.stderr, flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    constraints = root / f"constraints-{tool.name}.txt"
    constraints.write_text((tool.torch or "") + "\n")
    env = {**os.environ, **dict(tool.build_env), "PIP_CONSTRAINT": str(constraints)}
    start = time.perf_counter()
    commands = [[getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)],
                [str(python), "-m", "pip", "install", "--upgrade", "pip", "setuptools", "wheel"]]
    if tool.torch:  # first, so nothing else picks a CUDA torch
        commands.append([str(python), "-m", "pip", "install", tool.torch])
    commands.append([str(python), "-m", "pip", "install", "-c", str(constraints), *tool.pip_args, *tool.packages])
    with log.open("a") as fh:
        for cmd in commands:
            fh.write(f"$ {' '.join(cmd)}\n")
            fh.flush()
            if subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode != 0:
                raise RuntimeError(f"{tool.name}: `{' '.join(cmd[2:])}` failed; see {log}")
    if not installed_matches(python, tool):
        raise RuntimeError(f"{tool.name}: the environment lacks a pinned package or has a CUDA torch; see {log}")
    write_marker(python, tool, round(time.perf_counter() - start, 1))


# Standalone scripts run in an engine's environment: ids or a file in, a JSON result out.
ENGINE_SCRIPTS = Path(__file__).parent / "export" / "engines"


def run_script(python: Path, script: str, args: list[str], out: Path) -> dict[str, Any]:
    """Run `ENGINE_SCRIPTS/script` under `python` and read the JSON it writes to `out`."""
    proc = subprocess.run([str(python), str(ENGINE_SCRIPTS / script), *args], capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{script} {' '.join(args[:1])} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def llama_quantize(src: Path, dst: Path, qtype: str) -> dict[str, Any]:
    """llama.cpp's own quantizer (`llama-quantize`) applied to a GGUF file: the baseline a user
    gets from a float GGUF without quantlab, and the writer of the GGUF K-quants."""
    python = ensure(LLAMA_CPP)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        return run_script(python, "gguf_nll.py", ["quantize", str(src), str(dst), qtype, "--out", str(out)], out)


def main(argv: list[str] | None = None) -> int:
    """`python -m quantlab.toolenv gptqmodel llama-cpp`: build (or confirm) environments up
    front, e.g. in CI before the tests that need them."""
    tools = {t.name: t for t in (GPTQMODEL, LLAMA_CPP)}
    names = argv if argv is not None else sys.argv[1:]
    unknown = [n for n in names if n not in tools]
    if unknown or not names:
        print(f"usage: python -m quantlab.toolenv {{{','.join(tools)}}} ...", file=sys.stderr)
        return 2
    for name in names:
        start = time.perf_counter()
        python = ensure(tools[name])
        print(f"{name}: {python} ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
