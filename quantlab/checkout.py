"""A source checkout's root on `sys.path` — `python -m pytest` or `python -m quantlab` run from
it — exposes the checkout's top-level folders as packages. `kernels/`, which installs as
`quantlab.kernels`, would then pass for Hugging Face's `kernels` package, which transformers
probes for (`is_kernels_available`) and imports from. Entry points drop that root first;
quantlab itself is importable through its installation (`pip install -e .`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def drop_checkout_root() -> None:
    root = Path(__file__).resolve().parents[1]
    if not (root / "pyproject.toml").is_file() or not (root / "kernels").is_dir():
        return  # an installed copy: its parent holds no top-level folders of ours
    sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != root]
