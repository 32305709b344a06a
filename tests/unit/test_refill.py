"""Dynamic sampling's refill in the player (rollout/refill.py), worked by hand."""

import asyncio

from flywheel.rollout.refill import Refiller, play_refilled, spares_wanted, varied_rewards
from flywheel.types import Task, Trajectory, TrajectoryGroup


def group(task_id, rewards):
    return TrajectoryGroup(task_id, [Trajectory(task_id, [1], [1], [-0.5], [0], reward=r) for r in rewards])


def test_spares_wanted_is_one_per_missing_group_at_most_those_left():
    assert spares_wanted(kept=1, needed=3, spares_left=4) == 2
    assert spares_wanted(kept=1, needed=3, spares_left=1) == 1
    assert spares_wanted(kept=3, needed=3, spares_left=4) == 0
    assert spares_wanted(kept=0, needed=3, spares_left=0) == 0


def test_varied_rewards_keeps_groups_whose_rewards_differ():
    assert varied_rewards(group("a", [1.0, 0.0]))
    assert not varied_rewards(group("a", [1.0, 1.0]))
    assert not varied_rewards(group("a", [0.0, 0.0]))


def fake_player(varied, batches):
    """A player whose task ids in `varied` get rewards [1, 0], others [1, 1]; records its batches."""
    async def play_groups(ts):
        batches.append([t.id for t in ts])
        return [group(t.id, [1.0, 0.0] if t.id in varied else [1.0, 1.0]) for t in ts]
    return play_groups


def tasks_of(ids):
    return [Task(id=i, prompt=i) for i in ids]


def run(tasks, spares, keep, varied, ahead=0):
    batches = []
    groups = asyncio.run(play_refilled(fake_player(varied, batches), tasks_of(tasks), tasks_of(spares), keep, ahead))
    return [g.task_id for g in groups], batches


def test_spares_replace_rejected_groups_in_batches_until_enough_are_kept():
    # a, c flat; b kept -> 2 missing: d (flat), e (kept) -> 1 missing: f (kept) -> done, g unplayed
    ids, batches = run("abc", "defg", varied_rewards, varied={"b", "e", "f", "g"})
    assert batches == [["a", "b", "c"], ["d", "e"], ["f"]]
    assert ids == ["a", "b", "c", "d", "e", "f"]  # group i answers (tasks + spares)[i]


def test_spares_run_out_before_the_groups_are_kept():
    ids, batches = run("ab", "c", varied_rewards, varied=set())
    assert batches == [["a", "b"], ["c"]] and ids == ["a", "b", "c"]


def test_without_a_keep_rule_spares_are_not_played():
    ids, batches = run("ab", "cd", None, varied=set())
    assert batches == [["a", "b"]] and ids == ["a", "b"]


def test_spares_played_ahead_join_the_first_batch():
    # a, c flat; with 2 ahead, d (flat) and e (kept) join the first batch -> 2 kept, 1 missing: f
    ids, batches = run("abc", "defg", varied_rewards, varied={"b", "e", "f", "g"}, ahead=2)
    assert batches == [["a", "b", "c", "d", "e"], ["f"]]
    assert ids == ["a", "b", "c", "d", "e", "f"]


def test_spares_played_ahead_are_returned_even_when_not_needed():
    ids, batches = run("ab", "cd", varied_rewards, varied={"a", "b", "c", "d"}, ahead=5)  # at most those there
    assert batches == [["a", "b", "c", "d"]] and ids == ["a", "b", "c", "d"]


def test_refiller_plays_ahead_what_the_previous_item_rejected():
    batches = []
    refiller = Refiller(fake_player({"b", "e", "f", "y"}, batches))
    asyncio.run(refiller.play(tasks_of("abc"), tasks_of("defg"), varied_rewards))  # a, c, d rejected
    assert refiller.ahead == 3
    asyncio.run(refiller.play(tasks_of("xy"), tasks_of("pqrs"), varied_rewards))
    assert batches[-2:] == [["x", "y", "p", "q", "r"], ["s"]]  # the tasks and 3 spares at once, then a refill
    assert refiller.ahead == 5  # x, p, q, r, s
    asyncio.run(refiller.play(tasks_of("ef"), [], varied_rewards))  # no spares: the guess stays
    assert batches[-1] == ["e", "f"] and refiller.ahead == 5


def test_a_refiller_without_look_ahead_plays_spares_only_after_the_rejections():
    batches = []
    refiller = Refiller(fake_player({"b", "e", "f", "y"}, batches), look_ahead=False)  # rollout.refill_ahead=false
    asyncio.run(refiller.play(tasks_of("abc"), tasks_of("defg"), varied_rewards))  # a, c rejected: d, e
    asyncio.run(refiller.play(tasks_of("xy"), tasks_of("pqrs"), varied_rewards))
    # x, then each spare rejected in turn: one spare a batch, never ahead
    assert refiller.ahead == 0 and batches[-5:] == [["x", "y"], ["p"], ["q"], ["r"], ["s"]]
