"""Run a peer script of the CPU benchmark on a GPU, unchanged: the rows of benchmarks/peers_gpu_awq.py.

    python benchmarks/peers/on_gpu.py gptqmodel_run.py|llmcompressor_run.py|float_run.py ARGS...

The peer scripts' bytes are part of the saved CPU rows' hashes, so they are not edited; this
wrapper changes only where things run:
  * gptqmodel_run.py hides the GPU (CUDA_VISIBLE_DEVICES setdefault "") and loads with
    device="cpu": the GPU is made visible first and `GPTQModel.load` gets "cuda:0" instead;
  * `_common.score` (quantlab's perplexity) moves the model to the CPU, but both peers leave
    accelerate hooks that send inputs to the GPU ("Expected all tensors to be on the same
    device"): it scores on cuda:0 instead, with the same function, windows and tokens, after
    removing llm-compressor's CPU offload (see `onload`).
Quantization settings, backends and the rest of each script are its own.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")

import _common  # noqa: E402
import torch  # noqa: E402


def onload(model: torch.nn.Module) -> None:
    """llm-compressor leaves the model CPU-offloaded after `oneshot` on a GPU, onloading a
    fresh copy of each weight on every access: the weight fake-quant that compressed-tensors
    applies in forward then writes into a copy Linear.forward never reads, and the model
    scores as float. Removing the offload puts the real parameters on the GPU first."""
    from compressed_tensors.offload import remove_dispatch

    remove_dispatch(model, onload_tensors=True)
    model.to("cuda:0")


def score_on_gpu(model: torch.nn.Module, args, *, remove_offload: bool = False) -> dict:
    from quantlab.eval.perplexity import perplexity

    if remove_offload:
        onload(model)
    model.eval()
    return perplexity(model, _common.eval_stream(args.eval), args.seq_len, args.windows,
                      device=torch.device("cuda:0")).to_dict()


def main() -> int:
    script = sys.argv.pop(1)
    _common.score = functools.partial(score_on_gpu, remove_offload=script.startswith("llmcompressor"))
    if script.startswith("gptqmodel"):
        from gptqmodel import GPTQModel

        load = GPTQModel.load

        def load_on_gpu(*args, **kwargs):
            if kwargs.get("device") == "cpu":
                kwargs["device"] = "cuda:0"
            return load(*args, **kwargs)

        GPTQModel.load = staticmethod(load_on_gpu)
    sys.argv[0] = str(Path(__file__).with_name(script))
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
