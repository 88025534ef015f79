"""Hugging Face sharded safetensors: `model.safetensors`, or `model-0000i-of-0000n.safetensors`
plus `model.safetensors.index.json` (`metadata.total_size`, `weight_map`) when over the limit."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from quantlab.file_checks import check_safetensors, read_json_object
from quantlab.models.lazy import INDEX, read_checkpoint

DEFAULT_MAX_SHARD = 5 * 1024**3


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def save_sharded(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD) -> list[str]:
    """Greedy in insertion order (a Linear's tensors stay together); returns the file names."""
    if max_shard_bytes <= 0:
        raise ValueError("max_shard_bytes must be positive")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + nbytes(t) > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes(t)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata=meta)
        return ["model.safetensors"]
    files, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / fname, metadata=meta)
        files.append(fname)
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": sum(nbytes(t) for t in tensors.values())}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return files


def load_sharded(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) checkpoint; raises FileNotFoundError if none."""
    return read_checkpoint(path)


def check_index(report, path: Path) -> None:
    """The index names only files that exist and every tensor in them."""
    if not (path / INDEX).is_file():
        report.check("weights file", str(path / "model.safetensors"), (path / "model.safetensors").is_file(),
                     "neither model.safetensors nor an index file")
        return
    index = read_json_object(path / INDEX)
    wmap = index.get("weight_map", {})
    for fname in dict.fromkeys(wmap.values()):
        if report.check("shard exists", fname, (path / fname).is_file(), "listed in the index but missing"):
            from safetensors import safe_open

            check_safetensors(path / fname)
            with safe_open(path / fname, "pt") as fh:
                keys = set(fh.keys())
            listed = {k for k, v in wmap.items() if v == fname}
            report.check("index matches shard", fname, keys == listed,
                         f"index lists {len(listed)} tensors, shard holds {len(keys)}")
