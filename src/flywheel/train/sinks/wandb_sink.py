"""A Weights & Biases run: offline (files under `<folder>/wandb`, `wandb sync` uploads them)
unless WANDB_API_KEY is set; WANDB_MODE, when set, decides instead.

The run's id is kept (SinkRun.save_id), so a resumed training run logs into the same W&B run
(`resume="allow"`; offline, each process writes its own `offline-run-*-<id>` folder and
`wandb sync` joins them). Rows a killed process logged past its checkpoint stay in W&B beside
the resumed process's rows for the same steps (metrics.jsonl moves the old ones aside)."""

from __future__ import annotations

import os
import secrets
import string

from flywheel.train.sinks.base import SinkRun, missing_extra


def wandb_mode() -> str | None:
    """None when WANDB_MODE is set (wandb reads it), else online with a key, offline without."""
    if os.environ.get("WANDB_MODE"):
        return None
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def new_run_id() -> str:
    """8 characters of [a-z0-9], as W&B makes its own."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class WandbSink:
    def __init__(self, run: SinkRun):
        try:
            import wandb
        except ImportError:
            raise missing_extra("wandb", "wandb", "wandb") from None
        run_id = run.saved_id("wandb").get("id") or new_run_id()
        run.folder.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=run.project, name=run.run_name, dir=str(run.folder), config=run.config, id=run_id,
            resume="allow", mode=wandb_mode(), reinit="create_new",  # a cycle runs stages in one process
            settings=wandb.Settings(console="off"))  # the run's own log stays the recipe's
        run.save_id("wandb", {"id": run_id})

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()
