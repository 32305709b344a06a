"""The replay environment: curated RL records replayed through the environments that grade them."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone

import pytest

from flywheel.envs import load_env
from flywheel.envs.replay import ROUTE_KEY, ReplayEnvironment, ReplayError, records_of
from flywheel.loop.curation import curate, write_curated
from flywheel.loop.curation_rules import CurationConfig
from flywheel.traces.results import StoredFeedback, StoredTrace, StoredVerifier


def reward(env, task, text: str) -> float:
    return asyncio.run(env.make_env(task).step(text)).reward


@pytest.fixture(scope="module")
def arithmetic():
    return load_env("arithmetic")


def test_replayed_tasks_are_the_originals_and_are_graded_by_their_env(arithmetic, monkeypatch):
    import flywheel.envs.replay as replay_module

    loads = []
    monkeypatch.setattr(replay_module, "load_env", lambda name, **kw: loads.append(name) or load_env(name, **kw))
    originals = arithmetic.tasks("test", n=5, seed=3)
    replay = ReplayEnvironment(records_of(originals, "arithmetic"))
    assert loads == ["arithmetic"]  # one environment for the five records
    tasks = replay.tasks("train")
    assert [(t.id, t.prompt, t.answer, t.tools) for t in tasks] == [(t.id, t.prompt, t.answer, t.tools)
                                                                     for t in originals]
    assert all(t.split == "train" and t.metadata[ROUTE_KEY] == {"env": "arithmetic", "settings": {}} for t in tasks)
    for task in tasks:
        assert reward(replay, task, task.answer) == 1.0
        assert reward(replay, task, str(int(task.answer) + 1)) == 0.0
    policy = replay.scripted_policy()
    assert asyncio.run(policy.act(tasks[0], tasks[0].prompt, None)) == tasks[0].answer


def test_tasks_route_by_env_settings_and_split(arithmetic):
    times = load_env("arithmetic", operators="*", digits=1).tasks("train", n=3)
    plus = arithmetic.tasks("train", n=3)
    replay = ReplayEnvironment(records_of(times, "arithmetic", {"operators": "*", "digits": 1}),
                               records_of(plus, "arithmetic"))
    assert [replay._env_of(t)[1].operators for t in replay.tasks("train")] == ["*"] * 3
    assert [t.split for t in replay.tasks("test")] == ["test"] * 3
    assert [t.id for t in replay.tasks("test", n=2, seed=1)] == [t.id for t in replay.tasks("test", n=2, seed=1)]
    assert len(replay.tasks("test", n=2)) == 2
    with pytest.raises(ValueError, match="no held-out records"):
        ReplayEnvironment(records_of(plus, "arithmetic")).tasks("test")
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        replay.tasks("heldout")
    with pytest.raises(ValueError, match="not made by a ReplayEnvironment"):
        replay.make_env(plus[0])


def test_curated_files_replay_through_the_registry(tmp_path, arithmetic):
    t0 = datetime(2025, 1, 1, tzinfo=timezone.utc)
    tasks = arithmetic.tasks("train", n=8, seed=0)
    traces = [StoredTrace(id=f"t{i}", seq=i, idempotency_key=f"k{i}", created_at=t0, source="serve",
                          messages=[{"role": "user", "content": t.prompt}],
                          response={"role": "assistant", "content": "0"},
                          feedback=[StoredFeedback(id=f"f{i}", trace_id=f"t{i}", created_at=t0, score=0.0,
                                                   verifier=StoredVerifier("arithmetic", {"id": t.id, "prompt": t.prompt,
                                                                                          "answer": t.answer}))])
              for i, t in enumerate(tasks)]
    paths = write_curated(curate(traces, cfg=CurationConfig(heldout_fraction=0.25)), tmp_path)
    replay = load_env("replay", train=str(paths["rl_train"]), test=str(paths["rl_heldout"]))
    train, test = replay.tasks("train"), replay.tasks("test")
    assert len(train) + len(test) == 8 and test and not {t.id for t in train} & {t.id for t in test}
    assert sorted(t.id for t in train + test) == sorted(t.id for t in tasks)
    assert all(reward(replay, t, t.answer) == 1.0 for t in train + test)
    assert replay.info()["envs"] == ["arithmetic"]


def test_malformed_jsonl_records_name_file_and_line(tmp_path, arithmetic):
    good = json.dumps(records_of(arithmetic.tasks("test", n=1), "arithmetic")[0])

    def load(*lines: str):
        path = tmp_path / "rl_train.jsonl"
        path.write_text("\n".join(lines) + "\n")
        return ReplayEnvironment.from_files(path)

    with pytest.raises(ReplayError, match=r"rl_train\.jsonl:3: missing field 'env'"):
        load(good, "", json.dumps({"task": {"id": "x", "prompt": "1+1="}}))
    with pytest.raises(ReplayError, match=r"rl_train\.jsonl:2: invalid JSON"):
        load(good, "{not json")
    with pytest.raises(ReplayError, match=r"rl_train\.jsonl:1: task: missing field 'prompt'"):
        load(json.dumps({"env": "arithmetic", "task": {"id": "x"}}))
    with pytest.raises(ReplayError, match=r"rl_train\.jsonl:1: unknown environment 'nope'"):
        load(json.dumps({"env": "nope", "task": {"id": "x", "prompt": "p"}}))
    with pytest.raises(ReplayError, match=r"rl_train\.jsonl: no replay records"):
        load("")
    with pytest.raises(ReplayError, match=r"records\[0\]: env 'replay' cannot replay itself"):
        ReplayEnvironment([{"env": "replay", "task": {"id": "x", "prompt": "p"}}])
    assert len(load(good).tasks()) == 1
