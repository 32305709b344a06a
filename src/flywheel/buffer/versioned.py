"""A FIFO of trajectory groups with a staleness bound.

With `max_off_policy_steps` = k, a learner about to train version v accepts a group only if
every token in it was sampled by version >= v - k (k = 0: strictly on-policy). Older groups
are dropped and counted, never trained on. The staleness of a group is v - its oldest
token's version; the histogram of accepted staleness is reported.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from typing import Callable

from flywheel.types import TrajectoryGroup


class VersionedBuffer:
    def __init__(self, max_off_policy_steps: int, on_drop: Callable[[TrajectoryGroup], None] | None = None):
        """on_drop(group) is called (under the buffer's lock) for every group dropped as stale."""
        if max_off_policy_steps < 0:
            raise ValueError(f"max_off_policy_steps must be >= 0, got {max_off_policy_steps}")
        self.k = max_off_policy_steps
        self.on_drop = on_drop
        self._groups: deque[TrajectoryGroup] = deque()
        self._cond = threading.Condition()
        self.dropped_groups = 0
        self.dropped_trajectories = 0
        self.staleness = Counter()  # staleness of accepted groups -> count

    def put(self, group: TrajectoryGroup) -> None:
        with self._cond:
            self._groups.append(group)
            self._cond.notify_all()

    def __len__(self) -> int:
        return len(self._groups)

    def take(self, n: int, learner_version: int, timeout_s: float | None = None) -> list[TrajectoryGroup]:
        """The next `n` groups fresh enough for `learner_version`, oldest first; stale ones
        met on the way are dropped. Blocks until `n` are available (or the timeout; then
        returns what it has)."""
        out: list[TrajectoryGroup] = []
        with self._cond:
            while len(out) < n:
                while self._groups and len(out) < n:
                    group = self._groups.popleft()
                    staleness = learner_version - group.oldest_version
                    if staleness > self.k:
                        self.dropped_groups += 1
                        self.dropped_trajectories += len(group.trajectories)
                        if self.on_drop is not None:
                            self.on_drop(group)
                        continue
                    self.staleness[max(0, staleness)] += 1
                    out.append(group)
                if len(out) < n and not self._cond.wait(timeout_s):
                    break
        return out

    def stats(self) -> dict[str, float]:
        total = sum(self.staleness.values()) or 1
        out = {"buffer/size": float(len(self._groups)), "buffer/dropped_groups": float(self.dropped_groups),
               "buffer/dropped_trajectories": float(self.dropped_trajectories)}
        out.update({f"buffer/staleness_{s}": c / total for s, c in sorted(self.staleness.items())})
        return out
