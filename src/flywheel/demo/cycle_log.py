"""What the demo shows of a cycle: one line per stage on the console, everything in a file.

run_cycle logs through one callback: its own stage lines (prefixed with the cycle id, `c3: ...`)
and, passed through, the recipes' lines (SFT / RL step metrics, data reports: no prefix). An RL
stage's metric lines alone wrap to a dozen console lines per cycle. CycleLog writes every line
to a file (the metrics are also in each stage's metrics.jsonl) and echoes only the stage lines:
curation, each training stage started or skipped, evaluation, waiting, warnings. The gate's
decision is echoed by the demo itself from the cycle's state, as its deciding reason.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Callable

_CYCLE = re.compile(r"c\d+: ")
# cycle lines the console leaves to the file: the cycle's start, the SFT data mix, each model's
# scores (the day line shows production's), the gate's full reasons (the demo prints the
# deciding one), the outcome (the day line says it) and housekeeping
_DETAIL = re.compile(r"(started from |sft mix: |incumbent: |candidate: |gate: |rejected|promoted|nothing to train"
                     r"|retention freed |.* \(all listed in )")


def stage_line(message: str) -> bool:
    """Whether a cycle log message goes to the console: a stage line of the cycle (`cN: ...`),
    not one of its details, and never a recipe's own line (step metrics, data reports)."""
    m = _CYCLE.match(message)
    return bool(m) and not _DETAIL.match(message, m.end())


class CycleLog:
    """A log callback for run_cycle: appends every message to `path` with a timestamp, echoes
    stage lines with `echo`."""

    def __init__(self, path: Path, echo: Callable[[str], None], clock: Callable[[], float] = time.time):
        self.path, self.echo, self.clock = Path(path), echo, clock
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, message: str) -> None:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.clock()))
        with self.path.open("a", encoding="utf-8") as f:
            f.write(f"{stamp} {message}\n")
        if stage_line(message):
            self.echo(message)


def gate_line(cycle: str | None, outcome: str, why: str) -> str | None:
    """The console's line for a cycle's gate decision (its deciding reason), or None when the
    gate did not decide: a cycle that waited for more failures or had nothing to train, whose
    stage lines already said so."""
    return f"{cycle}: gate: {why}" if outcome in ("promoted", "rejected") else None
