"""rollout/play.py plays a batch with the cyclic garbage collector paused (a full collection
walks every live container of the process; docs/benchmarks.md, bench/envs.py) and leaves it
as it found it: on after a batch, off if the caller had turned it off."""

from __future__ import annotations

import asyncio
import gc

from flywheel.envs import load_env
from flywheel.envs.base import Policy
from flywheel.rollout.play import play


class Recording(Policy):
    def __init__(self, inner: Policy):
        self.inner, self.seen = inner, []

    async def act(self, task, history, tools, episode=0):
        self.seen.append(gc.isenabled())
        return await self.inner.act(task, history, tools, episode)


def test_a_batch_runs_with_the_collector_paused_and_restores_it():
    env = load_env("calculator")
    policy = Recording(env.scripted_policy())
    assert gc.isenabled()
    results = asyncio.run(play(env, env.tasks("test", n=4), policy))
    assert [r.reward for r in results] == [1.0] * 4
    assert policy.seen and not any(policy.seen) and gc.isenabled()
    gc.disable()
    try:
        asyncio.run(play(env, env.tasks("test", n=1), policy))
        assert not gc.isenabled()  # the caller's choice is kept
    finally:
        gc.enable()
