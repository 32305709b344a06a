"""The weight-transport interface (kept small so Ray / NCCL / vLLM transports fit later)."""

from __future__ import annotations

import abc
from typing import Mapping

import torch


class WeightTransport(abc.ABC):
    @abc.abstractmethod
    def publish(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Make `tensors` the newest weights, tagged `version` (strictly increasing)."""

    @abc.abstractmethod
    def version(self) -> int:
        """The newest published version (-1 before the first publish); cheap to call often."""

    @abc.abstractmethod
    def read_into(self, dest: Mapping[str, torch.Tensor]) -> int:
        """Copy the newest weights into `dest` (same names and shapes); return their version.
        A reader never sees a mix of two versions."""

    def close(self) -> None:
        pass
