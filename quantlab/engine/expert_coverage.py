"""Expert coverage: how many calibration tokens the router sent to each expert, and what each
stage did for an expert that got none.

The peers' most common MoE failure is an expert that calibration never reaches and that is
then quantized from nothing (or silently skipped). quantlab always quantizes every expert;
this record says which ones had no data and how they were handled, per layer, so a user can
see it and rerun with `calibration.all_experts` (every expert's statistics see every token,
routing unchanged) or more calibration samples.
"""

from __future__ import annotations

from typing import Any

# What each weight stage does for an expert no calibration token reached.
FALLBACK = {
    "gptq": "GPTQ has no Hessian for it: round-to-nearest of its weights",
    "awq": "AWQ searches no scale or clip for it: its group's scales are folded in, then round-to-nearest",
    "rtn": "round-to-nearest needs no calibration data",
}


def expert_coverage(routed: dict[str, list[int]], all_experts: bool, stages: list[str]) -> dict[str, Any]:
    """`routed`: per experts module (`model.layers.N.mlp.experts`), tokens routed to each expert."""
    layers = []
    for module, counts in routed.items():
        unreached = [e for e, n in enumerate(counts) if n == 0]
        layers.append({"module": module, "tokens": counts, "total": sum(counts), "min": min(counts),
                       "max": max(counts), "unreached": unreached})
    unreached = sum(len(row["unreached"]) for row in layers)
    fallbacks = {} if all_experts or not unreached else {s: FALLBACK[s] for s in stages if s in FALLBACK}
    return {"all_experts": all_experts, "experts": sum(len(row["tokens"]) for row in layers),
            "experts_unreached": unreached, "fallbacks": fallbacks, "layers": layers,
            "counted": "routed tokens in each quantized layer's calibration forward"}
