"""The export format names (used by the recipe, the CLI and the run stage) and the module that
writes, reads and validates each. Kept free of heavy imports: the recipe imports it."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Literal, get_args

ExportFormat = Literal["awq", "gptq", "compressed-tensors", "gguf-f16", "gguf-q8_0", "gguf-q4_0", "gguf-q4_1",
                       "gguf-q4_k_m", "gguf-q5_k_m", "gguf-q6_k", "trtllm", "paddlenlp"]
FORMATS: tuple[str, ...] = get_args(ExportFormat)
# GGUF types written through llama.cpp's own quantizer: they read the float weights before
# rounding (`folded.safetensors` of the canonical form), which the quantize stage then keeps.
K_QUANTS = ("q4_k_m", "q5_k_m", "q6_k")


# Formats that carry a quantized lm_head (a stage's `lm_head: true`; GPTQ as GPTQModel's
# `lm_head: true`, GGUF as `output.weight`); the others keep it float as quantlab writes them
# (AutoAWQ checkpoints, the TensorRT-LLM and PaddleNLP layouts) and refuse such a run rather
# than drop its codes.
HEAD_FORMATS = ("compressed-tensors", "gptq", *(f for f in FORMATS if f.startswith("gguf-")))


def keeps_folded_weights(formats: list[str]) -> bool:
    return any(fmt.removeprefix("gguf-") in K_QUANTS for fmt in formats if fmt.startswith("gguf-"))

_MODULES = {"awq": "awq", "gptq": "gptq", "compressed-tensors": "compressed_tensors", "trtllm": "trtllm",
            "paddlenlp": "paddlenlp", "gguf": "gguf_file"}


def module_for(fmt: str) -> tuple[ModuleType, dict[str, Any]]:
    """The format's module and the writer options its name implies (`gguf-q4_0` → qtype q4_0)."""
    if fmt.startswith("gguf-"):
        return importlib.import_module("quantlab.export.gguf_file"), {"qtype": fmt.removeprefix("gguf-")}
    return importlib.import_module(f"quantlab.export.{_MODULES[fmt]}"), {}


def family_modules() -> dict[str, ModuleType]:
    """One module per on-disk family, in detection order (most specific first)."""
    return {name: importlib.import_module(f"quantlab.export.{mod}")
            for name, mod in (("gguf", "gguf_file"), ("trtllm", "trtllm"), ("paddlenlp", "paddlenlp"),
                              ("awq", "awq"), ("gptq", "gptq"), ("compressed-tensors", "compressed_tensors"))}
