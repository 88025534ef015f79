"""What every stage of one run shares: the recipe, the run directory, the device, and the
float model's source (loaded lazily, at most once per need)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from quantlab.models import sources
from quantlab.progress import step
from quantlab.recipe import Recipe
from quantlab.rundir import RunDir


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        from quantlab.errors import UserError

        raise UserError("device: 'cuda' requested but no CUDA device is available; use 'cpu' or 'auto'")
    return torch.device(name)


@dataclass
class RunContext:
    recipe: Recipe
    run: RunDir
    device: torch.device
    preloaded_tokenizer: Any = None  # the one preflight loaded to count the data's tokens
    _cache: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def resolved(self) -> sources.ResolvedModel:
        with step(f"resolving model {self.recipe.model.id}"):
            return sources.resolve(self.recipe.model)

    @cached_property
    def tokenizer(self) -> Any:
        if self.preloaded_tokenizer is not None:
            return self.preloaded_tokenizer
        return sources.load_tokenizer(self.recipe.model, self.resolved)

    def float_model(self) -> torch.nn.Module:
        """The unmodified float model; shared until a stage takes it to modify (`take_float_model`)."""
        if "float" not in self._cache:
            with step(f"loading {self.recipe.model.id}"):
                self._cache["float"] = sources.load_model(self.recipe.model, self.resolved)
        return self._cache["float"]

    def take_float_model(self) -> torch.nn.Module:
        """The float model for a stage that changes it in place; later stages reload."""
        model = self.float_model()
        del self._cache["float"]
        return model

    def float_layers(self) -> tuple[torch.nn.Module, Any]:
        """The float model with its decoder layers read on demand (`sources.load_for_quantize`),
        and their store; a model that can only be loaded whole (or is already loaded) is the
        shared float model, with store None. A lazily built model is never cached: it is cheap
        to rebuild, and a stage may change it."""
        if "float" not in self._cache:
            with step(f"loading {self.recipe.model.id}"):
                model, store = sources.load_for_quantize(self.recipe.model, self.resolved)
            if store is not None:
                return model, store
            self._cache["float"] = model
        return self._cache["float"], None

    def quantize_model(self) -> tuple[torch.nn.Module, Any]:
        """`float_layers` for the quantize stage, which changes the model in place (a shared
        float model is taken out of the cache: later stages reload)."""
        model, store = self.float_layers()
        return (self.take_float_model() if store is None else model), store

    @property
    def dtype(self) -> torch.dtype:
        return sources.DTYPES[self.recipe.model.dtype]
