"""Float baseline: the unquantized model scored with quantlab's perplexity on the shared
test stream, in the benchmark's own interpreter (quantlab's virtualenv)."""

from __future__ import annotations

import sys

import _common


def main() -> int:
    args = _common.parse_args(__doc__.splitlines()[0])
    timer = _common.Timer()
    result: dict = {"tool": "float", "method": "float", "versions": _common.versions()}
    try:
        import torch
        from transformers import AutoModelForCausalLM

        with timer.measure("load"):
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        with timer.measure("eval"):
            result["perplexity"] = _common.score(model, args)
        result["status"] = "ok"
    except Exception as exc:  # the benchmark records a peer's failure instead of crashing
        _common.record_failure(result, exc)
    return _common.finish(args, result, timer)


if __name__ == "__main__":
    sys.exit(main())
