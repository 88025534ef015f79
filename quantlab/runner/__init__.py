"""The bundled inference runner: a plain-PyTorch llama/qwen2 decoder built from the canonical
form, with a Linear backend per scheme (quantlab.kernels), a static bf16/int8/fp8 KV cache,
generation (greedy / sampling, streaming, batches) and verification against fake quant.

    model = load_runner("runs/x", device="cuda", dtype=torch.bfloat16)
    out = generate(model, [tokenizer("Hello").input_ids], max_new_tokens=64)
"""

from quantlab.runner.generate import Generation, generate, sample
from quantlab.runner.load import build_runner, from_hf_model, load_runner
from quantlab.runner.model import ModelArgs, Transformer

__all__ = ["Generation", "ModelArgs", "Transformer", "build_runner", "from_hf_model", "generate",
           "load_runner", "sample"]
