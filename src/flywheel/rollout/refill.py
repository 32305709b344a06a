"""Dynamic sampling's refill, done where the episodes are played.

A work item may carry spare tasks beside its tasks (orchestrate/feeder.py). The player plays
the tasks' groups, then, for each group the keep rule rejects (DAPO: rewards all equal, so no
gradient), the next spare's group, in batches, until as many groups are kept as there are
tasks or the spares run out. Refilling here, instead of in the learner after the item comes
back, saves a round trip per step: the learner is training while the worker refills.

A player that has seen the keep rule reject r groups of its previous item plays the first r
spares in the first batch, beside the tasks (`Refiller`): one decode batch of 11 groups costs
less than one of 8 and another of 3, since much of a decode step's cost is per step, not per
row (bench/rl_vs_trl.py's clock fell by a tenth with it, docs/benchmarks.md). The groups of spares it
played needlessly are kept or rejected like any other; the feeder buffers the kept ones, and
where the staleness bound leaves them too old for the next step (k < 2) the buffer drops them
and their tasks are drawn again (counted in `buffer/dropped_groups`; bench/rl_vs_trl.py counts
their samples as generated).

Contract: the groups come back in play order, the tasks' groups first and then one per spare
used, spares used from the front; so group i answers `(tasks + spares)[i]`, and the spares
after the last group were not played.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from flywheel.rollout.advantages import informative
from flywheel.types import Task, TrajectoryGroup

Keep = Callable[[TrajectoryGroup], bool]


def varied_rewards(group: TrajectoryGroup) -> bool:
    """Dynamic sampling's keep rule: the group's rewards are not all equal (a module-level
    function, so a work item carrying it pickles by reference)."""
    return informative(torch.tensor([t.reward for t in group.trajectories]))


def spares_wanted(kept: int, needed: int, spares_left: int) -> int:
    """How many spares the next refill batch plays: one per group still missing, at most
    those left. 0 when enough are kept."""
    return max(0, min(needed - kept, spares_left))


async def play_refilled(play_groups: Callable[[Sequence[Task]], "object"], tasks: Sequence[Task],
                        spares: Sequence[Task], keep: Keep | None, ahead: int = 0) -> list[TrajectoryGroup]:
    """`play_groups(tasks)` (an awaitable of one group per task, in order) on `tasks` and the
    first `ahead` spares, then on spares in batches while fewer than len(tasks) groups are
    kept. Without `keep` or spares, just the tasks' groups."""
    if keep is None or not spares:
        return list(await play_groups(list(tasks)))
    used = max(0, min(ahead, len(spares)))
    groups = list(await play_groups(list(tasks) + list(spares[:used])))
    kept = sum(1 for g in groups if keep(g))
    while n := spares_wanted(kept, len(tasks), len(spares) - used):
        more = list(await play_groups(list(spares[used:used + n])))
        used += n
        kept += sum(1 for g in more if keep(g))
        groups += more
    return groups


class Refiller:
    """`play_refilled` over a player's stream of work items, playing ahead as many spares as
    the keep rule rejected of its previous item's groups."""

    def __init__(self, play_groups: Callable[[Sequence[Task]], "object"], look_ahead: bool = True):
        self.play_groups, self.look_ahead = play_groups, look_ahead  # look_ahead: rollout.refill_ahead
        self.ahead = 0

    async def play(self, tasks: Sequence[Task], spares: Sequence[Task], keep: Keep | None) -> list[TrajectoryGroup]:
        groups = await play_refilled(self.play_groups, tasks, spares, keep, self.ahead)
        if self.look_ahead and keep is not None and spares:
            self.ahead = sum(1 for g in groups if not keep(g))
        return groups
