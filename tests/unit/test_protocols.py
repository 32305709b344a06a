"""Every implementation of the two interfaces run_rl is written against satisfies them: the
rollout sources (orchestrate/source.py RolloutSource) and the learners (train/learner/protocol.py
Learner), checked by method names and signatures, without starting any."""

import inspect

import pytest

from flywheel.orchestrate.pool import InProcessRollouts, ProcessRollouts
from flywheel.orchestrate.source import RolloutSource
from flywheel.train.learner.group import ProcessLearner
from flywheel.train.learner.protocol import Learner
from flywheel.train.learner.rl_learner import RLLearner


def _ray(name: str):
    pytest.importorskip("ray", reason="the ray extra is not installed")
    if name == "RayRollouts":
        from flywheel.orchestrate.ray_rollouts import RayRollouts
        return RayRollouts
    from flywheel.train.learner.ray_actors import RayLearner
    return RayLearner


def _missing(cls: type, protocol: type) -> list[str]:
    """The protocol's methods `cls` lacks or takes other parameters for (names and kinds)."""
    problems = []
    for name, wanted in inspect.getmembers(protocol, inspect.isfunction):
        if name.startswith("_"):
            continue
        got = getattr(cls, name, None)
        if got is None:
            problems.append(f"{cls.__name__}.{name} is missing")
            continue
        shape = [(p.name, p.kind) for p in inspect.signature(wanted).parameters.values()]
        if [(p.name, p.kind) for p in inspect.signature(got).parameters.values()] != shape:
            problems.append(f"{cls.__name__}.{name}{inspect.signature(got)} differs from {inspect.signature(wanted)}")
    return problems


@pytest.mark.parametrize("source", [InProcessRollouts, ProcessRollouts, "RayRollouts"])
def test_every_rollout_source_satisfies_the_protocol(source):
    cls = _ray(source) if isinstance(source, str) else source
    assert _missing(cls, RolloutSource) == []


@pytest.mark.parametrize("learner", [RLLearner, ProcessLearner, "RayLearner"])
def test_every_learner_satisfies_the_protocol(learner):
    cls = _ray(learner) if isinstance(learner, str) else learner
    assert _missing(cls, Learner) == []


def test_the_check_finds_a_missing_and_a_different_method():
    class Half:
        def submit(self, work) -> None: ...
    problems = _missing(Half, RolloutSource)
    assert "Half.submit(self, work) -> None differs from (self, item: 'WorkItem') -> 'None'" in problems
    assert "Half.poll is missing" in problems
