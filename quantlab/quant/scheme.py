"""Quantization schemes as data: what a quantized tensor looks like, not how it was found.

One `WeightScheme` describes every weight format quantlab produces; algorithms (RTN, GPTQ,
AWQ) only decide the codes, never the format. Presets give the names users already know.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


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

    @field_validator("group_size")
    @classmethod
    def _group_size_positive(cls, v: int | None) -> int | None:
        if v is not None and (v < 8 or v & (v - 1)):
            raise ValueError("group_size must be null (per-channel) or a power of two >= 8")
        return v

    @property
    def qmax(self) -> int:
        return 2**self.bits - 1

    @property
    def name(self) -> str:
        group = "c" if self.group_size is None else f"g{self.group_size}"
        return f"W{self.bits}A16{'' if self.symmetric else '_ASYM'}_{group}"


PRESETS: dict[str, WeightScheme] = {
    "W4A16": WeightScheme(bits=4, symmetric=True, group_size=128),
    "W4A16_ASYM": WeightScheme(bits=4, symmetric=False, group_size=128),
    "W8A16": WeightScheme(bits=8, symmetric=True, group_size=None),
    "W8A16_ASYM": WeightScheme(bits=8, symmetric=False, group_size=None),
}
