"""Progress of long work: a rich bar on a terminal, plain lines elsewhere.

StepProgress is the bar of step loops (step/total, a headline metric, tokens/s, elapsed, ETA).
When stdout is not a terminal (a log piped to a file, CI), a bar draws nothing until the end, so
the same object prints a plain line instead every `every` seconds (LineProgress), e.g.

    sft: 1200/3000 (40%), loss 0.4123, 12,345 tok/s, 62 s elapsed, eta 93 s
"""

from __future__ import annotations

import sys
import time
from typing import Callable

from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

EVERY_S = 10.0  # seconds between two plain progress lines


def _flushed_print(line: str) -> None:
    print(line, flush=True)  # a piped stdout is block-buffered: a progress line must reach the log now


def _duration(seconds: float) -> str:
    """62.4 -> '62 s'; 930 -> '15.5 min'."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


class LineProgress:
    """Plain progress lines for logs. `update(done, detail)` prints a line when `every` seconds
    (of `clock`) have passed since the start or since the last line; `close()` prints a closing
    line when any line was printed before and the count moved since (work shorter than `every`
    stays silent). A line: `label: done/total (pct)[, detail], X s elapsed[, eta Y s]`."""

    def __init__(self, label: str, total: int | None, *, start: int = 0, every: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic, write: Callable[[str], None] = _flushed_print):
        self.label, self.total, self.every, self.clock, self.write = label, total, every, clock, write
        self.start = self.done = start
        self.detail = ""
        self.t0 = self._last = clock()
        self.lines = 0  # lines printed so far
        self._printed_at: int | None = None  # `done` when the last line was printed

    def line(self, now: float) -> str:
        elapsed = now - self.t0
        count = f"{self.done:,}" if self.total is None else f"{self.done:,}/{self.total:,}"
        if self.total:
            count += f" ({100 * self.done / self.total:.0f}%)"
        parts = [f"{self.label}: {count}"] + ([self.detail] if self.detail else []) + [f"{_duration(elapsed)} elapsed"]
        rate = (self.done - self.start) / elapsed if elapsed > 0 else 0.0
        if self.total is not None and rate > 0 and self.done < self.total:
            parts.append(f"eta {_duration((self.total - self.done) / rate)}")
        return ", ".join(parts)

    def update(self, done: int, detail: str = "") -> None:
        self.done, self.detail = done, detail or self.detail
        now = self.clock()
        if now - self._last >= self.every:
            self._emit(now)

    def close(self) -> None:
        if self.lines and self._printed_at != self.done:
            self._emit(self.clock())

    def _emit(self, now: float) -> None:
        self.write(self.line(now))
        self._last, self._printed_at = now, self.done
        self.lines += 1


def is_terminal(stream=None) -> bool:
    """Whether `stream` (default sys.stdout) is a terminal that can draw a bar."""
    stream = stream if stream is not None else sys.stdout
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or not a real file
        return False


class StepProgress:
    """A rich bar on a terminal; with `plain` (default: stdout is not a terminal) a LineProgress."""

    def __init__(self, total: int, start: int = 0, enabled: bool = True, description: str = "train",
                 metric: str = "loss", *, plain: bool | None = None, every: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic, write: Callable[[str], None] = _flushed_print):
        self.total, self.start, self.enabled, self.description = total, start, enabled, description
        self.metric = metric
        self.plain = (not is_terminal()) if plain is None else plain
        self._line_args = dict(start=start, every=every, clock=clock, write=write)
        self._progress = self._task = self._lines = None

    def __enter__(self) -> "StepProgress":
        if self.enabled and self.plain:
            self._lines = LineProgress(self.description, self.total, **self._line_args)
        elif self.enabled:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn(self.metric + " {task.fields[loss]}"), TextColumn("{task.fields[speed]} tok/s"),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
            self._progress.__enter__()
            self._task = self._progress.add_task(self.description, total=self.total, completed=self.start,
                                                 loss="-", speed="-")
        return self

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self._lines is not None:
            self._lines.update(step, f"{self.metric} {loss:.4f}, {tokens_per_s:,.0f} tok/s")
        elif self._progress is not None:
            self._progress.update(self._task, completed=step, loss=f"{loss:.4f}", speed=f"{tokens_per_s:,.0f}")

    def __exit__(self, *exc) -> None:
        if self._lines is not None:
            self._lines.close()
        elif self._progress is not None:
            self._progress.__exit__(*exc)


class CountProgress:
    """Progress of `total` items (episodes, tasks) with a detail text ("412 solved"): a transient
    rich bar on a terminal `console`, plain LineProgress lines with `plain` (default: the console
    is not a terminal). `update(done, detail)`; use as a context manager."""

    def __init__(self, label: str, total: int, console=None, *, plain: bool | None = None, every: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic, write: Callable[[str], None] = _flushed_print):
        self.label, self.total, self.console = label, total, console
        terminal = console.is_terminal if console is not None else is_terminal()
        self.plain = (not terminal) if plain is None else plain
        self._lines = LineProgress(label, total, every=every, clock=clock, write=write) if self.plain else None
        self._progress = self._task = None

    def __enter__(self) -> "CountProgress":
        if self._lines is None:
            self._progress = Progress(TextColumn(self.label), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
                                      console=self.console, transient=True)
            self._progress.__enter__()
            self._task = self._progress.add_task(self.label, total=self.total, detail="")
        return self

    def update(self, done: int, detail: str = "") -> None:
        if self._lines is not None:
            self._lines.update(done, detail)
        else:
            self._progress.update(self._task, completed=done, detail=detail)

    def __exit__(self, *exc) -> None:
        if self._lines is not None:
            self._lines.close()
        else:
            self._progress.__exit__(*exc)
