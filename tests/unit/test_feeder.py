"""The rollout feeder: what it submits, with which staleness bound, what it trains, and what
a checkpoint owes after a kill. A fake source stands in for the workers."""

import asyncio
from collections import deque

from flywheel.orchestrate.feeder import RolloutFeeder
from flywheel.orchestrate.worker import WorkResult
from flywheel.rollout.data_order import DataOrder
from flywheel.rollout.refill import play_refilled
from flywheel.types import Task, Trajectory, TrajectoryGroup


class FakeSource:
    """Answers submitted items in order, sampled by `self.version` (or a forced one)."""

    def __init__(self):
        self.version = 0
        self.submitted = []
        self.queue = deque()
        self.force_version = None

    def submit(self, item):
        self.submitted.append(item)
        self.queue.append(item)

    def in_flight(self):
        return len(self.queue)

    def poll(self, timeout_s=0.0):
        if not self.queue:
            return []
        item = self.queue.popleft()
        forced = self.force_version is not None and item.min_version <= self.force_version
        v = self.force_version if forced else self.version
        assert v >= item.min_version
        groups = [TrajectoryGroup(t.id, [Trajectory(t.id, [1, 2], [0, 1], [0.0, -1.0], [-1, v], reward=1.0)])
                  for t in item.tasks]
        return [WorkResult(item.item_id, 0, groups, v, 0.5, 0.0, 0.1, tokens=len(groups), kernel_rebuild_s=0.05)]


def tasks(n):
    return [Task(id=f"t{i}", prompt=f"p{i}") for i in range(n)]


def test_synchronous_feeder_submits_one_step_at_the_current_version():
    src = FakeSource()
    feeder = RolloutFeeder(src, tasks(10), DataOrder(10, seed=0), groups_per_step=3, max_off_policy_steps=0)
    got = feeder.take(0)
    assert len(got.groups) == 3 and [i.min_version for i in src.submitted] == [0]
    assert got.work == {"generate_s": 0.5, "weight_wait_s": 0.0, "weight_load_s": 0.1, "kernel_rebuild_s": 0.05,
                        "tokens": 3.0, "items": 1.0}
    src.version = 1
    feeder.take(1)
    assert [i.min_version for i in src.submitted] == [0, 1]


def test_one_step_off_policy_keeps_two_steps_in_flight():
    src = FakeSource()
    order = DataOrder(20, seed=1)
    expected = DataOrder(20, seed=1).take(8)
    feeder = RolloutFeeder(src, tasks(20), order, groups_per_step=2, max_off_policy_steps=1)
    trained = []
    for v in range(4):
        src.version = v
        trained += [g.task_index for g in feeder.take(v).groups]
    # step 0 submits the batches for steps 0 and 1 at version 0; later steps one ahead
    assert [i.min_version for i in src.submitted] == [0, 0, 1, 2, 3]
    assert trained == expected  # the data order, nothing skipped or repeated


def test_stale_groups_are_dropped_counted_and_regenerated():
    src = FakeSource()
    feeder = RolloutFeeder(src, tasks(10), DataOrder(10, seed=0), groups_per_step=2, max_off_policy_steps=1)
    first = DataOrder(10, seed=0).take(2)
    src.version = 0
    feeder.fill(0)  # two steps submitted at version 0
    src.force_version = 0  # items submitted at v0 are answered by v0 weights
    src.version = 3
    got = feeder.take(3)  # the learner jumped ahead: everything sampled by v0 is 3 steps old
    assert feeder.buffer.dropped_groups >= 2 and feeder.regenerated_groups == feeder.buffer.dropped_groups
    assert all(g.oldest_version >= 2 for g in got.groups)
    assert sorted(g.task_index for g in got.groups) == sorted(first)  # the same tasks, generated again


def test_checkpoint_state_owes_the_untrained_tasks_and_resume_pays_them_first():
    def run(kill_after=None, state=None, order_state=None):
        src = FakeSource()
        order = DataOrder(30, seed=2)
        if order_state:
            order.load_state_dict(order_state)
        feeder = RolloutFeeder(src, tasks(30), order, groups_per_step=3, max_off_policy_steps=1)
        if state:
            feeder.load_state_dict(state)
        trained = []
        for v in range(5):
            src.version = v
            trained.append([g.task_index for g in feeder.take(v).groups])
            if kill_after is not None and v == kill_after:
                return trained, feeder.state_dict(), order.state_dict()
        return trained, None, None

    full, _, _ = run()
    before, state, order_state = run(kill_after=1)
    assert len(state["untrained"]) == 3  # the next step's batch was drawn (in flight) but not trained
    after, _, _ = run(state=state, order_state=order_state)
    assert before + after[:3] == full


def test_work_items_split_a_step_across_workers():
    src = FakeSource()
    feeder = RolloutFeeder(src, tasks(10), DataOrder(10, seed=0), groups_per_step=5, max_off_policy_steps=0,
                           items_per_step=2)
    feeder.take(0)
    assert [len(i.tasks) for i in src.submitted] == [2, 3]


class RewardSource(FakeSource):
    """Groups of two attempts; task i scores rewards[i] on both (equal: uninformative) or
    [1, 0] when rewards[i] is None."""

    def __init__(self, rewards):
        super().__init__()
        self.rewards = rewards

    def poll(self, timeout_s=0.0):
        if not self.queue:
            return []
        item = self.queue.popleft()

        async def play_groups(tasks):
            groups = []
            for t in tasks:
                r = self.rewards[int(t.id[1:])]
                scores = [1.0, 0.0] if r is None else [r, r]
                groups.append(TrajectoryGroup(t.id, [Trajectory(t.id, [1, 2], [0, 1], [0.0, -1.0],
                                                                [-1, item.min_version], reward=x) for x in scores]))
            return groups

        groups = asyncio.run(play_refilled(play_groups, item.tasks, item.spares, item.keep))  # as the workers do
        return [WorkResult(item.item_id, 0, groups, item.min_version, 0.5, 0.0, 0.1, tokens=len(groups),
                           kernel_rebuild_s=0.0)]


def informative(group):
    return len({t.reward for t in group.trajectories}) > 1


def test_dynamic_sampling_replaces_flat_groups_until_the_step_is_full():
    rewards = [None if i % 3 == 0 else 1.0 for i in range(30)]  # a third informative
    feeder = RolloutFeeder(RewardSource(rewards), tasks(30), DataOrder(30, seed=0), groups_per_step=3,
                           max_off_policy_steps=0, keep=informative, draw_limit=10)
    got = feeder.take(0)
    assert len(got.groups) == 3 and all(informative(g) for g in got.groups)
    assert got.discarded and not any(informative(g) for g in got.discarded)
    # every group taken is consumed from the data order: none is owed to a resumed run
    assert set(feeder.state_dict()["untrained"]).isdisjoint(
        {g.task_index for g in got.groups + got.discarded})


def test_dynamic_sampling_refills_in_the_item_and_returns_unplayed_spares_to_the_draw():
    rewards = [None if i % 3 == 0 else 1.0 for i in range(60)]
    src = RewardSource(rewards)
    order = DataOrder(60, seed=2)
    feeder = RolloutFeeder(src, tasks(60), order, groups_per_step=2, max_off_policy_steps=1, keep=informative,
                           draw_limit=3)
    consumed = []
    for v in range(6):
        got = feeder.take(v)
        assert len(got.groups) + len(got.discarded) <= 6  # the draw limit: 3 x 2 groups a step
        consumed += [g.task_index for g in got.groups + got.discarded]
    # each item carried its share of the step's spares, and one item a step sufficed
    assert all(len(i.spares) == 4 and i.keep is informative for i in src.submitted)
    assert len(src.submitted) == 7  # 6 steps + the one in flight (k = 1)
    # the spares an item did not play are owed, not lost: what was consumed and what is owed
    # are the data order's first tasks, none skipped, none twice
    drawn = consumed + feeder.state_dict()["untrained"]
    assert len(set(drawn)) == len(drawn)
    assert sorted(drawn) == sorted(DataOrder(60, seed=2).take(len(drawn)))


def test_the_learner_waits_for_work_only_when_the_buffer_is_dry():
    class Watched(RewardSource):
        def poll(self, timeout_s=0.0):
            self.waits.append((timeout_s, len(feeder.buffer)))
            return super().poll(timeout_s)

    src = Watched([None if i % 3 == 0 else 1.0 for i in range(60)])
    src.waits = []
    feeder = RolloutFeeder(src, tasks(60), DataOrder(60, seed=0), groups_per_step=2, max_off_policy_steps=0,
                           keep=informative, draw_limit=3)
    for v in range(4):
        feeder.take(v)
    # discards left groups in the buffer on some polls: those polls must not block
    assert any(n for _, n in src.waits)
    assert all(timeout == 0.0 for timeout, n in src.waits if n)


def test_dynamic_sampling_stops_at_its_draw_limit():
    feeder = RolloutFeeder(RewardSource([1.0] * 30), tasks(30), DataOrder(30, seed=0), groups_per_step=2,
                           max_off_policy_steps=0, keep=informative, draw_limit=3)
    got = feeder.take(0)
    assert got.groups == [] and len(got.discarded) == 6  # 3 x 2 groups taken, none kept


def test_solved_tasks_are_not_drawn_again_until_every_task_is():
    rewards = [1.0 if i < 4 else None for i in range(6)]  # tasks 0-3 solved, 4-5 not
    feeder = RolloutFeeder(RewardSource(rewards), tasks(6), DataOrder(6, seed=0), groups_per_step=3,
                           max_off_policy_steps=0, solved_at=0.9)
    for v in range(2):
        feeder.take(v)  # the first epoch: every task once
    assert feeder.solved == {0, 1, 2, 3}
    later = [g.task_index for v in range(2, 6) for g in feeder.take(v).groups]
    assert set(later) == {4, 5}
    restored = RolloutFeeder(RewardSource(rewards), tasks(6), DataOrder(6, seed=0), groups_per_step=3,
                             max_off_policy_steps=0, solved_at=0.9)
    restored.load_state_dict(feeder.state_dict())
    assert restored.solved == {0, 1, 2, 3}
    everything = RolloutFeeder(RewardSource([1.0] * 6), tasks(6), DataOrder(6, seed=0), groups_per_step=3,
                               max_off_policy_steps=0, solved_at=0.9)
    for v in range(3):  # every task solved after the first epoch: they are drawn again
        assert len(everything.take(v).groups) == 3
