"""Which export formats a recipe can deliver, decided before anything is quantized.

The exporters' own checks (`quantlab.export.api.check_exportable`) run on a *planned* canonical
form: the Linears the model config implies, each with the scheme of the last weight stage that
does not ignore it, codes as meta tensors (shapes, no data), g_idx permuted where a GPTQ stage
orders columns, and the activation / KV-cache schemes of the act_ranges stage. So a recipe that
lists a format it cannot produce is refused by `quantlab validate` and at the start of
`quantlab run` with the exporter's own one-line reason, instead of after quantizing; the same
function tells the export matrix (benchmarks/export_matrix.py) which formats a recipe allows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from quantlab.file_checks import read_json_object
from quantlab.engine.sequential import is_ignored
from quantlab.errors import UserError
from quantlab.export.api import check_exportable
from quantlab.export.source import Canonical, linear_shapes
from quantlab.formats import FORMATS, keeps_folded_weights
from quantlab.models.arch import ARCH_SPECS, MOE_ARCH_SPECS
from quantlab.models.sources import config_on_disk, is_hub_id
from quantlab.quant.primitives import QuantizedWeight, default_g_idx
from quantlab.quant.scheme import WeightScheme
from quantlab.recipe import WEIGHT_KINDS, Recipe


def refusal(src: Canonical, fmt: str) -> str | None:
    """The exporter's reason for refusing `fmt` for `src`, or None when it takes it."""
    try:
        check_exportable(src, fmt)
    except UserError as exc:
        return str(exc)
    return None


def allowed_formats(recipe: Recipe, config: dict[str, Any], model_dir: Path) -> dict[str, str | None]:
    """Every export format → None (allowed) or the reason it is refused for this recipe."""
    src = planned_canonical(recipe, config, model_dir)
    return {fmt: refusal(src, fmt) for fmt in FORMATS}


# GGUF `general.architecture` names that differ from the transformers model_type
GGUF_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}


def declared_architecture(recipe: Recipe, model_dir: Path | None = None) -> str | None:
    """The model_type the recipe's model declares, read from its config.json or GGUF header
    without loading any weights (a hub model's from the local cache); None where only a
    download would tell."""
    spec = recipe.model
    path = model_dir if model_dir is not None and model_dir.exists() else Path(spec.id).expanduser()
    gguf_path = path / spec.gguf_file if spec.gguf_file and path.is_dir() else path
    if gguf_path.is_file() and gguf_path.suffix == ".gguf":
        from gguf import GGUFReader

        from quantlab.file_checks import check_gguf

        check_gguf(gguf_path)
        field = GGUFReader(gguf_path).get_field("general.architecture")
        arch = field.contents() if field is not None else None
        return GGUF_MODEL_TYPES.get(arch, arch)
    config = config_on_disk(spec, model_dir)
    return read_json_object(config).get("model_type") if config is not None else None


def check_architecture(recipe: Recipe, model_dir: Path | None = None) -> None:
    """Refuse a model whose architecture has no ArchSpec, before its weights are read."""
    model_type = declared_architecture(recipe, model_dir)
    supported = sorted({**ARCH_SPECS, **MOE_ARCH_SPECS})
    if model_type is not None and model_type not in supported:
        raise UserError(f"model: architecture {model_type!r} of {recipe.model.id} is not supported yet; "
                        f"supported: {', '.join(supported)}")


def admit(recipe: Recipe, model_dir: Path | None = None) -> None:
    """Refuse a model of an unsupported architecture, then the recipe's first `export:` entry
    that its run could not be exported to. `model_dir`: the resolved model (a run passes it once
    the model is on disk); without it the model's config is looked up without downloading
    anything, and the checks are skipped for a model that is not on disk yet."""
    check_architecture(recipe, model_dir)
    located = model_config(recipe, model_dir)
    if located is None:
        return
    check_group_sizes(recipe, located[0])
    if not recipe.export:
        return
    src = planned_canonical(recipe, *located)
    for i, fmt in enumerate(recipe.export):
        why = refusal(src, fmt)
        if why:
            raise UserError(f"export[{i}]: {why}")


def model_config(recipe: Recipe, model_dir: Path | None = None) -> tuple[dict[str, Any], Path] | None:
    """The model's config.json and directory where they are on disk (a built-in model's float
    copy once made); None for a model that only a download would reveal."""
    config_file = config_on_disk(recipe.model, model_dir)
    if config_file is None and model_dir is not None and is_hub_id(recipe.model):
        config_file = _download_config(recipe)
    if config_file is None:
        return None
    config = read_json_object(config_file)
    return (config, config_file.parent) if config.get("model_type") in ARCH_SPECS else None


def _download_config(recipe: Recipe) -> Path | None:
    """A hub model's config.json fetched by a run (which downloads the model anyway), so the
    model-dependent checks run before calibration. None where it cannot be had: the model
    loader then says why in one line."""
    from huggingface_hub import hf_hub_download

    from quantlab.models.sources import hub_unreachable

    spec = recipe.model
    if hub_unreachable():  # offline: huggingface_hub would retry for ~47 s
        return None
    try:
        return Path(hf_hub_download(spec.id, "config.json", revision=spec.revision))
    except Exception:  # offline, no such repository, no config.json: not this check's to say
        return None


def check_group_sizes(recipe: Recipe, config: dict[str, Any]) -> None:
    """Refuse a weight stage whose group_size exceeds the input width of a Linear it quantizes.
    A group size that does not divide the width is fine (the last group is shorter, the GPTQ
    `g_idx = i // G` convention), but a group wider than the whole row is no group at all:
    `primitives.grouped` would pad it with copies of the last column, and the exporters would
    write a group_size the engines reject. So the bound is the narrowest quantized input."""
    try:
        linears = planned_linears(recipe, config)
    except (KeyError, TypeError, ValueError):
        return  # a config without the sizes: loading the model says what is wrong with it
    for i, entry in enumerate(recipe.stages):
        if entry.kind not in WEIGHT_KINDS or entry.config.weights.group_size is None:
            continue
        widths = {name: shape[1] for name, shape in linears.items() if _quantizes(entry.config, name)}
        narrowest = min(widths, key=widths.__getitem__, default=None)
        group = entry.config.weights.group_size
        if narrowest is not None and group > widths[narrowest]:
            width = widths[narrowest]
            raise UserError(f"stages.{i}.{entry.kind}.weights.group_size: {group} exceeds the input width {width} "
                            f"of {narrowest}; give a power of two of at most {width} "
                            f"(e.g. {1 << (width.bit_length() - 1)}) or null (per-channel)")


def _quantizes(stage: Any, name: str) -> bool:
    """Whether the weight stage `stage` quantizes the Linear `name` (the head only when asked)."""
    if name == "lm_head" and not getattr(stage, "lm_head", False):
        return False
    return not is_ignored(name, stage.ignore)


def planned_linears(recipe: Recipe, config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """`[out, in]` of every Linear the recipe's weight stages may quantize, from the config."""
    spec = ARCH_SPECS[config["model_type"]]
    shapes = linear_shapes(config, spec)
    names = {f"{spec.layers}.{i}.{lin}": shapes[lin]
             for i in range(int(config["num_hidden_layers"])) for lin in spec.linears}
    if _head_stage(recipe):
        names["lm_head"] = (int(config["vocab_size"]), int(config["hidden_size"]))
    return names


def planned_canonical(recipe: Recipe, config: dict[str, Any], model_dir: Path) -> Canonical:
    """The canonical form the recipe's run will write, as shapes and schemes (module docstring)."""
    names = planned_linears(recipe, config)
    quantized: dict[str, QuantizedWeight] = {}
    for entry in recipe.stages:
        if entry.kind not in WEIGHT_KINDS:
            continue
        stage = entry.config
        act_order = entry.kind == "gptq" and stage.act_order and not stage.static_groups
        for name, shape in names.items():
            if _quantizes(stage, name):
                quantized[name] = _planned_weight(shape, stage.weights, act_order)
    planned = Canonical(model_dir, config, _planned_quant_config(recipe, names), {}, quantized)
    # the float weights before rounding, which the quantize stage keeps for a listed K-quant
    planned.__dict__["folded"] = ({name: qw.codes for name, qw in quantized.items()}
                                  if keeps_folded_weights(recipe.export) else {})
    return planned


def _head_stage(recipe: Recipe) -> bool:
    return any(getattr(e.config, "lm_head", False) for e in recipe.stages)


def _planned_weight(shape: tuple[int, int], scheme: WeightScheme, act_order: bool) -> QuantizedWeight:
    out_f, in_f = shape
    groups = 1 if scheme.group_size is None or scheme.per_tensor else -(-in_f // scheme.group_size)
    g_idx = default_g_idx(in_f, scheme.group_size)
    if act_order and scheme.group_size is not None:
        g_idx = g_idx.flip(0)  # any non-contiguous order: what the exporters test for
    meta = {"device": "meta"}
    return QuantizedWeight(codes=torch.empty(out_f, in_f, dtype=torch.uint8, **meta),
                           scales=torch.empty(out_f, groups, **meta),
                           zeros=torch.empty(out_f, groups, dtype=torch.uint8, **meta), g_idx=g_idx, scheme=scheme)


def _planned_quant_config(recipe: Recipe, names: dict[str, tuple[int, int]]) -> dict[str, Any]:
    ranges = next((e.config for e in reversed(recipe.stages) if e.kind == "act_ranges"), None)
    out: dict[str, Any] = {"stages": [e.dump() for e in recipe.stages], "source_model": recipe.model.id}
    if ranges is None:
        return out
    if ranges.activations is not None:
        mods = [n for n in names if n != "lm_head" and not is_ignored(n, ranges.ignore)]
        out["activations"] = {**ranges.activations.model_dump(), "modules": mods}
    if ranges.kv_cache is not None:
        layers = sorted({n.rsplit(".", 2)[0] for n in names if n != "lm_head"})
        out["kv_cache"] = {**ranges.kv_cache.model_dump(), "modules": [f"{layer}.self_attn" for layer in layers]}
    return out
