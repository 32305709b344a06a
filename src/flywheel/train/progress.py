"""A rich progress bar for step loops: step/total, a headline metric (loss, reward...),
tokens/s, elapsed and ETA."""

from __future__ import annotations

from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)


class StepProgress:
    def __init__(self, total: int, start: int = 0, enabled: bool = True, description: str = "train",
                 metric: str = "loss"):
        self.total, self.start, self.enabled, self.description = total, start, enabled, description
        self.metric = metric
        self._progress = self._task = None

    def __enter__(self) -> "StepProgress":
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn(self.metric + " {task.fields[loss]}"), TextColumn("{task.fields[speed]} tok/s"),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
            self._progress.__enter__()
            self._task = self._progress.add_task(self.description, total=self.total, completed=self.start,
                                                 loss="-", speed="-")
        return self

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=f"{loss:.4f}", speed=f"{tokens_per_s:,.0f}")

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
