"""Model sources: turn the recipe's `model.id` into a loaded float model and tokenizer.

Forms of `model.id`, tried in this order:
  * a built-in alias (`quantlab models` lists them),
  * `modelscope:<org>/<name>` (needs the `modelscope` extra),
  * an existing local directory (Hugging Face layout) or `.gguf` file,
  * a Hugging Face hub id, optionally with `revision`, read from the local HF cache when the
    hub is unreachable (`HF_HUB_OFFLINE=1`, or one probe of the hub failing within seconds:
    `hub_unreachable`); not in the cache either, it is refused before the run starts.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from quantlab.errors import UserError
from quantlab.file_checks import check_gguf, check_safetensors
from quantlab.models.builtin import BUILTIN_MODELS, cached_float_checkpoint, float_checkpoint, float_checkpoint_dir
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
    offline: bool = False  # a hub model read from the local cache only: the hub is unreachable

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "location": self.location, "gguf_file": self.gguf_file,
                "revision": self.revision}


def looks_local(model_id: str) -> bool:
    return model_id.startswith((".", "/", "~")) or model_id.endswith(".gguf") or Path(model_id).exists()


def is_hub_id(spec: ModelSpec) -> bool:
    """A Hugging Face hub id: not a built-in alias, a `modelscope:` id or a local path."""
    return not (spec.id in BUILTIN_MODELS or spec.id.startswith("modelscope:") or looks_local(spec.id))


def config_on_disk(spec: ModelSpec, model_dir: Path | None = None) -> Path | None:
    """The model's config.json where it is on disk without a download: in `model_dir` (the
    resolved model), a local checkpoint directory, a built-in model's float copy, or, for a hub
    id, the Hugging Face cache; None otherwise (a GGUF carries none)."""
    if model_dir is not None and model_dir.exists():
        path = model_dir
    elif spec.id in BUILTIN_MODELS:
        path = float_checkpoint_dir(spec.id)
    else:
        path = Path(spec.id).expanduser()
    if (path / "config.json").is_file():
        return path / "config.json"
    if is_hub_id(spec) and not spec.gguf_file and not path.exists():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(spec.id, "config.json", revision=spec.revision)
        return Path(cached) if isinstance(cached, str) else None
    return None


def check_model_id(spec: ModelSpec) -> None:
    """Cheap checks done before a run directory exists (no downloads, no loading)."""
    if spec.id.startswith("modelscope:"):
        require_modelscope("model.id")
    if spec.id in BUILTIN_MODELS or spec.id.startswith("modelscope:"):
        return
    if looks_local(spec.id):
        _check_local(spec)
    else:
        _check_hub_id(spec)


def _check_local(spec: ModelSpec) -> None:
    """A local `model.id`: an existing checkpoint directory (config.json and safetensors, or a
    `model.gguf_file` in it) or a valid .gguf file."""
    path = Path(spec.id).expanduser()
    if not path.exists():
        raise UserError(f"model.id: local path {spec.id!r} does not exist; give an existing "
                        f"directory or .gguf file, a hub id, or one of: {', '.join(BUILTIN_MODELS)}")
    if not path.is_dir() and (not path.is_file() or path.suffix != ".gguf"):
        kind = "a file" if path.is_file() else "a device or special file"
        raise UserError(f"model.id: {spec.id!r} is {kind}, not a checkpoint directory or a .gguf file")
    if path.is_dir() and spec.gguf_file and not spec.gguf_file.endswith(".gguf"):
        raise UserError(f"model.gguf_file: {spec.gguf_file!r} is not a .gguf file; name a .gguf file in "
                        f"{spec.id!r}, or leave model.gguf_file out for a Hugging Face checkpoint directory")
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
        _check_gguf_config(gguf)
    elif path.is_dir():
        for shard in sorted(path.glob("*.safetensors")):
            check_safetensors(shard)  # headers only: a crafted or truncated shard fails here, not mid-run


def _check_gguf_config(gguf: Path) -> None:
    """The model config transformers derives from a GGUF's metadata, built without reading a
    tensor: inconsistent hyperparameters (a hidden size no multiple of the head count) fail
    here in one line instead of after calibration."""
    from transformers import AutoConfig

    try:
        with _quiet_transformers():
            AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # transformers raises ValueError, KeyError, … for metadata it cannot map
        raise UserError(f"model.id: {str(gguf)!r} declares a model transformers cannot build "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''})") from None


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
    offline = _check_hub_id(spec) is not None
    return ResolvedModel("hub", spec.id, spec.gguf_file, spec.revision, offline)


def _check_hub_id(spec: ModelSpec) -> str | None:
    """Refuse a hub id at once when the hub is unreachable and the cache lacks the model;
    returns why the hub is unreachable (the model is then read from the cache only), or None."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(spec.id)
    except HFValidationError:
        raise UserError(f"model.id: {spec.id!r} is neither an existing local path nor a hub id (org/name: "
                        f"letters, digits, '-', '_', '.'); give a checkpoint directory, a .gguf file, a hub id, "
                        f"or one of: {', '.join(BUILTIN_MODELS)}") from None
    why = hub_unreachable()
    if why and not in_hub_cache(spec):
        raise _not_available(spec, why)
    return why


PROBE_TIMEOUT_S = 3.0  # one request to the hub's endpoint; a hub that answers does so well within it


def hub_unreachable(endpoint: str | None = None) -> str | None:
    """Why the Hugging Face hub cannot be reached (HF_HUB_OFFLINE set, or one request to its
    endpoint failing within PROBE_TIMEOUT_S, no retries), or None when it answers. Without
    this, huggingface_hub retries an unreachable host with back-off (~47 s) before failing."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_HUB_OFFLINE is set"
    return _probe(endpoint or constants.ENDPOINT)


PROBE_MEMORY_S = 60.0  # how long a probe's outcome stands: preflight, resolve and each hub source ask
_PROBED: dict[str, tuple[float, str | None]] = {}  # endpoint → (when, why unreachable or None)


def _probe(endpoint: str) -> str | None:
    """One HEAD request to `endpoint` through huggingface_hub's session (its proxies and
    headers); any HTTP answer, even an error status, means reachable. The outcome stands for
    PROBE_MEMORY_S, so one run pays for at most one probe, while a long-lived process (a
    notebook) that comes online is asked again later."""
    from huggingface_hub.utils import get_session

    when, why = _PROBED.get(endpoint, (float("-inf"), None))
    if time.monotonic() - when < PROBE_MEMORY_S:
        return why
    try:
        get_session().head(endpoint, timeout=PROBE_TIMEOUT_S, follow_redirects=False)
        why = None
    except Exception as exc:  # connection refused, DNS failure, timeout, proxy error: all unreachable
        why = f"no answer from {endpoint} within {PROBE_TIMEOUT_S:g} s: {type(exc).__name__}"
    _PROBED[endpoint] = (time.monotonic(), why)
    return why


def in_hub_cache(spec: ModelSpec) -> bool:
    """Whether the local Hugging Face cache holds the hub model's config (or its GGUF file)."""
    from huggingface_hub import try_to_load_from_cache

    wanted = spec.gguf_file or "config.json"
    return isinstance(try_to_load_from_cache(spec.id, wanted, revision=spec.revision), str)


def require_modelscope(field: str) -> None:
    """`modelscope:` sources need the optional package: said in preflight, not mid-run."""
    import importlib.util

    if importlib.util.find_spec("modelscope") is None:
        raise UserError(f"{field}: modelscope: ids need the extra: pip install 'quantlab[modelscope]'")


def _modelscope_download(spec: ModelSpec) -> str:
    require_modelscope("model.id")
    from modelscope import snapshot_download

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
    if resolved.offline:
        kwargs["local_files_only"] = True
    try:
        model = AutoModelForCausalLM.from_pretrained(resolved.location, **kwargs)
    except OSError as exc:
        raise _unreachable(spec, resolved, exc) from None
    except ValueError as exc:  # a config or checkpoint transformers refuses (inconsistent sizes, …)
        raise UserError(f"model.id: {resolved.location!r} could not be built: "
                        f"{str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}") from None
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
                                      allow_patterns=["*.json", "*.safetensors"],
                                      local_files_only=resolved.offline))
    except Exception:  # unreachable hub and no cache: the eager loader says it in one line
        return None


def load_tokenizer(spec: ModelSpec, resolved: ResolvedModel) -> Any:
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = dict(trust_remote_code=spec.trust_remote_code)
    if resolved.gguf_file:
        kwargs["gguf_file"] = resolved.gguf_file
    if resolved.revision and resolved.kind == "hub":
        kwargs["revision"] = resolved.revision
    if resolved.offline:
        kwargs["local_files_only"] = True
    try:
        return AutoTokenizer.from_pretrained(resolved.location, **kwargs)
    except OSError as exc:
        raise _unreachable(spec, resolved, exc) from None


VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def local_tokenizer(spec: ModelSpec) -> Any | None:
    """The tokenizer of a model already on disk (a checkpoint directory, or a built-in alias
    whose float copy is made), for preflight's data checks; None where only a download, a GGUF
    parse or remote code would give it, or where it does not load (the run then says why)."""
    if spec.gguf_file or spec.trust_remote_code:
        return None
    if spec.id in BUILTIN_MODELS:
        directory = cached_float_checkpoint(spec.id)
    else:
        path = Path(spec.id).expanduser()
        directory = path if looks_local(spec.id) and (path / "config.json").is_file() else None
    if directory is None or not any((directory / name).is_file() for name in VOCABULARY_FILES):
        return None  # transformers would make an empty tokenizer: counts from it mean nothing
    try:
        with _quiet_transformers():
            return load_tokenizer(spec, ResolvedModel("local", str(directory), None, None))
    except Exception:  # a broken tokenizer: loading the model reports it
        return None


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' warnings held back: preflight prints one line or nothing."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)


def _unreachable(spec: ModelSpec, resolved: ResolvedModel, exc: OSError) -> UserError:
    if resolved.kind != "hub":
        return UserError(f"model.id: could not load {resolved.location!r}: {_local_reason(exc)}")
    return _not_available(spec)


def _local_reason(exc: OSError) -> str:
    """The loader's first line without its hub hints: for a local directory transformers
    still suggests "Checkout 'https://huggingface.co//the/local/path/tree/main'", a bogus URL."""
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    kept = [s for s in re.split(r"(?<=\.)\s+", first) if "huggingface.co" not in s]
    return " ".join(kept) or type(exc).__name__


def _not_available(spec: ModelSpec, offline: str | None = None) -> UserError:
    """A hub id found neither on the hub nor in the cache; `offline`: why the hub was not asked."""
    rev = f" at revision {spec.revision}" if spec.revision else ""
    tried = f"the hub is unreachable ({offline}) and the local cache does not hold it" if offline else \
        "tried hub and cache"
    return UserError(
        f"model.id: {spec.id!r}{rev} is neither a local path nor reachable on the Hugging Face hub "
        f"or in its local cache; {tried}. Offline? set model.id to a local checkpoint "
        f"directory or .gguf file (e.g. --set model.id=/path/to/model), or use a built-in alias: "
        f"{', '.join(BUILTIN_MODELS)}"
    )
