"""TensorBoard event files in `<folder>/tensorboard`, one scalar per metric and step."""

from __future__ import annotations

from flywheel.train.sinks.base import SinkRun, missing_extra


class TensorBoardSink:
    def __init__(self, run: SinkRun):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise missing_extra("tensorboard", "tensorboard", "tensorboard") from None
        # purge_step: TensorBoard hides an earlier process's events past the resume point
        self._writer = SummaryWriter(str(run.folder / "tensorboard"),
                                     purge_step=run.start_step + 1 if run.start_step else None)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()
