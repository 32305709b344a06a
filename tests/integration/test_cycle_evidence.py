"""What a cycle's gate decides on: per-task outcomes of both models kept in state.json and the
registry, a cycle with too few new failures that waits for more traffic (before training,
without resetting the daemon's count), and the best promoted score read from the registry.

An untrained tiny model under a gate that admits any measured candidate (delta 0, epsilon 1)
unless stated, so outcomes depend on the machinery, not on learning; a cycle trains two RL
steps in about a second."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flywheel.config import validate
from flywheel.envs import load_env
from flywheel.loop.cycle import WAITING, CycleState, LoopStores, _decide, run_cycle
from flywheel.loop.loop_config import LoopConfig
from flywheel.loop.paired import Outcomes


def _config(data_dir: Path, **over) -> dict:
    cfg = {
        "data_dir": str(data_dir),
        "curation": {"heldout_fraction": 0.25},
        "train": {"order": ["rl"], "rl": {
            "train": {"steps": 2, "groups_per_step": 2, "group_size": 4, "seed": 0},
            "sampling": {"temperature": 1.0, "max_tokens": 6}, "eval": {"tasks": 4}, "log": {"progress": False},
            "threads": 2}},
        "eval": {"suites": {"arith": {"env": "arithmetic", "tasks": 8, "max_tokens": 6}},
                 "new_failures_max_tokens": 6},
        "gate": {"delta": 0.0, "epsilon": 1.0},
    }
    for key, value in over.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def _add_failures(fw: LoopStores, start: int, n: int) -> None:
    """Failed traces t<start>..t<start+n-1> on train-split pairs, each with a verifier."""
    tasks = load_env("arithmetic").tasks("train", n=start + n, seed=7)[start:]
    fw.traces.add_traces([{"id": f"t{start + i}", "source": "serve", "prompt": t.prompt,
                           "response": {"role": "assistant", "content": "0"}} for i, t in enumerate(tasks)])
    for i, t in enumerate(tasks):
        fw.traces.add_feedback(f"t{start + i}", {"score": 0.0,
                                                 "verifier": {"env": "arithmetic", "task": dataclasses.asdict(t)}})


def _rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _app():
    from flywheel.cli.main import app  # here: the CLI's imports are not needed by the other tests

    return app


def test_too_few_new_failures_wait_then_the_next_cycle_holds_them(tmp_path, untrained_tiny):
    cfg = validate(_config(tmp_path / "data"), LoopConfig)
    logs: list[str] = []
    with LoopStores(cfg) as fw:
        fw.registry.promote(fw.registry.register(untrained_tiny).id, "initial")
        _add_failures(fw, 0, 12)  # at most 12 held out: fewer than gate.min_new_failures (20)
        c1 = run_cycle(fw, log=logs.append)
        assert c1.done and c1.outcome == WAITING == "waiting for more traffic"
        reason = f"too few new failures to decide: {c1.new_failures} < 20; waiting for more traffic"
        assert c1.decision == {"promote": False, "reasons": [reason]} and f"c1: {reason}" in logs
        assert c1.stages_run == [] and c1.candidate_path is None and c1.version is None  # nothing trained
        assert [v.id for v in fw.registry.list()] == ["v1"]
        assert {r.stage for r in fw.ledger.read()} == {"curation"}
        assert not fw.outcomes_path.exists()  # nothing to put on the intelligence-per-dollar curve

        _add_failures(fw, 12, 148)
        logs.clear()
        c2 = run_cycle(fw, log=logs.append)
        assert c2.outcome == "promoted", (c2.decision, logs)
        # the window did not move: c2's new failures are c1's and the newer ones
        assert c2.since_cursor == c1.since_cursor == 0 and c2.new_failures >= 20
        traces = [r["trace_id"] for r in _rows(c2.files["new_failures"])]
        assert {r["trace_id"] for r in _rows(c1.files["new_failures"])} <= set(traces)
        # per-task outcomes of both models, on the same tasks, in the state and with the version
        state = json.loads((fw.cycles_dir / "c2" / "state.json").read_text())
        assert state["task_ids"]["new_failures"] == [r["task"]["id"] for r in _rows(c2.files["new_failures"])]
        assert len(state["task_ids"]["arith"]) == 8
        for who in ("incumbent", "candidate"):
            for suite, n in (("new_failures", c2.new_failures), ("arith", 8)):
                rec = state["outcomes"][who][suite]
                o = Outcomes.from_record(rec)
                assert o.n == n and len(rec["passed"]) == (n + 3) // 4  # one bit per task
                assert o.accuracy == pytest.approx(state["scores"][who][suite])
                assert o.tasks == Outcomes.of(state["task_ids"][suite], o.passed).tasks
        assert fw.registry.get("v2").eval_scores["outcomes"] == state["outcomes"]
        gate = next(m for m in logs if "gate: promote" in m)
        assert "95% lower bound" in gate and f"of {c2.new_failures} tasks) >= delta 0.0 pts" in gate

    status = CliRunner().invoke(_app(), ["loop", "status", "--data-dir", cfg.data_dir], terminal_width=200).stdout
    assert f"c1: {WAITING} from v1" in status and f"      {reason}" in status, status
    assert "c2: promoted v2 from v1" in status


def test_the_gate_holds_a_candidate_to_the_best_promoted_score(tmp_path, untrained_tiny):
    """v1 passed 8 of 8 arith tasks, v2 (promoted at 7 of 8) is the incumbent; a candidate at
    6 of 8 is within epsilon (20 points) of v2 but 25 points below v1: rejected."""
    cfg = validate(_config(tmp_path / "data", gate={"epsilon": 0.2, "min_new_failures": 4}), LoopConfig)
    arith = [f"arith-{i}" for i in range(8)]
    new = [f"nf-{i}" for i in range(4)]
    v1, v2, cand = (Outcomes.of(arith, [i < k for i in range(8)]) for k in (8, 7, 6))
    nf_inc, nf_cand = Outcomes.of(new, [False] * 4), Outcomes.of(new, [True] * 4)
    with LoopStores(cfg) as fw:
        fw.registry.promote(fw.registry.register(untrained_tiny).id, "initial")
        fw.registry.register(untrained_tiny, parent="v1", eval_scores={
            "incumbent": {"arith": v1.accuracy}, "candidate": {"arith": v2.accuracy},
            "outcomes": {"incumbent": {"arith": v1.record()}, "candidate": {"arith": v2.record()}}})
        fw.registry.promote("v2", "gate")
        st = CycleState(id="c2", stage="evaluated", started_at="now", incumbent="v2", incumbent_path="x",
                        trace_cursor=0, since_cursor=0,
                        scores={"incumbent": {"arith": v2.accuracy, "new_failures": 0.0},
                                "candidate": {"arith": cand.accuracy, "new_failures": 1.0}},
                        outcomes={"incumbent": {"arith": v2.record(), "new_failures": nf_inc.record()},
                                  "candidate": {"arith": cand.record(), "new_failures": nf_cand.record()}})
        _decide(fw, st, lambda m: None)
    assert not st.decision["promote"], st.decision
    assert st.decision["below_best"] == {"arith": pytest.approx(-0.25)}
    assert "arith 0.875 -> 0.750 (-12.5 pts, 95% upper bound" in st.decision["reasons"][1]
    assert st.decision["reasons"][2].startswith("arith best 1.000 (v1) -> 0.750 (-25.0 pts, 95% upper bound")
    assert st.decision["reasons"][2].endswith("0 gained, 2 lost of 8 tasks): drops more than epsilon 20.0 pts "
                                              "below the best promoted score")


def test_the_daemon_waits_for_more_traffic_without_resetting_its_count(tmp_path, untrained_tiny):
    from flywheel.daemon.loop_daemon import STATUS_FILE, LoopDaemon
    from flywheel.train.stop import clear_stop

    cfg = validate(_config(tmp_path / "data", serve={"enabled": False},
                           trigger={"min_new_failures": 4, "poll_s": 0.1}), LoopConfig)
    with LoopStores(cfg) as fw:
        fw.registry.promote(fw.registry.register(untrained_tiny).id, "initial")
        _add_failures(fw, 0, 8)
    logs: list[str] = []
    daemon = LoopDaemon(cfg, log=logs.append)
    status_path = Path(cfg.data_dir) / STATUS_FILE

    def status() -> dict:
        return json.loads(status_path.read_text()) if status_path.exists() else {}

    def wait_for(predicate, what: str, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}: {logs}")

    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: status().get("cycles_run") == 1 and status().get("state") == "idle", "c1")
        time.sleep(0.5)  # five polls: 8 failures >= 4, but none since c1 waited
        s = status()
        assert s["cycles_run"] == 1 and s["new_failures"] == 8 and s["last_cycle"]["outcome"] == WAITING
        assert s["waiting"].startswith("c1: too few new failures to decide: ")
        assert s["waiting"].endswith("< 20; waiting for more traffic; the next cycle starts after 4 more failures "
                                     "(0 so far)")
        assert "cycle: 8 new failures >= 4" in logs
        assert f"{WAITING}: the next cycle starts after 4 more failed traces" in logs
        with LoopStores(cfg) as fw:
            _add_failures(fw, 8, 4)
        wait_for(lambda: status().get("cycles_run") == 2 and status().get("state") == "idle", "c2")
        assert "cycle: 12 new failures, 4 since the last cycle waited for more traffic >= 4" in logs
        s = status()
        assert s["new_failures"] == 12 and s["waiting"].startswith("c2: too few new failures to decide")  # not reset
        text = CliRunner().invoke(_app(), ["loop", "status", "--data-dir", cfg.data_dir], terminal_width=200).stdout
        assert f"  {WAITING}: c2: too few new failures to decide" in text, text
        assert "12 new failures [min_new_failures=4]" in text
    finally:
        daemon.stop()
        thread.join(timeout=60)
        clear_stop()
    assert not thread.is_alive()
