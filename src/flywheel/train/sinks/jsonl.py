"""The JSONL metrics file: always written, and what everything else reads (a resumed run, the
reports, a fine-tuning job's `metrics` events, the dashboard). One JSON object per line:
`{"step", "time", **metrics}`, strings and lists included."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class JsonlSink:
    def __init__(self, path: str | Path, start_step: int = 0):
        """start_step: the checkpoint step the run resumes from, 0 for a fresh start. Rows an
        earlier process wrote past it are moved aside first (`drop_rows_after`), so the file
        reads as one uninterrupted run; a fresh start keeps none (no checkpoint holds step 0,
        so an earlier process's step-0 evaluation is its own)."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        drop_rows_after(self.path, start_step if start_step > 0 else -1)
        self._file = open(self.path, "a", buffering=1)  # line-buffered: a kill loses at most a line

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self._file.write(json.dumps({"step": step, "time": round(time.time(), 3), **metrics}) + "\n")

    def close(self) -> None:
        self._file.close()


def drop_rows_after(path: str | Path, step: int) -> int:
    """Move the rows of a JSONL log whose "step" is past `step` (and torn lines) to
    `<name>.superseded.jsonl` beside it, keeping the rest in order; returns how many moved.
    A run killed after its last checkpoint logged steps that its resumed run logs again;
    nothing is deleted. The log is rewritten through a temporary file and a rename."""
    path = Path(path)
    if not path.exists():
        return 0
    kept, moved = [], []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if not line.strip():
            continue
        try:
            row_step = json.loads(line).get("step")
        except (json.JSONDecodeError, AttributeError):
            row_step = None
        is_kept = isinstance(row_step, (int, float)) and row_step <= step
        (kept if is_kept else moved).append(line if line.endswith("\n") else line + "\n")
    if not moved:
        return 0
    with open(path.with_name(path.stem + ".superseded.jsonl"), "a", encoding="utf-8") as f:
        f.writelines(moved)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    tmp.replace(path)
    return len(moved)


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a metrics file; a torn last line (a killed writer) is ignored."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
