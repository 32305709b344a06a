"""The best promoted score per frozen suite, read from registry records (loop/best_scores.py)."""

import json
from pathlib import Path

from flywheel.loop.best_scores import best_promoted, best_scores
from flywheel.loop.gate import Best
from flywheel.loop.paired import Outcomes
from flywheel.registry import Registry

IDS = [f"a{i}" for i in range(8)]


def _o(bits: str, ids=IDS) -> Outcomes:
    return Outcomes.of(ids, [b == "1" for b in bits])


def _rec(inc: dict, cand: dict, outcomes: dict | None = None) -> dict:
    out = {"incumbent": inc, "candidate": cand}
    if outcomes is not None:
        out["outcomes"] = outcomes
    return out


def test_the_best_is_the_highest_measurement_of_a_promoted_version():
    base, v2, v3 = _o("11111100"), _o("11111000"), _o("11111110")
    records = [
        # c1 measured the base v1 (as incumbent) and v2; c2 measured v2 and v3; v3 was rejected
        ("v2", "v1", _rec({"add": 0.75, "new_failures": 0.0}, {"add": 0.625, "new_failures": 0.5},
                          {"incumbent": {"add": base.record()}, "candidate": {"add": v2.record()}})),
        ("v3", "v2", _rec({"add": 0.625}, {"add": 0.875},
                          {"incumbent": {"add": v2.record()}, "candidate": {"add": v3.record()}})),
    ]
    best = best_scores(records, {"v1", "v2"}, {"add": base.tasks})
    assert best == {"add": Best("v1", base)}  # v3's 0.875 never served; new_failures is not a frozen suite
    assert best_scores(records, {"v1", "v2", "v3"}, {"add": base.tasks}) == {"add": Best("v3", v3)}


def test_other_tasks_are_left_out_and_old_records_count_by_accuracy():
    now = _o("11110000")
    old_suite = _o("11111111", ids=[f"b{i}" for i in range(8)])  # the suite was redefined since
    records = [("v2", "v1", _rec({"add": 1.0}, {"add": 0.5}, {"incumbent": {"add": old_suite.record()},
                                                            "candidate": {"add": now.record()}})),
               ("v3", "v2", _rec({"add": 0.5}, {"add": 0.625}))]  # registered before outcomes were kept
    assert best_scores(records[:1], {"v1", "v2"}, {"add": now.tasks}) == {"add": Best("v2", now)}
    assert best_scores(records, {"v1", "v2", "v3"}, {"add": now.tasks}) == {"add": Best("v3", 0.625)}
    # a record whose outcomes disagree with its accuracy, or cannot be read, counts by accuracy
    broken = [("v2", "v1", _rec({"add": 0.75}, {"add": 0.5}, {"incumbent": {"add": {"n": 8, "passed": "zz"}},
                                                             "candidate": {"add": now.record()}}))]
    assert best_scores(broken, {"v1"}, {"add": now.tasks}) == {"add": Best("v1", 0.75)}


def test_ties_prefer_a_measurement_that_pairs():
    b = _o("00001111")  # v1's 0.5 was kept as an accuracy alone, v2's with its outcomes
    records = [("v2", "v1", _rec({"add": 0.5}, {"add": 0.5}, {"candidate": {"add": b.record()}}))]
    assert best_scores(records, {"v1", "v2"}, {"add": b.tasks}) == {"add": Best("v2", b)}
    assert best_scores(records, {"v1"}, {"add": b.tasks}) == {"add": Best("v1", 0.5)}


def _model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def test_read_from_a_registry_its_promotions_and_rollbacks(tmp_path):
    base, v2, v3 = _o("11111100"), _o("11111110"), _o("11111111")
    with Registry(tmp_path / "registry") as reg:
        reg.promote(reg.register(_model(tmp_path / "m1")).id, "initial")
        reg.register(_model(tmp_path / "m2"), parent="v1", eval_scores=_rec(
            {"add": base.accuracy}, {"add": v2.accuracy},
            {"incumbent": {"add": base.record()}, "candidate": {"add": v2.record()}}))
        reg.register(_model(tmp_path / "m3"), parent="v1", eval_scores=_rec(
            {"add": base.accuracy}, {"add": v3.accuracy},
            {"incumbent": {"add": base.record()}, "candidate": {"add": v3.record()}}))
        reg.reject("v3", "gate: no gain")
        assert best_promoted(reg, {"add": base.tasks}) == {"add": Best("v1", base)}  # v2 never served
        reg.promote("v2", "gate")
        reg.rollback(reason="bad answers in production")  # v2 served once: its score was reached
        assert reg.production().id == "v1"
        assert best_promoted(reg, {"add": base.tasks}) == {"add": Best("v2", v2)}
