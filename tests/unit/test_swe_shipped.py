"""The shipped SWE instances (envs/swe/instances/*.jsonl): at least 50 from at least 3 real
projects, each pinned by the sdist hash its project records, problem statements that do not
quote the diff, and train / test sides disjoint by problem (a hash split)."""

from __future__ import annotations

from flywheel.envs.swe.env import load, problem_key
from flywheel.envs.swe.instance import read_instances
from flywheel.envs.swe.sources import PROJECTS
from flywheel.envs.swe.synthesize import shipped_files


def shipped():
    return [i for f in shipped_files() for i in read_instances(f)]


def test_at_least_fifty_instances_from_three_pinned_projects():
    instances = shipped()
    assert len(instances) >= 50 and len({i.repo for i in instances}) >= 3
    by_repo = {p.repo: p for p in PROJECTS.values()}
    for inst in instances:
        project = by_repo[inst.repo]
        assert inst.source == project.source and inst.version == project.version
        assert inst.bug_patch and inst.patch and not inst.test_patch
        assert not set(inst.FAIL_TO_PASS) & set(inst.PASS_TO_PASS)


def test_problem_statements_are_written_from_behaviour_not_from_the_diff():
    for inst in shipped():
        changed = [ln[1:].strip() for ln in inst.bug_patch.splitlines()
                   if ln[:1] in "+-" and not ln.startswith(("+++", "---")) and len(ln[1:].strip()) > 8]
        assert not any(c in inst.problem_statement for c in changed), inst.instance_id
        assert all(node in inst.problem_statement for node in inst.FAIL_TO_PASS[:4])


def test_train_and_test_sides_share_no_problem():
    env = load()
    sides = {s: {problem_key(env.instance_of(t)) for t in env.tasks(s)} for s in ("train", "test")}
    assert sides["train"] and sides["test"] and not sides["train"] & sides["test"]
    assert len(sides["train"]) + len(sides["test"]) == len({problem_key(i) for i in env.instances})
    toolz = load(projects="toolz")
    assert {i.repo for i in toolz.instances} == {"pytoolz/toolz"}
