"""What every exporter reads (the canonical form) and what every export carries besides weights.

`Canonical` wraps `load_canonical` with the model config and a few derived facts. Each export
also gets `quantlab_export.json`: the format, the canonical directory it came from and a
fingerprint (sha256) of every Linear's codes, zeros and g_idx, so a validator can decode an
export with the format's reader and prove the bits landed where the format says: a wrong
pack order or a swapped fc/gate changes the decoded codes and fails the fingerprint. Formats
that carry activation and KV-cache scales (compressed-tensors, trtllm, paddlenlp) also
fingerprint every Linear's scales and the deploy-time activation / KV steps their
`read_scales` must give back, so an absmax stored where a step belongs is caught too.
`Canonical` also exposes the canonical form's activation and KV-cache schemes and ranges.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from quantlab.file_checks import read_json_object
from quantlab.errors import UserError
from quantlab.models.arch import ArchSpec, n_experts, spec_for_config, supported_types
from quantlab.quant.canonical import SCALES_FILE, input_absmax_key, kv_absmax_keys
from quantlab.quant.primitives import QuantizedWeight, default_g_idx
from quantlab.quant.scheme import ActivationScheme, KVCacheScheme, WeightScheme, scheme_from_entry

SIDECAR = "quantlab_export.json"
SIDECAR_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Canonical:
    path: Path
    config: dict[str, Any]
    quant_config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    quantized: dict[str, QuantizedWeight]
    scales: dict[str, torch.Tensor] = field(default_factory=dict)  # calibrated absmax (`scales.safetensors`)

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "?")

    @cached_property
    def spec(self) -> ArchSpec:
        spec = spec_for_config(self.config)
        if spec is None:
            raise UserError(f"{self.path}: model_type {self.model_type!r} has no export mapping; "
                            f"supported: {', '.join(supported_types())}")
        return spec

    @property
    def float_dtype(self) -> torch.dtype:
        name = self.config.get("dtype") or self.config.get("torch_dtype") or "float32"
        return DTYPES.get(str(name).removeprefix("torch."), torch.float32)

    @property
    def head_quantized(self) -> bool:
        """Whether the run quantized lm_head too (a stage's `lm_head: true`)."""
        return "lm_head" in self.quantized

    @property
    def tied(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))

    @cached_property
    def folded(self) -> dict[str, torch.Tensor]:
        """The float weights before rounding (`folded.safetensors`), for requantizing formats."""
        from quantlab.quant.canonical import load_folded

        return load_folded(self.path)

    @cached_property
    def scheme(self) -> WeightScheme:
        """The one scheme of every quantized Linear (formats with a single config need it)."""
        schemes = {qw.scheme for qw in self.quantized.values()}
        if not schemes:
            raise UserError(f"{self.path}: no quantized Linear to export")
        if len(schemes) > 1:
            names = ", ".join(sorted(s.name for s in schemes))
            raise UserError(f"{self.path}: Linears use different schemes ({names}); this format takes one "
                            "scheme per model")
        return schemes.pop()

    @cached_property
    def act_order(self) -> bool:
        return any(not torch.equal(qw.g_idx, default_g_idx(qw.codes.shape[1], qw.scheme.group_size))
                   for qw in self.quantized.values())

    def unquantized_linears(self) -> list[str]:
        """Linears of the decoder layers that the recipe left in float (its `ignore` patterns)."""
        n_layers = int(self.config["num_hidden_layers"])
        names = [f"{self.spec.layers}.{i}.{lin}" for i in range(n_layers) for lin in self.spec.linears]
        return [n for n in names if n not in self.quantized]

    def router_linears(self) -> list[str]:
        """MoE routers (`mlp.gate`, Qwen2-MoE's `mlp.shared_expert_gate`): float by design; engines
        that build them as Linears must be told to leave them unquantized."""
        n_layers = int(self.config["num_hidden_layers"])
        return [f"{self.spec.layers}.{i}.{name}" for i in range(n_layers) for name in self.spec.float_linears]

    # ------------------------------------------------------------------ activations and KV cache

    @cached_property
    def activations(self) -> ActivationScheme | None:
        """How the Linear inputs are quantized at inference (None: weight-only)."""
        return scheme_from_entry(self.quant_config.get("activations"), ActivationScheme)

    @cached_property
    def kv_cache(self) -> KVCacheScheme | None:
        return scheme_from_entry(self.quant_config.get("kv_cache"), KVCacheScheme)

    @property
    def act_modules(self) -> list[str]:
        return list((self.quant_config.get("activations") or {}).get("modules", []))

    @property
    def kv_modules(self) -> list[str]:
        return list((self.quant_config.get("kv_cache") or {}).get("modules", []))

    def input_absmax(self, linear: str) -> torch.Tensor:
        """The calibrated per-tensor input range of one Linear (fp32, shape `[]`)."""
        return self._scale(input_absmax_key(linear)).reshape(())

    def kv_absmax(self, attention: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-KV-head absmax of K (after RoPE) and V of one attention module."""
        k_key, v_key = kv_absmax_keys(attention)
        return self._scale(k_key), self._scale(v_key)

    def _scale(self, key: str) -> torch.Tensor:
        if key not in self.scales:
            raise UserError(f"{self.path}: {SCALES_FILE} has no {key}; rerun the act_ranges stage")
        return self.scales[key].float()

    def require_weight_only(self, fmt: str) -> None:
        """These exporters write integer weight-only checkpoints; anything more would be dropped."""
        fp8 = [n for n, q in self.quantized.items() if q.scheme.type != "int"]
        if fp8:
            raise UserError(f"{fmt}: {fp8[0]} has FP8 weights; only integer weight-only schemes are exported "
                            f"as {fmt} (export as {CARRIERS})")
        for key, what in (("activations", "activations"), ("kv_cache", "the KV cache")):
            if self.quant_config.get(key):
                raise UserError(f"{fmt}: this run also quantizes {what}; {fmt} would keep only the weights "
                                f"(export as {CARRIERS}, which carry activation and KV-cache scales)")

    def require_activations_on_quantized(self, fmt: str) -> None:
        """Formats with one activation scheme per checkpoint: every quantized Linear's input is
        quantized, and only those."""
        acts, quantized = set(self.act_modules), set(self.quantized)
        if acts != quantized:
            odd = sorted(acts ^ quantized)[0]
            raise UserError(f"{fmt}: {odd} is quantized in its weights or its inputs but not both; this format "
                            "takes one activation scheme for every quantized Linear (quantize all inputs or none)")

    def require_kv_on_every_layer(self, fmt: str) -> None:
        """Formats with one KV-cache setting per model (a quant algo, a quant_type)."""
        attns = [f"{self.spec.layers}.{i}.self_attn" for i in range(int(self.config["num_hidden_layers"]))]
        if self.kv_cache is not None and sorted(self.kv_modules) != sorted(attns):
            raise UserError(f"{fmt}: the KV cache is quantized in {len(self.kv_modules)} of {len(attns)} layers; "
                            f"{fmt} takes one KV-cache scheme for every layer")

    def require_default_g_idx(self, fmt: str) -> None:
        if self.act_order:
            raise UserError(f"{fmt}: cannot store an act-order g_idx (groups must be contiguous runs of "
                            f"input columns); export this model as gptq")


CARRIERS = "compressed-tensors, trtllm or paddlenlp"


def load_source(path: Path) -> Canonical:
    from quantlab.quant.canonical import load_canonical, load_scales

    if not (path / "quant_config.json").is_file():
        raise UserError(f"{path}: not a quantlab canonical directory (no quant_config.json); "
                        "export reads the `quantized/` directory of a finished run")
    try:
        tensors, quantized = load_canonical(path)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    except (KeyError, TypeError, AttributeError) as exc:  # a quant_config.json whose entries are not ours
        raise UserError(f"{path / 'quant_config.json'}: an entry is missing or malformed ({type(exc).__name__}: "
                        f"{str(exc)[:80]}); the file is damaged or not quantlab's") from None
    config = read_json_object(path / "config.json")
    quant_config = read_json_object(path / "quant_config.json")
    return Canonical(path, config, quant_config, tensors, quantized, load_scales(path))


def head_dim(config: dict[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def linear_shapes(config: dict[str, Any], spec: ArchSpec) -> dict[str, tuple[int, int]]:
    """`[out, in]` of each Linear of one decoder layer, from the model config."""
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    hd = head_dim(config)
    q, kv = int(config["num_attention_heads"]) * hd, int(config.get("num_key_value_heads") or
                                                            config["num_attention_heads"]) * hd
    shapes = {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
              "self_attn.o_proj": (hidden, q)}

    def mlp_shape(name: str) -> tuple[int, int]:
        owner, _, kind = name.rpartition(".")
        width = inter
        if ".experts." in name:  # Mixtral's experts are intermediate_size wide, Qwen-MoE's moe_intermediate_size
            width = int(config.get("moe_intermediate_size") or inter)
        elif owner.endswith("shared_expert"):
            width = int(config["shared_expert_intermediate_size"])
        return (hidden, width) if kind == "down_proj" else (width, hidden)

    return {name: shapes[name] if name in shapes else mlp_shape(name) for name in spec.linears}


def router_width(config: dict[str, Any], name: str) -> int:
    """Output width of a float router Linear: one logit per expert, or the shared-expert gate's one."""
    if name.endswith("shared_expert_gate"):
        return 1
    return n_experts(config)


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Tokenizer and generation config, so the export directory loads on its own."""
    copied = []
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def write_config(src: Canonical, dst: Path, quantization_config: dict[str, Any] | None,
                 dtype: str | None = None) -> None:
    config = dict(src.config)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    if dtype is not None:
        config["dtype"] = dtype
        config.pop("torch_dtype", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# ----------------------------------------------------------------------------- fingerprints


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().cpu().numpy().tobytes()).hexdigest()[:32]


def fingerprint(qw: QuantizedWeight, scales: bool = False) -> dict[str, str]:
    """FP8 codes are fingerprinted by their bytes (a value cast to uint8 would lose them).
    `scales`: also the fp32 scales, for formats that store them exactly (or whose exporter
    passes the scales as the format rounds them)."""
    codes = qw.codes.view(torch.uint8) if qw.codes.is_floating_point() else qw.codes.to(torch.uint8)
    out = {"codes": sha(codes), "zeros": sha(qw.zeros.to(torch.uint8)), "g_idx": sha(qw.g_idx.to(torch.int32))}
    if scales:
        out["scales"] = sha(qw.scales.float())
    return out


def scale_fingerprints(scales: dict[str, torch.Tensor]) -> dict[str, str]:
    """Activation / KV steps as a format's `read_scales` returns them (fp32, flattened)."""
    return {k: sha(v.float().reshape(-1)) for k, v in sorted(scales.items())}


def write_sidecar(src: Canonical, final_dir: Path, tmp_dir: Path, fmt: str, options: dict[str, Any],
                  modules: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> None:
    """`modules`: per Linear what the reader must reproduce (default: the codes fingerprint)."""
    source = os.path.relpath(src.path.resolve(), final_dir.resolve())
    payload = {"quantlab_export": SIDECAR_VERSION, "format": fmt, "options": options, "source": source,
               "model_type": src.model_type,
               "modules": modules if modules is not None else {n: fingerprint(q) for n, q in src.quantized.items()},
               **(extra or {})}
    (tmp_dir / SIDECAR).write_text(json.dumps(payload, indent=2) + "\n")


def read_sidecar(path: Path) -> dict[str, Any] | None:
    f = path / SIDECAR
    return read_json_object(f) if f.is_file() else None


def sidecar_source(path: Path) -> Path | None:
    side = read_sidecar(path)
    if not side:
        return None
    src = (path / side["source"]).resolve()
    return src if (src / "quant_config.json").is_file() else None


def check_fingerprints(report: Any, path: Path, quantized: dict[str, QuantizedWeight],
                       decoded_scales: dict[str, torch.Tensor] | None = None) -> None:
    """Decoded codes/zeros/g_idx (and scales, where recorded) equal what the exporter saw: proves
    pack order, naming and scale semantics. `decoded_scales`: the format's `read_scales`."""
    side = read_sidecar(path)
    if side is None:
        report.skip("codes", f"no {SIDECAR} (not written by quantlab): pack order not verifiable")
        return
    expected = side.get("modules", {})
    for name, fp in expected.items():
        qw = quantized.get(name)
        if not report.check("present", name, qw is not None, "Linear listed in the fingerprint is missing"):
            continue
        got = fingerprint(qw, scales="scales" in fp)
        for part in ("codes", "zeros", "g_idx", "scales"):
            if part in fp:
                report.check(f"decoded {part}", name, got[part] == fp[part],
                             f"decoded {part} differ from the exported model's (wrong pack order, "
                             "scale semantics, swapped tensors or a different model)")
    if "scales" in side:
        check_scale_fingerprints(report, side["scales"], decoded_scales)


def check_scale_fingerprints(report: Any, expected: dict[str, str], scales: dict[str, torch.Tensor] | None) -> None:
    """Decoded activation / KV steps equal the canonical ones (absmax/127 or /448, per tensor or
    per KV head): catches an absmax written where a step belongs, or the other way round."""
    got = scale_fingerprints(scales or {})
    for key, fp in expected.items():
        if report.check("present", key, key in got, "activation / KV scale listed in the fingerprint is missing"):
            report.check("decoded scales", key, got[key] == fp,
                         "decoded step differs from the exported model's (wrong scale semantics: an absmax "
                         "where a step belongs, a per-head list read with the wrong stride, or another model)")
    for key in sorted(set(got) - set(expected)):
        report.check("decoded scales", key, False, "a scale the exported model does not have")
