"""PaddleNLP-style scale tables: `weight_scales.json`, `act_scales.json`, `cachekv_scales.json`.

PaddleNLP's PTQ (`llm/utils/quant.py`) writes one JSON dict per kind, keyed by the quantized
sublayer's name under the Paddle model's prefix, and its inference models read them back
through `ActScalesLoader`, `WeightScalesLoader` / `PerTensorWeightScalesLoader` and
`CacheScaleLoader` (`paddlenlp/experimental/model_utils.py`). Every value is an **absmax**:
  * `act_scales.json`: `{prefix}.layers.N.self_attn.q_proj.activation_quanter` → one float
    (the loader takes `1/value`; the kernel's int8 step is value/127);
  * `weight_scales.json`: `{prefix}.layers.N.self_attn.q_proj.weight_quanter` → a list with
    one entry per output channel (int8: weight stored as `round(127·w/value)`), or one float
    for a per-tensor FP8 weight (`w·448/value` in e4m3);
  * `cachekv_scales.json`: `{prefix}.layers.N.self_attn.cachek_matmul.activation_quanter`
    (and `cachev_matmul`) → a list of `num_attention_heads` entries even under GQA: the loader
    reads entry `j` for KV head `j // (heads/kv_heads)` by striding over the list, so each KV
    head's absmax is repeated for the query heads sharing it.
`prefix` is the Paddle model's `base_model_prefix`: `llama`, `qwen2`. Our SmoothQuant folds
every scale into weights and norms, so no shift/smooth helper layers exist and keys never get
the `.layer.` infix that PaddleSlim's shift_smooth_all_linears wrappers add.

Values reproduce quantlab's canonical dequantization exactly: our symmetric int8 codes are
`(q − 128)·s`, so the listed absmax is `127·s` and `round(127·w/(127·s))` is `q − 128`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from quantlab.file_checks import read_json_object
from quantlab.quant.activations import FP8_MAX
from quantlab.quant.canonical import input_absmax_key, kv_absmax_keys
from quantlab.quant.primitives import QuantizedWeight

PADDLE_PREFIX = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}
FILES = ("weight_scales.json", "act_scales.json", "cachekv_scales.json")


def paddle_name(name: str, model_type: str) -> str:
    """`model.layers.3.self_attn.q_proj` → `llama.layers.3.self_attn.q_proj`; the head keeps
    its name (`lm_head`, a top-level module in PaddleNLP too)."""
    if name == "lm_head":
        return name
    prefix = PADDLE_PREFIX.get(model_type, model_type)
    return f"{prefix}.{name.removeprefix('model.')}"


def weight_absmax(qw: QuantizedWeight) -> list[float] | float:
    """The absmax a Paddle loader expects for one weight (see the module docstring): `qmax·s`
    with qmax 448 (FP8), 127 (int8) or 7 (weight-only int4). Computed in float64, where the
    product of a float32 step and qmax is exact, so `absmax / qmax` gives the step back bit for
    bit (JSON floats are doubles)."""
    scheme = qw.scheme
    if scheme.type == "float":
        values = qw.scales[:, 0].double() * FP8_MAX
        return float(values[0]) if scheme.per_tensor else values.tolist()
    if scheme.bits not in (4, 8) or not scheme.symmetric or scheme.group_size is not None:
        raise ValueError(f"PaddleNLP scale tables need symmetric per-channel int8 (or weight-only int4) weights, "
                         f"got {scheme.name}")
    return (qw.scales[:, 0].double() * signed_qmax(scheme.bits)).tolist()


def signed_qmax(bits: int) -> int:
    """127 for int8, 7 for int4: Paddle's symmetric code range is [−qmax, qmax]."""
    return 2 ** (bits - 1) - 1


def kv_head_list(absmax: torch.Tensor, num_heads: int, per_head: bool) -> list[float]:
    """Per-KV-head absmax expanded to `num_heads` entries (each repeated heads/kv times)."""
    values = absmax.float() if per_head else absmax.float().max().expand_as(absmax)
    return values.repeat_interleave(num_heads // values.numel()).tolist()


def scale_tables(
    model_config: dict[str, Any], quant_config: dict[str, Any],
    quantized: dict[str, QuantizedWeight], scales: dict[str, torch.Tensor],
) -> dict[str, dict[str, Any]]:
    """The three tables, keyed by file name (cachekv only when the KV cache is quantized)."""
    model_type = model_config["model_type"]
    num_heads = model_config["num_attention_heads"]
    weights = {f"{paddle_name(n, model_type)}.weight_quanter": weight_absmax(qw) for n, qw in quantized.items()}
    acts: dict[str, Any] = {}
    for name in (quant_config.get("activations") or {}).get("modules", []):
        acts[f"{paddle_name(name, model_type)}.activation_quanter"] = float(scales[input_absmax_key(name)])
    tables = {"weight_scales.json": weights, "act_scales.json": acts}
    kv = quant_config.get("kv_cache")
    if kv:
        per_head = kv.get("granularity", "head") == "head"
        cache: dict[str, Any] = {}
        for name in kv["modules"]:
            k_key, v_key = kv_absmax_keys(name)
            base = paddle_name(name, model_type)
            cache[f"{base}.cachek_matmul.activation_quanter"] = kv_head_list(scales[k_key], num_heads, per_head)
            cache[f"{base}.cachev_matmul.activation_quanter"] = kv_head_list(scales[v_key], num_heads, per_head)
        tables["cachekv_scales.json"] = cache
    return tables


def write_scale_tables(target: Path, tables: dict[str, dict[str, Any]]) -> list[Path]:
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, table in tables.items():
        path = target / file_name
        path.write_text(json.dumps(table) + "\n")  # one line, as PaddleNLP writes them
        written.append(path)
    return written


def scale_tables_from_canonical(source: Path) -> dict[str, dict[str, Any]]:
    """The tables for a canonical directory (what an exporter calls)."""
    from quantlab.quant.canonical import load_canonical, load_quant_config, load_scales

    _, quantized = load_canonical(source)
    model_config = read_json_object(source / "config.json")
    return scale_tables(model_config, load_quant_config(source), quantized, load_scales(source))
