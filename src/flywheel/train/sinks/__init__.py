"""Metric sinks: where a run's metrics go besides its JSONL file (which is always written).

One small protocol, `MetricSink` (`log(step, scalars)`, `close()`), one module per sink:
tensorboard.py, wandb_sink.py, mlflow_sink.py. `open_sinks` builds the ones a config's
`log.loggers` lists; train/metrics.py's MetricsWriter writes the JSONL row and fans out.
Each sink imports its package when opened, never at import time (they are extras).

A run's sinks remember their run ids in `<jsonl stem>.sinks.json` beside the JSONL file
(`{"wandb": {"id"}, "mlflow": {"tracking_uri", "run_id"}}`), so a resumed run logs into the
same W&B and MLflow run rather than starting another.
"""

from __future__ import annotations

from flywheel.train.sinks.base import MetricSink, SinkRun, flat, missing_extra, scalars

__all__ = ["MetricSink", "SinkRun", "flat", "missing_extra", "open_sinks", "scalars"]


def open_sinks(run: SinkRun) -> list[MetricSink]:
    """The sinks `run.log.loggers` lists besides jsonl, opened in that order; TrainError names
    the extra to install when a sink's package is missing (nothing is left open then)."""
    sinks: list[MetricSink] = []
    try:
        for name in dict.fromkeys(run.log.loggers):  # in order, each once
            if name == "tensorboard":
                from flywheel.train.sinks.tensorboard import TensorBoardSink
                sinks.append(TensorBoardSink(run))
            elif name == "wandb":
                from flywheel.train.sinks.wandb_sink import WandbSink
                sinks.append(WandbSink(run))
            elif name == "mlflow":
                from flywheel.train.sinks.mlflow_sink import MlflowSink
                sinks.append(MlflowSink(run))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
