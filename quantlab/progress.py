"""Rich progress bars and messages on stderr, so stdout stays clean for data."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

# plain text in notebooks too: rich's Jupyter rendering of a live progress display re-renders
# every refresh as HTML and can exhaust the recursion limit on a long step
console = Console(stderr=True, force_jupyter=False)


@contextlib.contextmanager
def step(description: str, total: int | None = None) -> Iterator[Callable[[int, int], None]]:
    """A progress bar for one long step; yields `update(done, total)`."""
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=False,
    ) as progress:
        task = progress.add_task(description, total=total)

        def update(done: int, new_total: int) -> None:
            progress.update(task, completed=done, total=new_total)

        yield update
