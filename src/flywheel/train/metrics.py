"""A run's metrics: the JSONL file always (sinks/jsonl.py), fanned out to the sinks its
config's `log.loggers` lists (TensorBoard, W&B, MLflow: train/sinks/).

JSONL is the record: a sink that fails while logging (a tracking server gone, a disk full
under its folder) is warned about once and dropped, and training goes on; a sink that
cannot open (its package missing) stops the run before it trains, naming the extra."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Sequence

from pydantic import BaseModel

from flywheel.config import SinksConfig
from flywheel.train.sinks import MetricSink, SinkRun, open_sinks, scalars
from flywheel.train.sinks.jsonl import JsonlSink, drop_rows_after, read_metrics

__all__ = ["MetricsWriter", "drop_rows_after", "read_metrics"]


class MetricsWriter:
    def __init__(self, path: str | Path, start_step: int = 0, sinks: Sequence[MetricSink] = ()):
        """path: the JSONL file; start_step: the checkpoint step a resumed run starts after (its
        rows past it are moved aside, sinks/jsonl.py); sinks: opened ones, closed with this."""
        self.path = Path(path)
        self._jsonl = JsonlSink(self.path, start_step)
        self._sinks = list(sinks)

    @classmethod
    def for_run(cls, path: str | Path, log: SinksConfig, start_step: int = 0,
                config: BaseModel | dict[str, Any] | None = None, run_name: str | None = None) -> MetricsWriter:
        """The JSONL file at `path` and the sinks `log.loggers` lists, their files beside it;
        `config` (the run's config) is logged once as the W&B config / MLflow params."""
        path = Path(path)
        hparams = config.model_dump(mode="json") if isinstance(config, BaseModel) else dict(config or {})
        run = SinkRun(folder=path.parent, log=log, run_name=log.run_name or run_name or path.parent.resolve().name,
                      config=hparams, start_step=start_step, ids_file=path.with_name(path.stem + ".sinks.json"))
        sinks = open_sinks(run)
        try:
            return cls(path, start_step, sinks)
        except BaseException:
            for sink in sinks:
                sink.close()
            raise

    def log(self, step: int, **metrics) -> None:
        self._jsonl.log(step, metrics)
        numbers = scalars(metrics)
        for sink in list(self._sinks):
            try:
                sink.log(step, numbers)
            except Exception as e:  # noqa: BLE001 - any sink failure: JSONL goes on
                self._sinks.remove(sink)
                warnings.warn(f"metrics sink {type(sink).__name__} failed at step {step} and is dropped "
                              f"(metrics still go to {self.path.name}): {type(e).__name__}: {e}")
                _close_quietly(sink)

    def close(self) -> None:
        self._jsonl.close()
        for sink in self._sinks:
            _close_quietly(sink)
        self._sinks = []


def _close_quietly(sink: MetricSink) -> None:
    try:
        sink.close()
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"metrics sink {type(sink).__name__} failed to close: {type(e).__name__}: {e}")
