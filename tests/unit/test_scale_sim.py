"""bench/scale_sim.py's core: every simulated episode is played to its end through the real
rollout sources and counted once (the bench's timings are not tested here)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from scale_sim import MockSettings, simulate  # noqa: E402


@pytest.mark.parametrize("actors", [0, 1])  # 0: InProcessRollouts; 1: ProcessRollouts, one worker process
def test_every_episode_finishes_and_counts_once(actors):
    settings = MockSettings(sampler_latency_s=0.0, tool_latency_s=0.0, tokens=128, tool_calls=2)
    r = simulate(50, actors, settings, group_size=5)
    assert r["items"] == [0]  # the one work item came back once (the warm-up item is not counted)
    assert r["tasks"] == r["groups"] == 10 and len(r["task_ids"]) == 10
    assert r["trajectories"] == 50
    assert r["finished"] == 50  # each ended after 2 calc turns and an answer: 3 turns
    assert r["sampled"] == 50 * 3 * 128  # 3 sampled turns of 128 tokens each, no more, no fewer
    assert r["cpu_s"] > 0 and r["mock_cpu_s"] > 0
