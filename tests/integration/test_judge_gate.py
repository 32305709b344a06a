"""The gate decides on verified suites only: judge feedback trains (DPO pairs) but never becomes a
task the gate plays. A cycle over a store that holds judged chat traces beside failed traces with a
verifier: its new-failure suite is exactly the verifier's failures, its scores are those of the
frozen suite and the new failures, and with judged traces alone it has nothing to gate on."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from flywheel.config import validate
from flywheel.envs import load_env
from flywheel.loop.cycle import LoopStores, run_cycle
from flywheel.loop.judging import run_judge
from flywheel.loop.loop_config import LoopConfig


class Scripted:
    """A judge preferring the first answer of each pair (the judge's wiring is tests/unit/test_judge.py's)."""

    model = "scripted-judge"

    def chat(self, conversations, max_tokens):
        return ['{"scores": {"1": 0.9, "2": 0.1}, "explanation": "1 is right"}' for _ in conversations]


def _config(data_dir: Path) -> dict:
    return {
        "data_dir": str(data_dir),
        "curation": {"heldout_fraction": 0.5},
        "train": {"order": ["dpo"], "min_examples": 1,
                  "dpo": {"train": {"steps": 1, "batch_size": 2}, "log": {"progress": False}, "threads": 1}},
        "eval": {"suites": {"arith": {"env": "arithmetic", "tasks": 4, "max_tokens": 4}}, "new_failures_max_tokens": 4},
        "gate": {"delta": 0.0, "epsilon": 1.0, "min_new_failures": 1},
    }


def _seed(cfg: LoopConfig, model: Path, verified: int) -> tuple[set[str], set[str]]:
    """Production v1; `verified` failed arithmetic traces with a verifier, and 8 chat prompts with
    two answers each that the judge scores. Returns (verifier task ids, judged trace ids)."""
    tasks = load_env("arithmetic").tasks("train", n=verified, seed=3)
    with LoopStores(cfg) as fw:
        fw.registry.promote(fw.registry.register(model).id, "initial")
        fw.traces.add_traces([{"id": f"v{i}", "source": "serve", "prompt": t.prompt,
                               "response": {"role": "assistant", "content": "0"}} for i, t in enumerate(tasks)])
        for i, t in enumerate(tasks):
            fw.traces.add_feedback(f"v{i}", {"score": 0.0, "verifier": {"env": "arithmetic",
                                                                         "task": dataclasses.asdict(t)}})
        judged = [{"id": f"j{p}-{k}", "source": "agent", "messages": [{"role": "user", "content": f"Name colour {p}"}],
                   "response": {"role": "assistant", "content": answer}}
                  for p in range(8) for k, answer in enumerate(("red", "I cannot"))]
        fw.traces.add_traces(judged)
        report = run_judge(fw.traces, Scripted(), cfg.curation)
        assert report.scores_written == 16
        assert report.left_alone == ({"a verifier grades it": verified} if verified else {})
    return {t.id for t in tasks}, {j["id"] for j in judged}


def test_judged_traces_alone_give_the_gate_nothing(tmp_path, untrained_tiny):
    cfg = validate(_config(tmp_path / "data"), LoopConfig)
    _, judged = _seed(cfg, untrained_tiny, verified=0)
    with LoopStores(cfg) as fw:
        st = run_cycle(fw, log=lambda m: None)
    assert st.new_failures == 0 and st.candidate_path is None and not st.scores
    items = st.curation["items"]
    assert items["dpo"]["train"] + items["dpo"]["heldout"] == 8  # the judge's pairs are curated...
    assert items["rl"] == {"train": 0, "heldout": 0}  # ...and none is a task a suite could play


def test_a_cycle_gates_on_the_verifiers_failures_not_on_judged_traces(tmp_path, untrained_tiny):
    cfg = validate(_config(tmp_path / "data"), LoopConfig)
    verified, judged = _seed(cfg, untrained_tiny, verified=8)
    with LoopStores(cfg) as fw:
        st = run_cycle(fw, log=lambda m: None)
    assert [s["stage"] for s in st.stages_run] == ["dpo"] and "skipped" not in st.stages_run[0]
    rows = [json.loads(line) for line in Path(st.files["new_failures"]).read_text().splitlines()]
    assert rows and all(r["env"] == "arithmetic" and r["trace_id"].startswith("v") for r in rows)
    assert not {r["trace_id"] for r in rows} & judged
    assert set(st.scores["candidate"]) == set(st.task_ids) == {"arith", cfg.gate.new_failures}
    assert set(st.task_ids[cfg.gate.new_failures]) <= verified
    assert st.decision and st.outcome in ("promoted", "rejected")
