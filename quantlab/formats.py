"""The export format names and what each name implies, as data: the recipe validates its
`export:` list against them, the plan and the quantize stage ask whether a run keeps folded
weights, the CLI checks `--format`. Nothing here imports an exporter (`quantlab.export.registry`
maps each name to the module that writes it), so the recipe does not reach into quantlab.export."""

from __future__ import annotations

from typing import Literal, get_args

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


# What a deploying user loads each export family with, and the Python package (import name, pip
# name) that loader needs; quantlab writes, validates and inspects every family without them.
ENGINES: dict[str, tuple[str, tuple[str, str]]] = {
    "awq": ("transformers + gptqmodel (AutoAWQ is archived), or vLLM", ("gptqmodel", "gptqmodel")),
    "gptq": ("GPTQModel.load or transformers + gptqmodel, or vLLM", ("gptqmodel", "gptqmodel")),
    "compressed-tensors": ("vLLM, or transformers + compressed-tensors", ("compressed_tensors", "compressed-tensors")),
    "gguf": ("llama.cpp (llama-cli, llama-server) or llama-cpp-python", ("llama_cpp", "llama-cpp-python")),
    "trtllm": ("TensorRT-LLM's trtllm-build, on an NVIDIA GPU", ("tensorrt_llm", "tensorrt-llm")),
    "paddlenlp": ("PaddleNLP's predictor (paddlepaddle-gpu)", ("paddlenlp", "paddlenlp")),
}


def family_of(fmt: str) -> str:
    """`gguf-q4_0` → `gguf`; other format names are their own family."""
    return "gguf" if fmt.startswith("gguf") else fmt
