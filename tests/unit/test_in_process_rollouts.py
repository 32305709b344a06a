"""Synchronous rollouts generate with their own torch thread count and give the learner's back."""

import torch

from flywheel.orchestrate.pool import InProcessRollouts
from flywheel.orchestrate.worker import WorkItem


class Engine:
    version = 0


def test_generation_runs_with_its_threads_and_restores_the_learners(monkeypatch):
    seen = []

    async def fake_play(env, tasks, policy, group_size):
        seen.append(torch.get_num_threads())
        return []

    monkeypatch.setattr("flywheel.orchestrate.pool.play", fake_play)
    learner = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        source = InProcessRollouts(Engine(), env=None, group_size=2, params=None, renderer=None, threads=1)
        source.submit(WorkItem(item_id=0, tasks=[], min_version=0))
        assert len(source.poll()) == 1
        assert seen == [1] and torch.get_num_threads() == 2
        unset = InProcessRollouts(Engine(), env=None, group_size=2, params=None, renderer=None)
        unset.submit(WorkItem(item_id=1, tasks=[], min_version=0))
        unset.poll()
        assert seen == [1, 2]  # no threads given: the learner's
    finally:
        torch.set_num_threads(learner)
