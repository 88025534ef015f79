"""Export a canonical directory to one format, detect an export's format, and inspect it."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect as _inspect
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

from quantlab.errors import UserError
from quantlab.export.checks import Report
from quantlab.export.registry import family_modules, module_for
from quantlab.export.source import Canonical, load_source, read_sidecar
from quantlab.formats import ENGINES, FORMATS, HEAD_FORMATS, family_of
from quantlab.rundir import atomic_path


def export(canonical: Path, out: Path, fmt: str, max_shard_bytes: int | None = None) -> Report:
    """Write `out` atomically, then validate it before it replaces anything: an export that
    fails its own format's rules is a quantlab bug and never lands."""
    src = load_source(canonical)
    module, options = check_exportable(src, fmt)
    if max_shard_bytes is not None and fmt in ("awq", "gptq", "compressed-tensors", "paddlenlp"):
        options["max_shard_bytes"] = max_shard_bytes
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        module.write(src, tmp, out, **options)
        extra = {"source": src} if "source" in _inspect.signature(module.validate).parameters else {}
        report = module.validate(tmp, **extra)
        report.path = str(out)
        report.raise_if_invalid()
    report.facts["engine"] = engine_note(family_of(fmt))
    return report


def engine_note(family: str) -> str:
    """What loads the family, and whether its package is installed in this environment."""
    loader, (module, pip_name) = ENGINES[family]
    if importlib.util.find_spec(module) is not None:
        return loader
    return f"{loader}; not installed here: pip install {pip_name}"


def check_exportable(src: Canonical, fmt: str) -> tuple[ModuleType, dict[str, Any]]:
    """Raise the one-line reason `fmt` cannot hold `src` (a run's canonical form, or the planned
    one quantlab.admission builds from a recipe); returns the format's module and options."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: unknown; formats: {', '.join(FORMATS)}")
    module, options = module_for(fmt)
    if src.head_quantized and fmt not in HEAD_FORMATS:
        raise UserError(f"{fmt}: this run quantized lm_head, which {fmt} keeps in float; export as "
                        f"{', '.join(HEAD_FORMATS)}, or quantize without lm_head")
    if not getattr(module, "CARRIES_ACTIVATIONS", False):  # the others check what they can carry
        src.require_weight_only(fmt)
    module.check_exportable(src, **options)
    return module, options


@contextlib.contextmanager
def malformed_configs(path: Path) -> Iterator[None]:
    """An export's JSON of the right syntax but the wrong shape (a `quantization_config` that is
    a string, a config.json that is a list) makes the family readers index into the wrong
    type: one line naming the export instead of their AttributeError or TypeError."""
    try:
        yield
    except (AttributeError, TypeError, KeyError, IndexError) as exc:
        raise UserError(f"{path}: a config file of this export does not have the layout its format "
                        f"defines ({type(exc).__name__}: {str(exc)[:80]}); the export is damaged") from None


def detect(path: Path) -> str:
    """The export family of a directory (or .gguf file), or 'canonical'."""
    if not path.exists():
        raise UserError(f"{path}: no such file or directory")
    side = read_sidecar(path) if path.is_dir() else None
    if side and str(side.get("format", "")).startswith("gguf"):
        return "gguf"
    if path.is_dir() and (path / "quant_config.json").is_file():
        return "canonical"
    for name, module in family_modules().items():
        with malformed_configs(path):
            if module.matches(path):
                return name
    raise UserError(f"{path}: not a recognised export (looked for a .gguf file, rank0.safetensors, or a "
                    "config.json quantization_config with quant_method awq, gptq or compressed-tensors, or a "
                    "PaddleNLP quant_type)")


def inspect(path: Path) -> Report:
    family = detect(path)
    if family == "canonical":
        return _inspect_canonical(path)
    with malformed_configs(path):
        report = family_modules()[family].validate(path)
    report.facts["engine"] = engine_note(family)
    side = read_sidecar(path) if path.is_dir() else None
    if side:
        report.facts.setdefault("exported from", side.get("source"))
    return report


def _inspect_canonical(path: Path) -> Report:
    src = load_source(path)
    report = Report("quantlab canonical", str(path))
    schemes = sorted({q.scheme.name for q in src.quantized.values()})
    report.facts.update({"model_type": src.model_type, "quantized Linears": len(src.quantized),
                         "schemes": ", ".join(schemes), "act_order": src.act_order})
    for name, qw in src.quantized.items():
        report.check("codes in range", name, int(qw.codes.max()) <= qw.scheme.qmax, "code above 2^bits - 1")
    return report
