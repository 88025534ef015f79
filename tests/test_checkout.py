"""`python -m pytest` from the repository root puts the root on sys.path; the top-level
`kernels/` folder (installed as `quantlab.kernels`) must not then resolve as a top-level
`kernels` package, which transformers takes for Hugging Face's (quantlab.checkout)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_top_level_kernels_is_not_this_checkout():
    spec = importlib.util.find_spec("kernels")
    assert spec is None or spec.origin is None or Path(spec.origin).resolve().parent != REPO / "kernels", spec


def test_python_m_pytest_from_the_root():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_checkout.py::test_top_level_kernels_is_not_this_checkout"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
