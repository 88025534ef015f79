"""Quantization algorithms: recipe stage name → engine adapter."""

from __future__ import annotations

from quantlab.algorithms.rtn import RTN
from quantlab.engine.sequential import LayerAlgorithm
from quantlab.recipe import StageEntry


def build_algorithm(entry: StageEntry) -> LayerAlgorithm:
    config = entry.config
    if entry.kind == "rtn":
        return RTN(scheme=config.weights, ignore=config.ignore)
    raise NotImplementedError(f"stage {entry.kind!r} has no algorithm")
