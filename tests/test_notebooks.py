"""Every notebook in notebooks/ executes top to bottom at small settings (QUANTLAB_NOTEBOOK_SMALL=1)
on the real SmolLM2, as a job of the shared run pool (tests/smollm2_runs.py)."""

from __future__ import annotations

import pytest

from smollm2_runs import NOTEBOOK_JOBS


@pytest.mark.slow
@pytest.mark.smollm2(*NOTEBOOK_JOBS)
@pytest.mark.parametrize("job", NOTEBOOK_JOBS)
def test_notebook_executes(smollm2, job):
    nb = smollm2(job)
    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
              if o.get("output_type") == "error"]
    assert errors == []
    assert all(cell.get("execution_count") for cell in nb.cells if cell.cell_type == "code")
