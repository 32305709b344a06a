"""Metrics sinks: a JSONL file always, TensorBoard when asked and installed."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path


class MetricsWriter:
    def __init__(self, path: str | Path, tensorboard_dir: str | Path | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)  # line-buffered: a kill loses at most a line
        self._tb = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(tensorboard_dir))
            except ImportError:
                warnings.warn("log.tensorboard is set but tensorboard is not installed "
                              "(pip install 'flywheel[tensorboard]'); metrics go to JSONL only")

    def log(self, step: int, **metrics) -> None:
        record = {"step": step, "time": round(time.time(), 3), **metrics}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a metrics file; a torn last line (a killed writer) is ignored."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
