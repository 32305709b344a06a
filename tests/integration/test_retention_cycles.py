"""Ten cycles under the default retention settings stay under a stated disk bound: finished
stages lose their optimizer state, finished cycles their stage models, the registry its
rejected candidates beyond the newest three, while production, the rollback target and every
archived version stay intact. Three of the cycles are SIGKILLed (after a stage, before the next
stage's record, mid-prune) and resume.

A tiny untrained model (hidden 128, about 2.3 MB of weights, so the models dominate the
data_dir) and SFT then DPO, two steps each with a checkpoint at every step: a cycle takes
about a second on 2 cores. Whether a cycle promotes is set by its gate (any candidate, or
none), not by learning."""

from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flywheel.cli.main import app
from flywheel.config import validate
from flywheel.envs import load_env
from flywheel.loop.cycle import LoopStores, pending_cycle, run_cycle
from flywheel.loop.loop_config import LoopConfig
from flywheel.loop.retention import tree_bytes

N_CYCLES = 10
PROMOTED = {1, 4, 7, 10}  # their gate admits any candidate; the others' admits none
KILLED = {3: "train:sft", 5: "cost:c5/dpo/to-step-2", 8: "prune:hidden"}  # run as `loop cycle`, SIGKILLed there
SLACK = 1_000_000  # the rest: databases, ledger, the cycles' curated data, metrics and state

pytestmark = pytest.mark.slow  # ten cycles and three resumes; the rules are tests/unit/test_retention.py's


def _config(data_dir: Path, promote: bool) -> dict:
    quiet = {"log": {"progress": False}, "threads": 1, "checkpoint": {"every": 1}}
    return {
        "data_dir": str(data_dir),
        "curation": {"heldout_fraction": 0.5},
        "train": {"order": ["sft", "dpo"], "min_examples": 1, "replay_ratio": 0, "anchor_rows": 0,
                  "sft": {"train": {"steps": 2, "batch_size": 2, "micro_batch_size": 2}, **quiet},
                  "dpo": {"train": {"steps": 2, "batch_size": 2}, **quiet}},
        "eval": {"suites": {"arith": {"env": "arithmetic", "tasks": 4, "max_tokens": 4}},
                 "new_failures_max_tokens": 4, "new_failures_max": 4},
        # 4 new failures a cycle: the gate's minimum is lowered to them (the disk, not the decision, is checked)
        "gate": {"min_new_failures": 1, **({"delta": 0.0, "epsilon": 1.0} if promote else {"delta": 0.9})},
    }


def _add_failures(fw: LoopStores, cycle: int, n: int = 8) -> None:
    """`n` failed, corrected traces with a verifier: SFT rows, DPO pairs and new failures to gate on."""
    tasks = load_env("arithmetic").tasks("train", n=n, seed=100 + cycle)
    fw.traces.add_traces([{"id": f"c{cycle}-{i}", "source": "serve", "messages": [{"role": "user", "content": t.prompt}],
                           "response": {"role": "assistant", "content": "0"}} for i, t in enumerate(tasks)])
    for i, t in enumerate(tasks):
        fw.traces.add_feedback(f"c{cycle}-{i}", {"score": 0.0, "correction": {"role": "assistant", "content": t.answer},
                                                 "verifier": {"env": "arithmetic", "task": dataclasses.asdict(t)}})


def _files(root: Path, pattern: str) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(pattern))


def _after_kill(fw: LoopStores, cycle: int) -> None:
    """What a SIGKILL at KILLED[cycle] left, before the resume."""
    folder = fw.cycles_dir / f"c{cycle}"
    if cycle == 3:  # sft recorded as finished, its trainer state not yet dropped
        assert [s["stage"] for s in pending_cycle(fw).stages_run] == ["sft"]
        assert _files(folder, "trainer_state.pt") == ["sft/checkpoints/step_00000002/trainer_state.pt"]
    elif cycle == 5:  # dpo trained, not recorded: its one checkpoint keeps what resuming it needs
        assert [s["stage"] for s in pending_cycle(fw).stages_run] == ["sft"]
        assert _files(folder, "trainer_state.pt") == ["dpo/checkpoints/step_00000002/trainer_state.pt"]
        assert _files(folder / "sft", "model.safetensors") == ["checkpoints/step_00000002/model.safetensors",
                                                               "final/model.safetensors"]
    else:  # the cycle finished; v4, pruned, is marked and hidden
        assert pending_cycle(fw) is None and fw.registry.get("v4").pruned
        assert (fw.registry.models / ".pruned-v4").is_dir() and not (fw.registry.models / "v4").exists()


def test_ten_cycles_stay_under_the_bound_and_resume_after_kills(tmp_path, forked_cli):
    from flywheel.models import TinySpec, build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", TinySpec(hidden=128, layers=2, heads=2, ffn=512))
    data, path = tmp_path / "data", tmp_path / "loop.yaml"
    with LoopStores(validate(_config(data, True), LoopConfig)) as fw:
        fw.registry.promote(fw.registry.register(model).id, "initial")
        _add_failures(fw, 0, n=16)
    for c in range(1, N_CYCLES + 1):
        raw = _config(data, c in PROMOTED)
        cfg = validate(raw, LoopConfig)
        with LoopStores(cfg) as fw:
            _add_failures(fw, c)
        logs: list[str] = []
        if c in KILLED:
            path.write_text(yaml.safe_dump(raw))
            child = forked_cli(["loop", "cycle", path], kill_at=KILLED[c])
            assert child.wait() == -signal.SIGKILL, child.output[-2000:]
            with LoopStores(cfg) as fw:
                _after_kill(fw, c)
        if c != 8:  # c8 had finished when it was killed
            with LoopStores(cfg) as fw:
                st = run_cycle(fw, log=logs.append)
            assert (st.id, st.outcome) == (f"c{c}", "promoted" if c in PROMOTED else "rejected"), (st.decision, logs)
        if c == 5:
            assert any("resumed from" in m and "dpo/checkpoints/step_00000002" in m for m in logs), logs

    with LoopStores(cfg) as fw:
        reg = fw.registry
        assert reg.production().id == "v11" and reg.rollback_target() == "v8"
        pruned = {v.id for v in reg.list() if v.pruned}
        assert pruned == {"v3", "v4", "v6"}  # rejected: v3 v4 v6 v7 v9 v10; the newest three keep their files
        for v in reg.list():
            assert reg.verify(v.id) == ([] if v.id not in pruned else [
                f"model files pruned {v.pruned_at:%Y-%m-%d %H:%M:%S} UTC ({v.pruned_reason})"])
        kept = len(reg.list()) - len(pruned)  # 5 ever in production (rollback targets) + 3 rejected
        assert kept == len({"v1"} | {f"v{c + 1}" for c in PROMOTED}) + cfg.retention.keep_rejected == 8
        assert sorted(p.name for p in reg.models.iterdir()) == sorted(v.id for v in reg.list() if not v.pruned)
        model_bytes = max(v.size for v in reg.list())  # registered bytes of the largest copy
        v11_bytes = reg.get("v11").size
    assert _files(data, "trainer_state.pt") == [] and _files(data / "cycles", "final") == []
    assert _files(data / "cycles", "checkpoints") == [] and _files(data / "cycles", ".tmp-*") == []
    assert _files(data / "cycles" / "c1", "metrics.jsonl") == ["dpo/metrics.jsonl", "sft/metrics.jsonl"]

    # the bound: one model copy per version kept in the registry, plus SLACK for everything else
    used = tree_bytes(data)
    print(f"data_dir after {N_CYCLES} cycles: {used} bytes; bound {kept * model_bytes + SLACK}")
    assert used <= kept * model_bytes + SLACK, (used, kept, model_bytes)

    status = CliRunner().invoke(app, ["loop", "status", "--data-dir", str(data), "--json"])
    assert status.exit_code == 0, status.output
    shown = json.loads(status.stdout)
    assert shown["disk"]["total_bytes"] == used and shown["disk"]["registry_bytes"] == tree_bytes(data / "registry")
    by_cycle = {c["id"]: c["disk"] for c in shown["cycles"]}
    assert by_cycle["c2"]["model_pruned"] and by_cycle["c2"]["model_bytes"] == 0
    assert by_cycle["c10"] == {"cycle_bytes": tree_bytes(data / "cycles" / "c10"), "model_bytes": v11_bytes,
                               "model_pruned": False}
    text = CliRunner().invoke(app, ["loop", "status", "--data-dir", str(data)]).stdout
    assert f"disk: {used / 1e6:.3g} MB in {data} (registry " in text
    assert "c2: rejected v3 from v2," in text and text.split("c2: rejected v3")[1].split("\n")[0].endswith("model pruned")
