"""Validation results: each rule checked on each subject (a tensor name or config key).

A validator records every check, passed or failed, so `quantlab inspect` can print what was
verified and a broken export is rejected with a message that names the subject and the rule
(`model.layers.0.mlp.up_proj.qweight: dtype: expected int32, got float16`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from quantlab.errors import UserError


@dataclass(frozen=True)
class Check:
    rule: str
    subject: str
    ok: bool
    detail: str = ""

    def line(self) -> str:
        return f"{self.subject}: {self.rule}: {self.detail}" if self.detail else f"{self.subject}: {self.rule}"


class ExportInvalid(UserError):
    """An export that breaks a rule of its format."""


@dataclass
class Report:
    """What a validator found (`facts`) and every check it made (`checks`)."""

    format: str
    path: str
    facts: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    def check(self, rule: str, subject: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(rule, subject, bool(ok), "" if ok else detail))
        return bool(ok)

    def skip(self, rule: str, why: str) -> None:
        self.facts.setdefault("skipped", []).append(f"{rule}: {why}")

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    @property
    def ok(self) -> bool:
        return not self.failures

    def rule_counts(self) -> dict[str, tuple[int, int]]:
        """rule → (passed, failed), in first-seen order."""
        passed, failed = Counter(), Counter()
        for c in self.checks:
            (passed if c.ok else failed)[c.rule] += 1
        return {r: (passed[r], failed[r]) for r in dict.fromkeys(c.rule for c in self.checks)}

    def raise_if_invalid(self) -> None:
        bad = self.failures
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise ExportInvalid(f"{self.path}: not a valid {self.format} export: {bad[0].line()}{more}")

    # ------------------------------------------------------------------ helpers

    def tensor(self, tensors: dict[str, torch.Tensor], name: str, dtype: torch.dtype | tuple[torch.dtype, ...],
               shape: tuple[int, ...] | None) -> torch.Tensor | None:
        """Presence, dtype and shape of one tensor; returns it when present."""
        t = tensors.get(name)
        if not self.check("present", name, t is not None, "tensor is missing"):
            return None
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
        self.check("dtype", name, t.dtype in dtypes,
                   f"expected {' or '.join(str(d).removeprefix('torch.') for d in dtypes)}, "
                   f"got {str(t.dtype).removeprefix('torch.')}")
        if shape is not None:
            self.check("shape", name, tuple(t.shape) == tuple(shape),
                       f"expected {list(shape)}, got {list(t.shape)}")
        return t

    def key(self, mapping: dict[str, Any], key: str, where: str, expected: Any = ..., allowed: tuple = ()) -> Any:
        """Presence of a config key, optionally its exact value or one of `allowed`."""
        subject = f"{where}.{key}"
        if not self.check("config key", subject, key in mapping, "key is missing"):
            return None
        value = mapping[key]
        if expected is not ...:
            self.check("config value", subject, value == expected, f"expected {expected!r}, got {value!r}")
        elif allowed:
            self.check("config value", subject, value in allowed,
                       f"expected one of {', '.join(map(repr, allowed))}, got {value!r}")
        return value
