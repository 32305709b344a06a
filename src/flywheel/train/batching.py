"""Data order and padding for token-level training batches."""

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


def pad_batch(seqs: list[list[int]], masks: list[list[int]], pad_id: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sequence. Returns input_ids (B, T), attention_mask (B, T)
    and target_mask (B, T): target_mask[b, t] = 1 where token t is trained."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), T), dtype=torch.long)
    tmask = torch.zeros((len(seqs), T), dtype=torch.long)
    for b, (s, m) in enumerate(zip(seqs, masks)):
        ids[b, :len(s)] = torch.tensor(s)
        attn[b, :len(s)] = 1
        tmask[b, :len(m)] = torch.tensor(m)
    return ids, attn, tmask
