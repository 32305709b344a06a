"""What every sink shares: the protocol, the run it logs (SinkRun), small helpers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from flywheel.config import SinksConfig
from flywheel.errors import TrainError
from flywheel.files import atomic_write

DEFAULT_PROJECT = "flywheel"


class MetricSink(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None:
        """One step's numbers (finite or not; no bools, no strings), keyed as in metrics.jsonl."""

    def close(self) -> None:
        """Flush and finish the run (W&B finish, MLflow end of run); called once."""


@dataclass
class SinkRun:
    """What every sink needs to know of the run it logs."""

    folder: Path  # where sink files go: tensorboard/, wandb/, mlflow.db
    log: SinksConfig
    run_name: str  # log.run_name, else the output folder's name
    config: dict[str, Any] = field(default_factory=dict)  # the run's config (model_dump(mode="json"))
    start_step: int = 0  # the checkpoint step a resumed run starts after; 0 for a fresh run
    ids_file: Path | None = None  # `<jsonl stem>.sinks.json`: the sinks' run ids, for resume

    @property
    def project(self) -> str:
        return self.log.project or DEFAULT_PROJECT

    def saved_id(self, sink: str) -> dict[str, Any]:
        """What `save_id` stored for `sink` in an earlier process of this run ({} if none)."""
        if self.ids_file is None or not self.ids_file.exists():
            return {}
        try:
            return json.loads(self.ids_file.read_text(encoding="utf-8")).get(sink, {})
        except (OSError, ValueError):
            return {}

    def save_id(self, sink: str, value: dict[str, Any]) -> None:
        if self.ids_file is None:
            return
        saved = json.loads(self.ids_file.read_text(encoding="utf-8")) if self.ids_file.exists() else {}
        atomic_write(self.ids_file, json.dumps({**saved, sink: value}, indent=1).encode())


def missing_extra(logger: str, package: str, extra: str) -> TrainError:
    return TrainError(f"log.loggers lists {logger!r} but the {package} package is not installed: "
                      f"pip install 'flywheel[{extra}]' (or remove {logger!r} from log.loggers)")


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row that sinks take: ints and floats (NaN and inf kept), not
    bools, strings, lists or None."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1e-4}} -> {"train.lr": 1e-4}: a nested config as MLflow params."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat(v, key + "."))
        else:
            out[key] = v
    return out
