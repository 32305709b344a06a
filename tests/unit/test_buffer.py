"""The staleness bound of the versioned buffer."""

import threading

import pytest

from flywheel.buffer import VersionedBuffer
from flywheel.types import Trajectory, TrajectoryGroup


def group(task: str, *versions: int) -> TrajectoryGroup:
    """A group of one trajectory per version; the prompt token is unsampled (version -1)."""
    trajs = [Trajectory(task, ids=[1, 2, 3], loss_mask=[0, 1, 1], behavior_logprobs=[0, -1, -1],
                        versions=[-1, v, v]) for v in versions]
    return TrajectoryGroup(task, trajs)


def test_on_policy_keeps_only_the_current_version():
    buf = VersionedBuffer(0)
    for g in (group("a", 4), group("b", 5), group("c", 5, 4), group("d", 5)):
        buf.put(g)
    taken = buf.take(2, learner_version=5, timeout_s=0)
    assert [g.task_id for g in taken] == ["b", "d"]  # a is one step old; c has one old member
    assert buf.dropped_groups == 2 and buf.dropped_trajectories == 3
    assert buf.stats()["buffer/staleness_0"] == 1.0


def test_k_steps_off_policy_and_the_histogram():
    buf = VersionedBuffer(2)
    for v in (3, 7, 8, 9, 10):
        buf.put(group(f"v{v}", v))
    taken = buf.take(4, learner_version=10, timeout_s=0)
    assert [g.task_id for g in taken] == ["v8", "v9", "v10"]  # 10 - 7 = 3 > 2 dropped, as is 3
    assert buf.dropped_groups == 2
    assert buf.staleness == {2: 1, 1: 1, 0: 1}


def test_take_blocks_until_groups_arrive():
    buf = VersionedBuffer(1)
    threading.Timer(0.05, lambda: buf.put(group("late", 1))).start()
    assert [g.task_id for g in buf.take(1, learner_version=1, timeout_s=5)] == ["late"]
    assert buf.take(1, learner_version=1, timeout_s=0.01) == []


def test_bad_bound():
    with pytest.raises(ValueError):
        VersionedBuffer(-1)
