"""The cycle keeps its rl stage only on evidence: the check split and the rule (loop/cycle.py)."""

import json
from types import SimpleNamespace

from flywheel.loop.cycle import RL_CHECK_MIN, _rl_check_split, _rl_left_out
from flywheel.loop.loop_config import CycleTrainConfig


def result(*accuracies, steps=20):
    return SimpleNamespace(steps=steps, evals=[{"step": i, "eval/greedy_accuracy": a} for i, a in enumerate(accuracies)])


def test_rl_is_kept_only_when_its_check_success_rose():
    assert _rl_left_out(result(0.25, 0.3125)) is None
    assert _rl_left_out(result(0.25, 0.25)) == "greedy success on its check tasks 0.250 -> 0.250 in 20 steps (no gain)"
    assert "0.500 -> 0.375" in _rl_left_out(result(0.5, 0.75, 0.375))  # the last evaluation decides, not the best
    assert _rl_left_out(result(0.5)) is None  # nothing to compare: kept


def test_the_check_split_is_a_stable_hash_split_of_the_train_tasks(tmp_path):
    lines = [json.dumps({"prompt": f"What is {i} minus 3?", "answer": i - 3}) for i in range(200)]
    (tmp_path / "rl_train.jsonl").write_text("\n".join(lines) + "\n")
    files = {"rl_train": str(tmp_path / "rl_train.jsonl")}
    fit, check = _rl_check_split(files, CycleTrainConfig(), tmp_path)
    fit_lines, check_lines = (open(p).read().splitlines() for p in (fit, check))
    assert sorted(fit_lines + check_lines) == sorted(lines) and not set(fit_lines) & set(check_lines)
    assert 30 <= len(check_lines) <= 70  # about a quarter of 200
    assert _rl_check_split(files, CycleTrainConfig(), tmp_path) == (fit, check)
    assert open(check).read().splitlines() == check_lines  # the same split again (a resumed cycle)
    (tmp_path / "few.jsonl").write_text("\n".join(lines[:RL_CHECK_MIN]) + "\n")
    assert _rl_check_split({"rl_train": str(tmp_path / "few.jsonl")}, CycleTrainConfig(), tmp_path) is None


def test_records_of_one_prompt_stay_on_one_side(tmp_path):
    lines = [json.dumps({"prompt_hash": f"h{i % 50}", "trace_id": f"t{i}"}) for i in range(200)]  # 4 traces each
    (tmp_path / "rl_train.jsonl").write_text("\n".join(lines) + "\n")
    fit, check = _rl_check_split({"rl_train": str(tmp_path / "rl_train.jsonl")}, CycleTrainConfig(), tmp_path)
    sides = {}
    for side, path in (("fit", fit), ("check", check)):
        for line in open(path).read().splitlines():
            sides.setdefault(json.loads(line)["prompt_hash"], set()).add(side)
    assert all(len(s) == 1 for s in sides.values()) and len(sides) == 50
