"""Learner and sampler in one process: publishing keeps references, reading copies."""

from __future__ import annotations

import threading
from typing import Mapping

import torch

from flywheel.weights.base import WeightTransport


class InProcessTransport(WeightTransport):
    def __init__(self):
        self._lock = threading.Lock()
        self._tensors: dict[str, torch.Tensor] = {}
        self._version = -1

    def publish(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        if version <= self._version:
            raise ValueError(f"versions must increase: got {version} after {self._version}")
        snapshot = {k: v.detach().clone() for k, v in tensors.items()}
        with self._lock:
            self._tensors, self._version = snapshot, version

    def version(self) -> int:
        return self._version

    def read_into(self, dest: Mapping[str, torch.Tensor]) -> int:
        with self._lock:
            tensors, version = self._tensors, self._version
        with torch.no_grad():
            for name, t in dest.items():
                t.copy_(tensors[name])
        return version
