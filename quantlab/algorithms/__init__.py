"""Quantization algorithms: recipe stage name → engine adapter."""

from __future__ import annotations

from quantlab.algorithms.awq import AWQ
from quantlab.algorithms.gptq import GPTQ
from quantlab.algorithms.act_ranges import ActRanges
from quantlab.algorithms.rtn import RTN
from quantlab.algorithms.smoothquant import SmoothQuant
from quantlab.engine.sequential import LayerAlgorithm
from quantlab.recipe import StageEntry


def build_algorithm(entry: StageEntry) -> LayerAlgorithm:
    config = entry.config
    if entry.kind == "rtn":
        return RTN(scheme=config.weights, ignore=config.ignore)
    if entry.kind == "gptq":
        return GPTQ(scheme=config.weights, damp_percent=config.damp_percent, block_size=config.block_size,
                    act_order=config.act_order, static_groups=config.static_groups,
                    true_sequential=config.true_sequential, mse_clip=config.mse_clip, ignore=config.ignore)
    if entry.kind == "awq":
        return AWQ(scheme=config.weights, grid=config.grid, duo_scaling=config.duo_scaling, clip=config.clip,
                   clip_grid=config.clip_grid, max_shrink=config.max_shrink, clip_skip=config.clip_skip,
                   max_tokens=config.max_tokens, ignore=config.ignore, objective=config.objective,
                   block_tokens=config.block_tokens)
    if entry.kind == "smoothquant":
        return SmoothQuant(alpha=config.alpha, search=config.search, grid=config.grid, weights=config.weights,
                           activations=config.activations, max_tokens=config.max_tokens, skip=config.skip)
    if entry.kind == "act_ranges":
        return ActRanges(activations=config.activations, kv_cache=config.kv_cache, ignore=config.ignore)
    raise NotImplementedError(f"stage {entry.kind!r} has no algorithm")
