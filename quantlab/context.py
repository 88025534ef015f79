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
    _cache: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def resolved(self) -> sources.ResolvedModel:
        with step(f"resolving model {self.recipe.model.id}"):
            return sources.resolve(self.recipe.model)

    @cached_property
    def tokenizer(self) -> Any:
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

    @property
    def dtype(self) -> torch.dtype:
        return sources.DTYPES[self.recipe.model.dtype]
