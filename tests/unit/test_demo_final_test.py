"""The demo's independent final test (demo/final_test.py): disjoint from what the gate decides
on and from every task users ask, under the demo's own settings."""

import pytest

from flywheel.config import validate
from flywheel.demo.final_test import final_suites, mean_gain_points
from flywheel.demo.run import DEMO_RECIPE, loop_config
from flywheel.demo.world import WorldConfig
from flywheel.loop.evaluation import suite_from_config
from flywheel.loop.loop_config import LoopConfig


def test_mean_gain_points_by_hand():
    assert mean_gain_points({"a": 0.5, "b": 0.2}, {"a": 0.6, "b": 0.2}) == pytest.approx(5.0)
    assert mean_gain_points({"a": 0.9, "b": 0.0}, {"a": 0.85, "b": 0.45}) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="different families"):
        mean_gain_points({"a": 0.5}, {"b": 0.5})


def _demo_suites(tmp_path, world: WorldConfig):
    cfg = validate(loop_config(tmp_path, world, DEMO_RECIPE, 1, []), LoopConfig)
    return {n: suite_from_config(n, s) for n, s in cfg.eval.suites.items()}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_final_tests_share_no_problem_with_the_gate_or_the_traffic(tmp_path, seed):
    world = WorldConfig(seed=seed)
    gate = _demo_suites(tmp_path, world)
    finals = final_suites(gate, DEMO_RECIPE.final_tasks, 120)
    per_family = sum(world.days(w) for w in range(1, world.weeks + 1)) * world.episodes_per_day
    assert set(finals) == {f.name for f in world.families}
    for name, final in finals.items():
        env = final.env
        keys = [env.problem_key(t) for t in final.tasks]
        assert len(keys) == DEMO_RECIPE.final_tasks == len(set(keys))
        assert not set(keys) & {env.problem_key(t) for t in gate[name].tasks}
        traffic = env.tasks("train", n=per_family, seed=world.seed)  # what run_demo hands the users
        assert not set(keys) & {env.problem_key(t) for t in traffic}


def test_a_final_test_larger_than_the_split_can_spare_is_refused(tmp_path):
    gate = _demo_suites(tmp_path, WorldConfig())
    with pytest.raises(ValueError, match="final test of 'add'"):
        final_suites({"add": gate["add"]}, 10 ** 7, 120)
