"""How each TensorRT-LLM quant_algo stores one fused Linear (`attention.qkv`, `attention.dense`,
`mlp.fc`, `mlp.gate`, `mlp.proj`) and the norm in front of it, in the layout `trtllm-build`
loads (`tensorrt_llm/quantization/layers.py`, `models/modeling_utils.py`
`preprocess_perlayer_weights`, `models/llama/convert.py`):

  * W4A16_AWQ (`WeightOnlyGroupwiseQuantLinear`, ModelOpt export layout that `trtllm-build`
    preprocesses itself): `weight` int8 `[out/2, in]`, two signed int4 codes `q − 8` per byte,
    low nibble = even output row; `weights_scaling_factor` fp16 `[out, in/G]`, dequant
    `(q − 8)·s` (only symmetric schemes fit: no zero point); `prequant_scaling_factor` fp16
    `[in]` of ones (quantlab folds AWQ scales into the previous op; q, k and v share one).
  * W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN (`SmoothQuantLinear` / `SmoothQuantRowLinear` /
    `SmoothQuantRmsNorm`, what `convert.py` `get_tllm_linear_sq_weight` writes with per_token
    and per_channel): `weight` int8 `[out, in]` = the signed code `q − 128`;
    `per_channel_scale` fp32 `[1, out]` = the weight step s (dequant `w·s`); activations are
    quantized per token at run time, so no `act_scale`; the row-parallel Linears
    (`attention.dense`, `mlp.proj`) carry `smoother` fp32 `[1, in]`, which the layer divides
    its input by before quantizing — ones, because quantlab's SmoothQuant folds every scale
    into the producing norm or Linear; the norms before qkv and fc/gate carry `scale_to_int`
    fp32 `[1]` = 1.0 (convert.py writes 1.0 in per-token mode; the norm then emits the int8
    tensor and its per-token scales).
  * FP8 (`FP8Linear` / `FP8RowLinear`): `weight` float8_e4m3fn `[out, in]`,
    `weights_scaling_factor` and `activation_scaling_factor` fp32 `[1]`: per-tensor steps
    (amax/448), the activation one static. TensorRT-LLM keeps one weight scale for the fused
    qkv, so q, k and v with different per-tensor scales are requantized to the largest (what
    `FP8Linear.postprocess` does with a Hugging Face FP8 checkpoint): their codes come back as
    exported, exactly, and the sidecar fingerprints those; codes of parts that already had the
    largest scale (and of every other Linear) are the canonical codes unchanged.

Every layout writes the codes of one Linear; `decode` reads them back into the canonical
`QuantizedWeight` (unsigned codes, zero point, `[out, groups]` scales).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from quantlab.errors import UserError
from quantlab.export.bits import pack_int4_pairs, unpack_int4_pairs
from quantlab.export.checks import Report
from quantlab.export.source import Canonical
from quantlab.quant.activations import scale_from_absmax
from quantlab.quant.primitives import QuantizedWeight, default_g_idx
from quantlab.quant.scheme import WeightScheme

FP16, FP32 = torch.float16, torch.float32
GROUP_SIZES = (64, 128)  # TensorRT-LLM's groupwise int4 kernels
ROW_LINEARS = ("attention.dense", "mlp.proj")  # inputs not produced by a norm
DEFAULT_GROUP = 128  # QuantConfig's default; written (unused) for the per-channel / per-tensor algos


@dataclass(frozen=True)
class Spec:
    """One tensor a layout expects next to `<module>.`: dtype and shape."""

    suffix: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def concat(qws: list[QuantizedWeight]) -> QuantizedWeight:
    """q, k, v (or any parts) as one Linear: rows stacked on the output dim."""
    return QuantizedWeight(torch.cat([q.codes for q in qws]), torch.cat([q.scales for q in qws]),
                           torch.cat([q.zeros for q in qws]), qws[0].g_idx, qws[0].scheme)


def _ones_check(report: Report, t: torch.Tensor | None, name: str, rule: str, why: str) -> None:
    if t is not None:
        report.check(rule, name, bool((t.float() == 1).all()), why)


def _positive_check(report: Report, t: torch.Tensor | None, name: str) -> None:
    if t is not None:
        f = t.float()
        report.check("scale is positive and finite", name, bool(torch.isfinite(f).all() and (f > 0).all()),
                     "a step size must be > 0 and finite")


def _from_signed(signed: torch.Tensor, scales: torch.Tensor, bits: int, group: int | None) -> QuantizedWeight:
    """TensorRT-LLM's signed symmetric codes as canonical unsigned ones (zero point 2^(bits−1))."""
    mid = 1 << (bits - 1)
    codes = (signed.to(torch.int16) + mid).to(torch.uint8)
    return QuantizedWeight(codes, scales, torch.full(scales.shape, mid, dtype=torch.uint8),
                           default_g_idx(codes.shape[1], group),
                           WeightScheme(bits=bits, symmetric=True, group_size=group))


class _Layout:
    """Defaults shared by the layouts: per-channel/tensor scales (no groups, no padding, no
    pre-quant scale) and no tensors on the norms."""

    def quantization(self, src: Canonical) -> dict[str, Any]:
        return {"group_size": DEFAULT_GROUP, "has_zero_point": False, "pre_quant_scale": False}

    def pad_multiple(self, src: Canonical) -> int | None:
        return None

    def stored(self, parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
        return parts

    def norm_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def norm_specs(self) -> list[Spec]:
        return []

    def check_norm(self, report: Report, tensors: dict[str, torch.Tensor], name: str) -> None:
        """Rules for the norm tensors, where a layout has any."""


class W4A16AWQ(_Layout):
    quant_algo = "W4A16_AWQ"

    def check(self, src: Canonical) -> None:
        scheme = src.scheme
        if scheme.bits != 4 or not scheme.symmetric or scheme.type != "int":
            raise UserError(f"trtllm: W4A16_AWQ stores symmetric 4-bit codes with no zero point; scheme "
                            f"{scheme.name} does not fit (use bits 4, symmetric true, or export as gptq, which "
                            "TensorRT-LLM's PyTorch backend loads as W4A16_GPTQ)")
        if scheme.group_size not in GROUP_SIZES:
            raise UserError(f"trtllm: group_size {scheme.group_size} is not one TensorRT-LLM's int4 kernels take "
                            f"({', '.join(map(str, GROUP_SIZES))})")
        if src.activations is not None:
            raise UserError("trtllm: W4A16_AWQ keeps activations in float16; this run also quantizes them "
                            "(W4A8 is not exported)")

    def quantization(self, src: Canonical) -> dict[str, Any]:
        return {"group_size": src.scheme.group_size, "has_zero_point": False, "pre_quant_scale": True}

    def pad_multiple(self, src: Canonical) -> int | None:
        return max(64, src.scheme.group_size)

    def stored(self, parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
        """Scales as the fp16 tensor holds them."""
        return [QuantizedWeight(q.codes, q.scales.half().float(), q.zeros, q.g_idx, q.scheme) for q in parts]

    def module_tensors(self, src: Canonical, module: str, parts: list[str],
                       qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        return {"weight": pack_int4_pairs(qw.codes.to(torch.int16) - 8),
                "weights_scaling_factor": qw.scales.to(FP16),
                "prequant_scaling_factor": torch.ones(qw.codes.shape[1], dtype=FP16)}

    def specs(self, module: str, out_f: int, in_f: int, quant: dict[str, Any]) -> list[Spec]:
        group = int(quant["group_size"])
        return [Spec("weight", torch.int8, (out_f // 2, in_f)),
                Spec("weights_scaling_factor", FP16, (out_f, in_f // group)),
                Spec("prequant_scaling_factor", FP16, (in_f,))]

    def check_values(self, report: Report, tensors: dict[str, torch.Tensor], name: str, module: str) -> None:
        _ones_check(report, tensors.get(f"{name}.prequant_scaling_factor"), f"{name}.prequant_scaling_factor",
                    "prequant scale is ones (AWQ scales folded)",
                    "not all ones, but quantlab folds AWQ scales into the weights")
        _positive_check(report, tensors.get(f"{name}.weights_scaling_factor"), f"{name}.weights_scaling_factor")

    def decode(self, tensors: dict[str, torch.Tensor], name: str, quant: dict[str, Any]) -> QuantizedWeight:
        return _from_signed(unpack_int4_pairs(tensors[f"{name}.weight"]),
                            tensors[f"{name}.weights_scaling_factor"].float(), 4, int(quant["group_size"]))


class W8A8SmoothQuant(_Layout):
    quant_algo = "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"

    def check(self, src: Canonical) -> None:
        scheme, acts = src.scheme, src.activations
        if scheme.type != "int" or scheme.bits != 8 or not scheme.symmetric or scheme.group_size is not None:
            raise UserError(f"trtllm: {self.quant_algo} takes symmetric per-channel int8 weights; scheme "
                            f"{scheme.name} does not fit (use W8A16 weights with smoothquant and act_ranges)")
        if acts is None or acts.type != "int" or not acts.dynamic or acts.granularity != "token":
            got = "none" if acts is None else acts.name
            raise UserError(f"trtllm: {self.quant_algo} quantizes activations per token at run time; the run's "
                            f"activation scheme is {got} (use act_ranges activations {{type: int, dynamic: true, "
                            "granularity: token}}; static per-tensor SmoothQuant is not exported)")
        src.require_activations_on_quantized("trtllm")

    def module_tensors(self, src: Canonical, module: str, parts: list[str],
                       qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        out = {"weight": (qw.codes.to(torch.int16) - 128).to(torch.int8),
               "per_channel_scale": qw.scales[:, 0].float().reshape(1, -1)}
        if module in ROW_LINEARS:
            out["smoother"] = torch.ones(1, qw.codes.shape[1], dtype=FP32)
        return out

    def norm_tensors(self) -> dict[str, torch.Tensor]:
        return {"scale_to_int": torch.ones(1, dtype=FP32)}

    def specs(self, module: str, out_f: int, in_f: int, quant: dict[str, Any]) -> list[Spec]:
        specs = [Spec("weight", torch.int8, (out_f, in_f)), Spec("per_channel_scale", FP32, (1, out_f))]
        return specs + ([Spec("smoother", FP32, (1, in_f))] if module in ROW_LINEARS else [])

    def norm_specs(self) -> list[Spec]:
        return [Spec("scale_to_int", FP32, (1,))]

    def check_values(self, report: Report, tensors: dict[str, torch.Tensor], name: str, module: str) -> None:
        _positive_check(report, tensors.get(f"{name}.per_channel_scale"), f"{name}.per_channel_scale")
        if module in ROW_LINEARS:
            _ones_check(report, tensors.get(f"{name}.smoother"), f"{name}.smoother",
                        "smoother is ones (SmoothQuant scales folded)",
                        "not all ones, but quantlab folds SmoothQuant scales into the producing op")

    def check_norm(self, report: Report, tensors: dict[str, torch.Tensor], name: str) -> None:
        _ones_check(report, tensors.get(f"{name}.scale_to_int"), f"{name}.scale_to_int",
                    "scale_to_int is 1 (per-token activations)",
                    "per-token SmoothQuant norms pass 1.0 (convert.py); another value rescales every input")

    def decode(self, tensors: dict[str, torch.Tensor], name: str, quant: dict[str, Any]) -> QuantizedWeight:
        return _from_signed(tensors[f"{name}.weight"],
                            tensors[f"{name}.per_channel_scale"].float().reshape(-1, 1).contiguous(), 8, None)


class FP8(_Layout):
    quant_algo = "FP8"

    def check(self, src: Canonical) -> None:
        scheme, acts = src.scheme, src.activations
        if scheme.type != "float" or not scheme.per_tensor:
            raise UserError(f"trtllm: FP8 takes per-tensor FP8 weight scales; scheme {scheme.name} does not fit "
                            "(use weights FP8_PER_TENSOR)")
        if acts is None or acts.type != "float" or acts.dynamic:
            got = "none" if acts is None else acts.name
            raise UserError(f"trtllm: FP8 quantizes activations with a static per-tensor scale; the run's "
                            f"activation scheme is {got} (use act_ranges activations {{type: float, dynamic: "
                            "false, granularity: tensor}})")
        src.require_activations_on_quantized("trtllm")

    def stored(self, parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
        """Parts of one fused Linear requantized to their largest per-tensor scale."""
        top = max(float(q.scales[0, 0]) for q in parts)
        out = []
        for q in parts:
            ratio = float(q.scales[0, 0]) / top  # exactly 1.0 for the part that holds the max
            codes = q.codes if ratio == 1.0 else (q.codes.float() * ratio).to(torch.float8_e4m3fn)
            out.append(QuantizedWeight(codes, torch.full_like(q.scales, top), q.zeros, q.g_idx, q.scheme))
        return out

    def module_tensors(self, src: Canonical, module: str, parts: list[str],
                       qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        absmax = torch.stack([src.input_absmax(p) for p in parts]).max()  # one input feeds every part
        return {"weight": qw.codes.to(torch.float8_e4m3fn),
                "weights_scaling_factor": qw.scales[:1, 0].float(),
                "activation_scaling_factor": scale_from_absmax(absmax, "fp8").reshape(1)}

    def specs(self, module: str, out_f: int, in_f: int, quant: dict[str, Any]) -> list[Spec]:
        return [Spec("weight", torch.float8_e4m3fn, (out_f, in_f)), Spec("weights_scaling_factor", FP32, (1,)),
                Spec("activation_scaling_factor", FP32, (1,))]

    def check_values(self, report: Report, tensors: dict[str, torch.Tensor], name: str, module: str) -> None:
        for suffix in ("weights_scaling_factor", "activation_scaling_factor"):
            _positive_check(report, tensors.get(f"{name}.{suffix}"), f"{name}.{suffix}")
        w = tensors.get(f"{name}.weight")
        if w is not None and w.dtype == torch.float8_e4m3fn:
            f = w.float()
            report.check("FP8 codes are finite", f"{name}.weight", bool(torch.isfinite(f).all()),
                         "NaN codes (e4m3 has no infinity)")

    def decode(self, tensors: dict[str, torch.Tensor], name: str, quant: dict[str, Any]) -> QuantizedWeight:
        codes = tensors[f"{name}.weight"]
        out_f, in_f = codes.shape
        scales = tensors[f"{name}.weights_scaling_factor"].float().reshape(1, 1).expand(out_f, 1).contiguous()
        return QuantizedWeight(codes, scales, torch.zeros(out_f, 1, dtype=torch.uint8),
                               torch.zeros(in_f, dtype=torch.int32),
                               WeightScheme(type="float", bits=8, symmetric=True, group_size=None, per_tensor=True))


LAYOUTS = {layout.quant_algo: layout for layout in (W4A16AWQ(), W8A8SmoothQuant(), FP8())}
KV_ALGOS = {"int": "INT8", "float": "FP8"}


def layout_for(src: Canonical):
    """The quant_algo the canonical scheme maps to (the export format is one name: trtllm)."""
    scheme = src.scheme
    if scheme.type == "float":
        return LAYOUTS["FP8"]
    if scheme.bits == 8 and src.activations is not None:
        return LAYOUTS["W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"]
    return LAYOUTS["W4A16_AWQ"]
