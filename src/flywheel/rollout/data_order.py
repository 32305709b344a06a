"""The order a run reads its examples or tasks in: a seeded shuffle per epoch with a cursor."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DataOrder:
    """A seeded shuffle per epoch with a cursor, so a resumed run reads exactly the examples
    an uninterrupted run would have read next. State: (epoch, cursor)."""

    size: int
    seed: int
    epoch: int = 0
    cursor: int = 0

    def __post_init__(self):
        if self.size < 1:
            raise ValueError("DataOrder needs at least one example")
        self._perm = self._permutation(self.epoch)

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if self.cursor == self.size:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
            k = min(n - len(out), self.size - self.cursor)
            out.extend(self._perm[self.cursor:self.cursor + k])
            self.cursor += k
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "size": self.size, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != self.size or state["seed"] != self.seed:
            raise ValueError(f"checkpoint was written for {state['size']} examples with seed {state['seed']}, "
                             f"this run has {self.size} with seed {self.seed}: the data changed")
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._perm = self._permutation(self.epoch)
