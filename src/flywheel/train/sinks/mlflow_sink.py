"""One MLflow run per training run, through MlflowClient (no global active run, so a cycle's
stages in one process never mix).

The store: `log.mlflow_tracking_uri`, else MLFLOW_TRACKING_URI, else a SQLite database in the
run's folder (`sqlite:///<folder>/mlflow.db`). mlflow-skinny 3.x refuses its `./mlruns` file
store unless MLFLOW_ALLOW_FILE_STORE=true (it is in maintenance mode); SQLite needs only
SQLAlchemy and Alembic, which flywheel already depends on, and no server. `mlflow ui
--backend-store-uri sqlite:///<folder>/mlflow.db` (the full mlflow package) shows it.

MLflow metric names allow letters, digits, `_ - . / : ` and space: any other character
becomes `_`, and `@` becomes `_at_` (`eval/pass@4` is `eval/pass_at_4`). The run's config is
logged once as params, flattened (`train.lr`), values cut at MLflow's 6000 characters.
"""

from __future__ import annotations

import os
import re
import time

from flywheel.train.sinks.base import SinkRun, flat, missing_extra

_BAD_CHARS = re.compile(r"[^/\w.\- :]")
MAX_VALUE = 6000  # MLflow's limit on a param's value
BATCH = 100  # MLflow's limit on params per log_batch call (metrics: 1000)


def metric_name(key: str) -> str:
    return _BAD_CHARS.sub("_", key.replace("@", "_at_"))


def tracking_uri(run: SinkRun) -> str:
    if run.log.mlflow_tracking_uri:
        return run.log.mlflow_tracking_uri
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(run.folder / 'mlflow.db').resolve()}"


class MlflowSink:
    def __init__(self, run: SinkRun):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise missing_extra("mlflow", "mlflow-skinny", "mlflow") from None
        run.folder.mkdir(parents=True, exist_ok=True)
        self.uri = tracking_uri(run)
        self._client = MlflowClient(self.uri)
        saved = run.saved_id("mlflow")
        if saved.get("tracking_uri") == self.uri and self._exists(saved.get("run_id")):
            self.run_id = saved["run_id"]  # a resumed run: its params were logged by the first process
            self._client.update_run(self.run_id, status="RUNNING")
        else:
            created = self._client.create_run(self._experiment(run.project), run_name=run.run_name)
            self.run_id = created.info.run_id
            self._log_params(run.config)
            run.save_id("mlflow", {"tracking_uri": self.uri, "run_id": self.run_id})

    def _exists(self, run_id: str | None) -> bool:
        from mlflow.exceptions import MlflowException

        if not run_id:
            return False
        try:
            self._client.get_run(run_id)
        except MlflowException:
            return False
        return True

    def _experiment(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        found = self._client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self._client.create_experiment(name)
        except MlflowException:  # another process created it meanwhile
            return self._client.get_experiment_by_name(name).experiment_id

    def _log_params(self, config: dict) -> None:
        from mlflow.entities import Param

        params = [Param(metric_name(k)[:250], str(v)[:MAX_VALUE]) for k, v in flat(config).items()]
        for i in range(0, len(params), BATCH):
            self._client.log_batch(self.run_id, params=params[i:i + BATCH])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        metrics = [Metric(metric_name(k), v, ms, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)
