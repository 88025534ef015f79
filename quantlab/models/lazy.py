"""Lazy loading: the model skeleton without weights, each decoder layer read from the checkpoint
when the engine reaches it and dropped after.

`from_pretrained` puts the whole model in host RAM (145 GB for a 72B model in bf16) before
anything else can happen. Quantization never needs that: the engine works on one decoder
layer at a time. So the skeleton is built with its parameters on the meta device (buffers
such as RoPE tables are computed as usual), the parts outside the decoder layers (embeddings,
final norm, lm_head: what capture and the head need) are read from the safetensors files
right away, and `CheckpointLayers.load` reads one layer's tensors, memory-mapped, straight
onto the compute device; `release` puts that layer back on the meta device. Host memory is
then the non-layer weights plus one layer, whatever the depth of the model.

Each tensor is read under the name the family's checkpoints use (`ArchSpec.to_checkpoint`:
Mixtral's `block_sparse_moe.experts.{e}.w1`, …) and cast to the recipe's dtype exactly as
`from_pretrained` casts it, so a lazily loaded layer holds the same bits as an eagerly loaded
one (tests/test_lazy.py). A checkpoint that is not safetensors (GGUF, `.bin`) or whose names
do not all map is loaded eagerly instead (`lazy_model` returns None).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from quantlab.errors import UserError
from quantlab.file_checks import check_safetensors, read_json_object
from quantlab.models.arch import ArchSpec, arch_spec_for
from quantlab.models.moe import unfuse_experts

INDEX = "model.safetensors.index.json"


def checkpoint_files(location: Path) -> dict[str, Path] | None:
    """Tensor name → safetensors file of a checkpoint directory (None: no safetensors)."""
    if (location / INDEX).is_file():
        index = location / INDEX
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"{index}: not a safetensors index (JSON with a weight_map)")
        files = {str(name): location / str(fname) for name, fname in weight_map.items()}
        for path in dict.fromkeys(files.values()):
            if not path.resolve().is_relative_to(location.resolve()) or not path.is_file():
                raise UserError(f"{index}: lists {path.name!r}, which is not a file in {location}")
            check_safetensors(path)
        return files
    single = location / "model.safetensors"
    if not single.is_file():
        return None
    check_safetensors(single)
    with safe_open(single, "pt") as handle:
        return {name: single for name in handle.keys()}


def read_checkpoint(location: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors checkpoint, as stored."""
    files = checkpoint_files(location)
    if files is None:
        raise FileNotFoundError(f"{location}: no model.safetensors or {INDEX}")
    tensors: dict[str, torch.Tensor] = {}
    for path in dict.fromkeys(files.values()):
        tensors.update(load_file(path))
    return tensors


def read_tensors(files: dict[str, Path], names: list[str], dtype: torch.dtype | None,
                 device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """`names` read from their files onto `device`, floating-point ones cast to `dtype` (None:
    as stored). Each
    file is opened (memory-mapped) once per call and closed after, so its pages stop counting
    toward the process's memory once the tensors are copied out."""
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    out = {}
    for path, members in by_file.items():
        with safe_open(path, "pt", device=str(device)) as handle:
            for name in members:
                t = handle.get_tensor(name)
                out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def _assign(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Replace `module`'s parameters by `tensors` (module-relative names), keeping them frozen."""
    for name, tensor in tensors.items():
        owner, _, leaf = name.rpartition(".")
        target = module.get_submodule(owner) if owner else module
        target._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


# Reads model parameters by their model names onto a device: a checkpoint's tensors, or the
# canonical form's codes dequantized (`quantlab.quant.canonical.canonical_model`).
Reader = Callable[[list[str], "torch.device | str"], dict[str, torch.Tensor]]


@dataclass
class CheckpointLayers:
    """The decoder layers of a lazily built model, read one at a time by `read`."""

    model: nn.Module
    spec: ArchSpec
    read: Reader

    def __len__(self) -> int:
        return len(self.spec.decoder_layers(self.model))

    def load(self, index: int, device: torch.device) -> nn.Module:
        """Decoder layer `index` with its weights read onto `device`."""
        layer = self.spec.decoder_layers(self.model)[index]
        prefix = f"{self.spec.layers}.{index}."
        names = [name for name, _ in layer.named_parameters()]
        tensors = self.read([prefix + name for name in names], device)
        _assign(layer, {name: tensors[prefix + name] for name in names})
        return layer.to(device)  # buffers, if any

    def release(self, index: int) -> None:
        """Drop layer `index`'s weights (back to the meta device: shapes only)."""
        self.spec.decoder_layers(self.model)[index].to("meta")


def skeleton(config: Any, dtype: torch.dtype, trust_remote_code: bool = False) -> nn.Module:
    """The model of `config` with every parameter on the meta device (buffers such as RoPE
    tables computed), experts unfused as the engine wants them."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with init_empty_weights(include_buffers=False), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    unfuse_experts(model)
    return model.eval()


def stored_parameters(model: nn.Module) -> list[str]:
    """The parameters a checkpoint stores: all but a tied lm_head (the embedding's copy)."""
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    return [name for name, _ in model.named_parameters() if name not in tied]


def load_outside_layers(model: nn.Module, read: Reader) -> CheckpointLayers:
    """Read every parameter outside the decoder layers (embeddings, final norm, lm_head; a tied
    lm_head is tied again) and return the layers' store."""
    spec = arch_spec_for(model)
    outside = [name for name in stored_parameters(model) if not name.startswith(f"{spec.layers}.")]
    _assign(model, read(outside, "cpu"))
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    return CheckpointLayers(model, spec, read)


def lazy_model(location: Path, dtype: torch.dtype,
               trust_remote_code: bool = False) -> tuple[nn.Module, CheckpointLayers] | None:
    """The model with everything but its decoder layers loaded, and the layers' reader; None
    when the checkpoint cannot be read lazily (not safetensors, or names that do not map)."""
    from transformers import AutoConfig

    files = checkpoint_files(location)
    if files is None:
        return None
    model = skeleton(AutoConfig.from_pretrained(location, trust_remote_code=trust_remote_code), dtype,
                     trust_remote_code)
    spec = arch_spec_for(model)
    if not all(spec.to_checkpoint(name) in files for name in stored_parameters(model)):
        return None

    def read(names: list[str], device: torch.device | str) -> dict[str, torch.Tensor]:
        stored = {name: spec.to_checkpoint(name) for name in names}
        tensors = read_tensors(files, list(stored.values()), dtype, device)
        return {name: tensors[ckpt] for name, ckpt in stored.items()}

    return model, load_outside_layers(model, read)
