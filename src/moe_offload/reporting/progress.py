"""One progress bar style for every long command: on stderr, only on a terminal, gone when done."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def progress_bar(extra_columns: tuple = ()) -> Progress:
    stderr = Console(stderr=True)
    return Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    *extra_columns, TimeRemainingColumn(), console=stderr, transient=True,
                    disable=not stderr.is_terminal)
