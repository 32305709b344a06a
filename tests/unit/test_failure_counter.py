"""FailureCounter keeps the daemon's failure count by reading only new feedback; it must always
equal the recount from every trace (curation_rules.outcome), whatever order judgements come in."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

from flywheel.traces import TraceStore
from flywheel.loop.curation_rules import CurationConfig, outcome
from flywheel.loop.failure_counter import FailureCounter

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def recount(store: TraceStore, cfg: CurationConfig, cursor: int) -> int:
    return sum(outcome(t, cfg) == "fail" for t in store.iter_traces(after_seq=cursor, with_feedback=True))


def trace(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"q{i}"}], "response": {"role": "assistant", "content": "a"}}


def test_hand_worked_sequence(tmp_path):
    cfg = CurationConfig()  # fail below 0.5; "bad" fails, "good" passes
    with TraceStore(f"sqlite:///{tmp_path / 't.db'}") as store:
        a, b, c = store.add_traces([trace(i) for i in range(3)]).ids
        counter = FailureCounter(cfg)
        store.add_feedback(a, {"score": 0.0, "created_at": T0.isoformat()})
        store.add_feedback(b, {"label": "bad", "created_at": T0.isoformat()})
        store.add_feedback(c, {"text": "no verdict"})
        assert counter.update(store) == 2  # a, b
        store.add_feedback(a, {"label": "good", "created_at": (T0 + timedelta(hours=1)).isoformat()})
        assert counter.update(store) == 1  # a passes now
        store.add_feedback(b, {"score": 1.0, "created_at": (T0 - timedelta(hours=1)).isoformat()})
        assert counter.update(store) == 1  # older than b's "bad": changes nothing
        store.add_feedback(b, {"score": 0.7, "created_at": T0.isoformat()})
        assert counter.update(store) == 0  # same time as "bad", stored later: neutral wins
        assert counter.update(store) == 0  # nothing new
        later = FailureCounter(cfg, cursor=store.get(b).seq)  # only c is after the cursor
        store.add_feedback(c, {"score": 0.1})
        assert later.update(store) == 1 and counter.update(store) == 1


def test_matches_the_recount_under_random_feedback(tmp_path):
    cfg = CurationConfig(fail_below=0.5, pass_at=1.0)
    rng = random.Random(7)
    with TraceStore(f"sqlite:///{tmp_path / 't.db'}") as store:
        ids = store.add_traces([trace(i) for i in range(30)]).ids
        cursor = store.get(ids[9]).seq
        whole, after = FailureCounter(cfg), FailureCounter(cfg, cursor)
        for _ in range(12):
            for _ in range(rng.randrange(1, 15)):
                when = (T0 + timedelta(minutes=rng.randrange(5))).isoformat()  # many ties
                kind = rng.random()
                fb = ({"score": rng.choice([0.0, 0.3, 0.6, 1.0])} if kind < 0.5 else
                      {"label": rng.choice(["bad", "good", "Thumbs_Down", "meh"])} if kind < 0.85 else
                      {"text": "just a remark"})
                store.add_feedback(rng.choice(ids), {**fb, "created_at": when})
            if rng.random() < 0.3:
                ids += store.add_traces([trace(100 + len(ids))]).ids
            assert whole.update(store) == recount(store, cfg, 0)
            assert after.update(store) == recount(store, cfg, cursor)
