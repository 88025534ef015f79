"""Quantization schemes as data: what a quantized tensor looks like, not how it was found.

One `WeightScheme` describes every weight format quantlab produces; algorithms (RTN, GPTQ,
AWQ) only decide the codes, never the format. Presets give the names users already know.
`ActivationScheme` and `KVCacheScheme` describe how Linear inputs and the K/V cache are
quantized at inference (A8W8, FP8, C8); their ranges come from the `act_ranges` stage.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class WeightScheme(BaseModel):
    """Integer weight quantization: `w ≈ (q − z) · s`, one (s, z) per output row and group.

    `group_size=None` means per-channel (one group spanning the whole input dim). A group size
    that does not divide the input dim leaves a shorter last group with its own scale (the
    GPTQ `g_idx = i // G` convention), so SmolLM2's 576 inputs at G=128 give groups of
    128,128,128,128,64.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    bits: Literal[2, 3, 4, 8] = 4
    symmetric: bool = True
    group_size: int | None = Field(default=128, description="inputs per scale; null = per-channel")
    type: Literal["int", "float"] = Field(default="int", description="float = FP8 e4m3 codes, s = absmax/448")
    per_tensor: bool = Field(default=False, description="one scale for the whole weight (needs group_size null)")

    @field_validator("group_size")
    @classmethod
    def _group_size_positive(cls, v: int | None) -> int | None:
        if v is not None and (v < 8 or v & (v - 1)):
            raise ValueError("group_size must be null (per-channel) or a power of two >= 8")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "WeightScheme":
        if self.per_tensor and self.group_size is not None:
            raise ValueError("per_tensor needs group_size: null")
        if self.type == "float" and (self.bits != 8 or not self.symmetric or self.group_size is not None):
            raise ValueError("float (FP8 e4m3) weights are 8-bit, symmetric, per-channel or per-tensor "
                             "(bits: 8, symmetric: true, group_size: null)")
        return self

    @property
    def qmax(self) -> int:
        return 2**self.bits - 1

    @property
    def name(self) -> str:
        if self.type == "float":
            return f"FP8_{'t' if self.per_tensor else 'c'}"
        group = "t" if self.per_tensor else "c" if self.group_size is None else f"g{self.group_size}"
        return f"W{self.bits}A16{'' if self.symmetric else '_ASYM'}_{group}"


PRESETS: dict[str, WeightScheme] = {
    "W4A16": WeightScheme(bits=4, symmetric=True, group_size=128),
    "W4A16_ASYM": WeightScheme(bits=4, symmetric=False, group_size=128),
    "W8A16": WeightScheme(bits=8, symmetric=True, group_size=None),
    "W8A16_ASYM": WeightScheme(bits=8, symmetric=False, group_size=None),
    "FP8": WeightScheme(type="float", bits=8, symmetric=True, group_size=None),
    "FP8_PER_TENSOR": WeightScheme(type="float", bits=8, symmetric=True, group_size=None, per_tensor=True),
}

ObserverKind = Literal["absmax", "percentile", "mse", "histogram"]


def quant_kind(type_: str) -> str:
    """`int` → `int8`, `float` → `fp8` (the names `quantlab.quant.activations` uses)."""
    return "int8" if type_ == "int" else "fp8"


class ActivationScheme(BaseModel):
    """8-bit quantization of every quantized Linear's input (symmetric, no zero point).

    int: `s = absmax/127`, codes on [−127, 127]; float: FP8 e4m3, `s = absmax/448`.
    `dynamic` scales are computed at run time per token (or per tensor); static scales are
    per tensor, from the calibration ranges the `observer` picked (absmax, or a clipped
    threshold: percentile / mse / histogram = KL entropy).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["int", "float"] = "int"
    dynamic: bool = True
    granularity: Literal["token", "tensor"] = "token"
    observer: ObserverKind = "absmax"
    percentile: float = Field(default=99.99, gt=0, le=100)

    @model_validator(mode="after")
    def _static_is_per_tensor(self) -> "ActivationScheme":
        if not self.dynamic and self.granularity != "tensor":
            raise ValueError("static activation scales are per tensor (granularity: tensor)")
        if self.observer == "histogram" and self.type != "int":
            raise ValueError("observer histogram (KL entropy) is for int8; FP8 takes absmax, percentile or mse")
        return self

    @property
    def kind(self) -> str:
        return quant_kind(self.type)

    @property
    def name(self) -> str:
        how = "dynamic" if self.dynamic else f"static_{self.observer}"
        return f"A8{'' if self.type == 'int' else '_FP8'}_{self.granularity}_{how}"


class KVCacheScheme(BaseModel):
    """8-bit K/V cache (C8): K after RoPE and V, static absmax scales per KV head or per tensor."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["int", "float"] = "int"
    granularity: Literal["head", "tensor"] = "head"

    @property
    def kind(self) -> str:
        return quant_kind(self.type)


def scheme_from_entry(entry: dict[str, Any] | None, model: type[BaseModel]) -> Any:
    """A scheme back from its `quant_config.json` entry, which also carries non-scheme keys
    (`modules`, …); None when the run has no such entry."""
    return model(**{k: v for k, v in entry.items() if k in model.model_fields}) if entry else None
