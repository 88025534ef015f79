"""GPTQModel peer: quantize the float model with GPTQ or AWQ on the shared calibration ids,
then score it with quantlab's perplexity in this same process.

Runs inside the gptqmodel virtualenv (see benchmarks/peers_cpu.py for how it is built).
Settings mirror quantlab's recipes: GPTQ with `damp_percent`, no act-order and no
group-aware reordering (GPTQModel turns `act_group_aware` on by default; quantlab has no
equivalent, so it is off for a like-for-like comparison); AWQ with GPTQModel's defaults.

The quantized model is saved and loaded back through `GPTQModel.load` on the torch
kernel before scoring: that is the model a user of GPTQModel gets, and it does not depend
on whether the quantization loop left layers offloaded to disk.
"""

from __future__ import annotations

import os
import sys

import _common

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def quantize_config(args):
    from gptqmodel import QuantizeConfig
    from gptqmodel.quantization import FORMAT, METHOD

    common = dict(bits=args.bits, group_size=args.group_size, sym=args.sym)
    if args.method == "gptq":
        return QuantizeConfig(**common, method=METHOD.GPTQ, format=FORMAT.GPTQ, desc_act=args.act_order,
                              act_group_aware=False, damp_percent=args.damp)
    return QuantizeConfig(**common, method=METHOD.AWQ, format=FORMAT.GEMM)


def main() -> int:
    args = _common.parse_args(__doc__.splitlines()[0])
    timer = _common.Timer()
    result: dict = {"tool": "gptqmodel", "method": args.method, "group_size": args.group_size,
                    "sym": args.sym, "versions": _common.versions("gptqmodel")}
    try:
        import torch
        from gptqmodel import BACKEND, GPTQModel

        ids = _common.calibration_ids(args.calib)
        calibration = [{"input_ids": row, "attention_mask": torch.ones_like(row)} for row in ids]
        config = quantize_config(args)
        result["config"] = {k: str(v) for k, v in vars(config).items()
                            if k in ("bits", "group_size", "sym", "desc_act", "act_group_aware", "damp_percent",
                                     "true_sequential", "method", "format", "offload_to_disk")}
        with timer.measure("load"):
            model = GPTQModel.load(args.model, config, device="cpu")
        # The AUTO backend picks the CUDA AWQ GEMM kernel ("AWQ: CUDA is not available"): name the torch ones.
        backend = BACKEND.GPTQ_TORCH if args.method == "gptq" else BACKEND.AWQ_TORCH
        with timer.measure("quantize"):
            model.quantize(calibration, batch_size=1, backend=backend)
        save_dir = os.path.join(args.workdir, "checkpoint")
        with timer.measure("save"):
            model.save(save_dir)
        del model
        with timer.measure("reload"):
            model = GPTQModel.load(save_dir, device="cpu", backend=backend)
        result["kernel"] = sorted({type(m).__name__ for m in model.model.modules() if hasattr(m, "qweight")})
        with timer.measure("eval"):
            result["perplexity"] = _common.score(model.model, args)
        result["status"] = "ok"
    except Exception as exc:  # the benchmark records a peer's failure instead of crashing
        _common.record_failure(result, exc)
    return _common.finish(args, result, timer)


if __name__ == "__main__":
    sys.exit(main())
