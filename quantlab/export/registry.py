"""The module that writes, reads and validates each export format (the names themselves are
data in quantlab.formats)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

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
