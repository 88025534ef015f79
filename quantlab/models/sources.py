"""Model sources: turn the recipe's `model.id` into a loaded float model and tokenizer.

Forms of `model.id`, tried in this order:
  * a built-in alias (`quantlab models` lists them),
  * `modelscope:<org>/<name>` (needs the `modelscope` extra),
  * an existing local directory (Hugging Face layout) or `.gguf` file,
  * a Hugging Face hub id, optionally with `revision`, read from the local HF cache when the
    hub is unreachable (`HF_HUB_OFFLINE=1`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantlab.errors import UserError
from quantlab.file_checks import check_gguf
from quantlab.models.builtin import BUILTIN_MODELS, float_checkpoint
from quantlab.models.moe import unfuse_experts
from quantlab.recipe import ModelSpec

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ResolvedModel:
    """Where the weights are, as from_pretrained wants it, plus what to record in the manifest."""

    kind: str  # builtin | modelscope | local | gguf | hub
    location: str  # a local directory, or the hub id
    gguf_file: str | None
    revision: str | None

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "location": self.location, "gguf_file": self.gguf_file,
                "revision": self.revision}


def looks_local(model_id: str) -> bool:
    return model_id.startswith((".", "/", "~")) or model_id.endswith(".gguf") or Path(model_id).exists()


def check_model_id(spec: ModelSpec) -> None:
    """Cheap checks done before a run directory exists (no downloads, no loading)."""
    if spec.id in BUILTIN_MODELS or spec.id.startswith("modelscope:"):
        return
    if looks_local(spec.id):
        path = Path(spec.id).expanduser()
        if path.is_file() and path.suffix != ".gguf":
            raise UserError(f"model.id: {spec.id!r} is a file, not a checkpoint directory or a .gguf file")
        if not path.exists():
            raise UserError(f"model.id: local path {spec.id!r} does not exist; give an existing "
                            f"directory or .gguf file, a hub id, or one of: {', '.join(BUILTIN_MODELS)}")
        if path.is_dir() and not (path / "config.json").is_file() and not spec.gguf_file:
            raise UserError(f"model.id: directory {spec.id!r} has no config.json (a Hugging Face "
                            f"checkpoint) and model.gguf_file is not set")
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES) if path.is_dir() else []
        if pickles and not spec.gguf_file and not spec.allow_pickle and not any(path.glob("*.safetensors")):
            raise UserError(f"model.id: {spec.id!r} holds no safetensors weights (only {', '.join(pickles[:3])}); "
                            "unpickling can run code: convert it to safetensors, or set model.allow_pickle: true "
                            "to read it with torch.load(weights_only=True)")
        gguf = path / spec.gguf_file if path.is_dir() and spec.gguf_file else path
        if gguf.suffix == ".gguf":
            if not gguf.is_file():
                raise UserError(f"model.gguf_file: {str(gguf)!r} is not a file")
            check_gguf(gguf)


def resolve(spec: ModelSpec) -> ResolvedModel:
    if spec.id in BUILTIN_MODELS:
        return ResolvedModel("builtin", str(float_checkpoint(spec.id)), None, BUILTIN_MODELS[spec.id].version)
    if spec.id.startswith("modelscope:"):
        return ResolvedModel("modelscope", _modelscope_download(spec), spec.gguf_file, spec.revision)
    path = Path(spec.id).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ResolvedModel("gguf", str(path.parent), path.name, None)
    if path.is_dir():
        return ResolvedModel("local", str(path), spec.gguf_file, None)
    return ResolvedModel("hub", spec.id, spec.gguf_file, spec.revision)


def _modelscope_download(spec: ModelSpec) -> str:
    try:
        from modelscope import snapshot_download
    except ImportError:
        raise UserError("model.id: modelscope ids need the extra: pip install 'quantlab[modelscope]'") from None
    repo = spec.id.removeprefix("modelscope:")
    try:
        return snapshot_download(repo, revision=spec.revision or "master")
    except Exception as exc:  # modelscope raises many types for network failures
        raise UserError(f"model.id: could not download {repo!r} from ModelScope ({type(exc).__name__}); "
                        "offline? download it elsewhere and set model.id to the local directory") from None


def load_model(spec: ModelSpec, resolved: ResolvedModel) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    kwargs = dict(dtype=DTYPES[spec.dtype], trust_remote_code=spec.trust_remote_code)
    if resolved.gguf_file:
        kwargs["gguf_file"] = resolved.gguf_file
    elif not spec.allow_pickle:
        kwargs["use_safetensors"] = True  # a hub repository with only pickle files fails to load
    if resolved.revision and resolved.kind == "hub":
        kwargs["revision"] = resolved.revision
    try:
        model = AutoModelForCausalLM.from_pretrained(resolved.location, **kwargs)
    except OSError as exc:
        raise _unreachable(spec, resolved, exc) from None
    if resolved.gguf_file:
        model.hf_quantizer = None  # dequantized on load: plain float from here on
    unfuse_experts(model)  # MoE: per-expert Linears to quantize (same function; no-op if dense)
    return model.eval()


def load_for_quantize(spec: ModelSpec, resolved: ResolvedModel) -> tuple[torch.nn.Module, Any]:
    """The model to quantize and where its decoder layers come from: a safetensors checkpoint
    is read lazily (`quantlab.models.lazy`: host memory holds one layer, not the model); the
    layer store is None when the model was loaded whole (GGUF, `.bin` checkpoints)."""
    from quantlab.models.lazy import lazy_model

    location = _local_snapshot(spec, resolved) if not resolved.gguf_file else None
    lazy = lazy_model(location, DTYPES[spec.dtype], spec.trust_remote_code) if location else None
    if lazy is None:
        return load_model(spec, resolved), None
    return lazy


def _local_snapshot(spec: ModelSpec, resolved: ResolvedModel) -> Path | None:
    """The checkpoint directory on disk: local kinds as resolved; a hub id's config and
    safetensors files fetched into (or found in) the Hugging Face cache."""
    if resolved.kind != "hub":
        return Path(resolved.location)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(resolved.location, revision=resolved.revision,
                                      allow_patterns=["*.json", "*.safetensors"]))
    except Exception:  # unreachable hub and no cache: the eager loader says it in one line
        return None


def load_tokenizer(spec: ModelSpec, resolved: ResolvedModel) -> Any:
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = dict(trust_remote_code=spec.trust_remote_code)
    if resolved.gguf_file:
        kwargs["gguf_file"] = resolved.gguf_file
    if resolved.revision and resolved.kind == "hub":
        kwargs["revision"] = resolved.revision
    try:
        return AutoTokenizer.from_pretrained(resolved.location, **kwargs)
    except OSError as exc:
        raise _unreachable(spec, resolved, exc) from None


def _unreachable(spec: ModelSpec, resolved: ResolvedModel, exc: OSError) -> UserError:
    if resolved.kind != "hub":
        return UserError(f"model.id: could not load {resolved.location!r}: {str(exc).splitlines()[0]}")
    rev = f" at revision {spec.revision}" if spec.revision else ""
    return UserError(
        f"model.id: {spec.id!r}{rev} is neither a local path nor reachable on the Hugging Face hub "
        f"or in its local cache; tried hub and cache. Offline? set model.id to a local checkpoint "
        f"directory or .gguf file (e.g. --set model.id=/path/to/model), or use a built-in alias: "
        f"{', '.join(BUILTIN_MODELS)}"
    )
