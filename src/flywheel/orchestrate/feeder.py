"""The feeder between a rollout source and the learner: what to generate, when, and what to train.

With staleness bound k (`max_off_policy_steps`) the feeder keeps k + 1 steps of tasks
submitted or buffered. Work submitted while the learner is at version v is tagged
`min_version = v`: a worker waits for those weights before sampling. The learner consumes
one step of groups per version, oldest first, so a group submitted at v is trained at a
version <= v + k: k = 0 is synchronous on-policy training, k = 1 generates step s + 1 while
step s trains. Groups that are nevertheless too old (a slow worker, a restart) are dropped
by the VersionedBuffer, counted, and their tasks generated again.

Filters (both off by default):
- `keep` (DAPO's dynamic sampling): a group it rejects (all rewards equal: no gradient) is
  discarded and another task drawn in its place, until `groups_per_step` groups are kept or
  `draw_limit` x groups_per_step have been taken for the step; the step then trains on those kept.
  The replacements travel with the work as spares, and the worker refills at once
  (rollout/refill.py); spares it did not play go back to the front of the draw.
- `solved_at` (ScaleRL's no-positive-resampling): a task whose group's mean reward reaches it
  is never drawn again, unless every task is solved.
Data position: tasks are drawn from the DataOrder when submitted. `state_dict` holds the
task indices drawn but not yet trained, in order; a resumed run submits those first, so
after SIGKILL + resume no task is skipped and none is trained twice.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from flywheel.buffer import VersionedBuffer
from flywheel.orchestrate.source import RolloutSource
from flywheel.orchestrate.worker import WorkItem, WorkResult
from flywheel.rollout.data_order import DataOrder
from flywheel.types import Task, TrajectoryGroup


# StepRollouts.work, summed over results: WorkResult fields of these names, and "items" (one per result)
WORK_KEYS = ("generate_s", "weight_wait_s", "weight_load_s", "kernel_rebuild_s", "tokens", "items")


@dataclass
class StepRollouts:
    """The groups for one learner step and what producing them cost."""

    groups: list[TrajectoryGroup]
    wait_s: float  # learner time spent waiting for them
    discarded: list[TrajectoryGroup] = field(default_factory=list)  # taken for this step, rejected by `keep`
    work: dict[str, float] = field(default_factory=dict)  # sums over the work items received meanwhile


class RolloutFeeder:
    def __init__(self, source: RolloutSource, tasks: list[Task], order: DataOrder, groups_per_step: int,
                 max_off_policy_steps: int, items_per_step: int = 1,
                 keep: Callable[[TrajectoryGroup], bool] | None = None, draw_limit: float = 3.0,
                 solved_at: float | None = None):
        self.source, self.tasks, self.order = source, tasks, order
        self.keep, self.solved_at = keep, solved_at
        self.max_taken = max(groups_per_step, int(draw_limit * groups_per_step))
        self.solved: set[int] = set()  # task indices not to draw again (solved_at)
        self.groups_per_step, self.k = groups_per_step, max_off_policy_steps
        self.items_per_step = max(1, min(items_per_step, groups_per_step))
        self.buffer = VersionedBuffer(max_off_policy_steps, on_drop=self._regenerate)
        self._undrawn: deque[int] = deque()  # task indices to submit before drawing new ones
        self._untrained: list[int] = []  # drawn, not yet trained, in draw order
        self._in_flight_groups = 0
        self._next_item = 0
        self._item_tasks: dict[int, tuple[list[int], int]] = {}  # item -> (task indices, then spares; tasks)
        self._work: dict[str, float] = {}
        self.regenerated_groups = 0

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {"untrained": list(self._untrained), "solved": sorted(self.solved)}

    def load_state_dict(self, state: dict) -> None:
        self._untrained = list(state.get("untrained", []))
        self._undrawn = deque(self._untrained)
        self.solved = set(state.get("solved", []))

    # ------------------------------------------------------------------ submitting

    def _draw(self, n: int) -> list[int]:
        """Tasks to submit next: first those owed (restored or regenerated, already counted as
        untrained), then new ones from the data order."""
        out = []
        while self._undrawn and len(out) < n:
            out.append(self._undrawn.popleft())
        skip = self.solved if len(self.solved) < len(self.tasks) else set()
        while len(out) < n:
            new = [i for i in self.order.take(n - len(out)) if i not in skip]
            self._untrained += new
            out += new
        return out

    def fill(self, learner_version: int, taken: int = 0) -> None:
        """Submit work until k + 1 steps of groups are in flight, buffered, or already `taken`
        for the step being assembled."""
        want = (self.k + 1) * self.groups_per_step
        while self._in_flight_groups + len(self.buffer) + taken < want:
            indices = self._draw(self.groups_per_step)
            for part in _split(indices, self.items_per_step):
                spares = self._draw(self._spares_for(len(part)))
                item = WorkItem(self._next_item, [self.tasks[i] for i in part], learner_version,
                                [self.tasks[i] for i in spares], self.keep)
                self._item_tasks[item.item_id] = (part + spares, len(part))
                self._next_item += 1
                self._in_flight_groups += len(part)
                self.source.submit(item)

    def _spares_for(self, tasks: int) -> int:
        """Spares an item of `tasks` tasks carries: its share of the step's draw limit."""
        if self.keep is None:
            return 0
        return round(tasks * (self.max_taken - self.groups_per_step) / self.groups_per_step)

    def _regenerate(self, group: TrajectoryGroup) -> None:
        """Called by the buffer for a group too stale to train: its task is drawn again next."""
        self.regenerated_groups += 1
        self._undrawn.appendleft(group.task_index)

    # ------------------------------------------------------------------ receiving

    def _receive(self, results: list[WorkResult]) -> None:
        for r in results:
            indices, tasks = self._item_tasks.pop(r.item_id)
            self._in_flight_groups -= tasks
            self._undrawn.extendleft(reversed(indices[len(r.groups):]))  # spares not played: drawn next
            for key in WORK_KEYS:
                self._work[key] = self._work.get(key, 0.0) + (1 if key == "items" else getattr(r, key))
            for index, group in zip(indices, r.groups):
                group.task_index = index
                self.buffer.put(group)

    def take(self, learner_version: int, poll_s: float = 0.05) -> StepRollouts:
        """Block until `groups_per_step` groups fresh enough for `learner_version` are ready."""
        t0 = time.perf_counter()
        got: list[TrajectoryGroup] = []
        discarded: list[TrajectoryGroup] = []
        while len(got) < self.groups_per_step and len(got) + len(discarded) < self.max_taken:
            self.fill(learner_version, taken=len(got))
            want = min(self.groups_per_step - len(got), self.max_taken - len(got) - len(discarded))
            ready = self.buffer.take(want, learner_version, timeout_s=0)
            for g in ready:
                self._untrained.remove(g.task_index)
                if self.solved_at is not None and _mean_reward(g) >= self.solved_at:
                    self.solved.add(g.task_index)
                (got if self.keep is None or self.keep(g) else discarded).append(g)
            if len(got) < self.groups_per_step:
                # wait for work only when the buffer ran dry (discards can leave groups there)
                self._receive(self.source.poll(poll_s if len(ready) < want else 0.0))
        work, self._work = {key: 0.0 for key in WORK_KEYS} | self._work, {}  # zeros: no item arrived meanwhile
        return StepRollouts(got, time.perf_counter() - t0, discarded, work)


def _mean_reward(group: TrajectoryGroup) -> float:
    return sum(t.reward for t in group.trajectories) / len(group.trajectories)


def _split(indices: list[int], parts: int) -> list[list[int]]:
    """Contiguous, nearly equal parts (empty parts omitted)."""
    n = len(indices)
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [indices[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
