"""Dynamic sampling's refill, done where the episodes are played.

A work item may carry spare tasks beside its tasks (orchestrate/feeder.py). The player plays
the tasks' groups, then, for each group the keep rule rejects (DAPO: rewards all equal, so no
gradient), the next spare's group, in batches, until as many groups are kept as there are
tasks or the spares run out. Refilling here, instead of in the learner after the item comes
back, saves a round trip per step: the learner is training while the worker refills.

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
                        spares: Sequence[Task], keep: Keep | None) -> list[TrajectoryGroup]:
    """`play_groups(tasks)` (an awaitable of one group per task, in order) on `tasks`, then on
    spares in batches while fewer than len(tasks) groups are kept. Without `keep` or spares,
    just the tasks' groups."""
    groups = list(await play_groups(list(tasks)))
    if keep is None or not spares:
        return groups
    kept = sum(1 for g in groups if keep(g))
    used = 0
    while n := spares_wanted(kept, len(tasks), len(spares) - used):
        more = list(await play_groups(list(spares[used:used + n])))
        used += n
        kept += sum(1 for g in more if keep(g))
        groups += more
    return groups
