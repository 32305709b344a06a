"""Retention (loop/retention.py): the rules of what to delete, checked by hand on small inputs;
the passes on fake cycle folders; and the registry's pruning (Registry.prune): the record
stays, the files go, promotion and rollback to a pruned version fail naming it and why, and a
SIGKILL mid-prune leaves a marked version whose leftovers the next prune or registration removes.

Models are fake Hugging Face folders (config.json + a few bytes of weights): nothing is loaded.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from flywheel.cli.main import app
from flywheel.config import ConfigError, validate
from flywheel.crash_points import kill_at
from flywheel.loop.loop_config import LoopConfig, stage_config
from flywheel.loop.retention import (
    RetentionConfig,
    after_cycle,
    after_stage,
    human_bytes,
    prune_rejected,
    rejected_to_prune,
    stage_model_dirs,
    tree_bytes,
    with_checkpoint_keep,
)
from flywheel.registry import Registry, RegistryError, StatusError

SFT_FILLED = dict(model="m", output_dir="o", resume=True, data={"train": ["t.jsonl"], "format": "chat"})


def weights(folder: Path, seed: int, size: int = 4096) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "seed": seed}))
    (folder / "model.safetensors").write_bytes(bytes((seed + i) % 256 for i in range(size)))
    return folder


# ---------------------------------------------------------------------------- the rules


def test_a_stage_keeps_the_retention_checkpoints_unless_it_sets_its_own():
    assert with_checkpoint_keep({}, 1) == {"checkpoint": {"keep": 1}}
    assert with_checkpoint_keep({"checkpoint": {"every": 5}, "threads": 2}, 1) == {
        "checkpoint": {"every": 5, "keep": 1}, "threads": 2}
    assert with_checkpoint_keep({"checkpoint": {"keep": 4}}, 1) == {"checkpoint": {"keep": 4}}
    assert with_checkpoint_keep({"checkpoint": "bad"}, 1) == {"checkpoint": "bad"}  # validation names it
    # through the loop config: the default, a retention setting, a stage's own setting
    assert stage_config(validate({}, LoopConfig), "sft", **SFT_FILLED).checkpoint.keep == 1
    cfg = validate({"retention": {"keep_checkpoints": 2}, "train": {"dpo": {"checkpoint": {"keep": 5}}}}, LoopConfig)
    assert stage_config(cfg, "sft", **SFT_FILLED).checkpoint.keep == 2
    assert stage_config(cfg, "dpo", model="m", output_dir="o", resume=True,
                        data={"train": ["t.jsonl"]}).checkpoint.keep == 5


def test_retention_settings_are_bounded_and_errors_name_the_field():
    assert validate({}, LoopConfig).retention == RetentionConfig(
        keep_checkpoints=1, drop_optimizer_state=True, keep_stage_models=False, keep_rejected=3)
    assert validate({"retention": {"keep_rejected": None}}, LoopConfig).retention.keep_rejected is None
    for field, bad in (("keep_checkpoints", 0), ("keep_rejected", -1)):
        with pytest.raises(ConfigError, match=f"retention.{field}"):
            validate({"retention": {field: bad}}, LoopConfig)


def test_rejected_versions_beyond_the_newest_n_are_pruned_and_nothing_else():
    versions = [("v1", "archived"), ("v2", "rejected"), ("v3", "production"), ("v4", "rejected"),
                ("v5", "rejected"), ("v6", "candidate"), ("v7", "rejected")]
    assert rejected_to_prune(versions, 2, protected=()) == ["v2", "v4"]  # v5, v7 are the newest two
    assert rejected_to_prune(versions, 2, protected={"v2"}) == ["v4"]
    assert rejected_to_prune(versions, 0, protected=()) == ["v2", "v4", "v5", "v7"]
    assert rejected_to_prune(versions, 4, protected=()) == []
    assert rejected_to_prune([("v1", "production"), ("v2", "archived")], 0, protected=()) == []


def test_a_finished_cycle_loses_the_model_folders_of_every_stage_it_names(tmp_path):
    assert stage_model_dirs(tmp_path, {"sft", "rl"}) == [
        tmp_path / "rl" / "checkpoints", tmp_path / "rl" / "final",
        tmp_path / "sft" / "checkpoints", tmp_path / "sft" / "final"]


def test_disk_use_counts_a_hard_linked_file_once_and_reads_like_du(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_bytes(b"1" * 1000)
    os.link(tmp_path / "a" / "x", tmp_path / "a" / "y")
    (tmp_path / "a" / "z").write_bytes(b"22")
    assert tree_bytes(tmp_path / "a") == 1002 and tree_bytes(tmp_path / "a" / "z") == 2
    assert tree_bytes(tmp_path / "missing") == 0
    assert [human_bytes(n) for n in (532, 1000, 17_312_000, 345_432_285, 1_204_000_000)] == [
        "532 B", "1 kB", "17.3 MB", "345 MB", "1.2 GB"]


# ---------------------------------------------------------------------------- the passes on cycle folders


def _stage(folder: Path, steps: tuple[int, ...]) -> None:
    for step in steps:
        ckpt = weights(folder / "checkpoints" / f"step_{step:08d}", step)
        (ckpt / "trainer_state.pt").write_bytes(b"o" * 800)
    weights(folder / "final", 0)
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')


def test_after_a_stage_only_finished_stages_lose_their_trainer_state(tmp_path):
    cycle = tmp_path / "c1"
    _stage(cycle / "sft", (1, 2))
    _stage(cycle / "dpo", (1,))  # running (not in stages_run): its resume reads this state
    stages_run = [{"stage": "sft", "final_model": str(cycle / "sft" / "final")},
                  {"stage": "rl", "skipped": "3 curated examples < min_examples 4"}]
    logs: list[str] = []
    assert after_stage(RetentionConfig(drop_optimizer_state=False), cycle, stages_run, logs.append) == 0
    assert after_stage(RetentionConfig(), cycle, stages_run, logs.append) == 1600
    assert not list((cycle / "sft").rglob("trainer_state.pt"))
    assert (cycle / "sft" / "checkpoints" / "step_00000002" / "model.safetensors").is_file()
    assert (cycle / "sft" / "final" / "model.safetensors").is_file()
    assert (cycle / "dpo" / "checkpoints" / "step_00000001" / "trainer_state.pt").is_file()
    assert logs == ["c1: retention freed 1.6 kB of optimizer state"]
    assert after_stage(RetentionConfig(), cycle, stages_run, logs.append) == 0 and len(logs) == 1  # done once


def test_after_a_cycle_finished_cycles_keep_state_data_and_metrics_only(tmp_path):
    done = SimpleNamespace(id="c1", done=True, incumbent="v1",
                           stages_run=[{"stage": "sft"}, {"stage": "rl", "skipped": "budget"}])
    running = SimpleNamespace(id="c2", done=False, incumbent="v2", stages_run=[{"stage": "sft"}])
    for st in (done, running):
        _stage(tmp_path / st.id / "sft", (3,))
        (tmp_path / st.id / "state.json").write_text("{}")
        (tmp_path / st.id / "data").mkdir()
        (tmp_path / st.id / "data" / "sft_train.jsonl").write_text("{}\n")
    _stage(tmp_path / "c1" / "rl", (1,))  # started, cut short, then skipped for budget
    weights(tmp_path / "c1" / "sft" / ".tmp-retention-final", 9)  # a removal killed midway
    with Registry(tmp_path / "registry") as reg:
        _versions(reg, tmp_path, 3)
        for vid in ("v1", "v2", "v3"):  # v2, rejected by hand since c2 started from it, is c2's incumbent
            reg.reject(vid, "gate")
        keep_all = RetentionConfig(keep_stage_models=True, keep_rejected=None)
        assert after_cycle(keep_all, tmp_path, [done, running], reg, print) == {"stage models": 0,
                                                                                "rejected models": 0}
        logs: list[str] = []
        freed = after_cycle(RetentionConfig(keep_rejected=0), tmp_path, [done, running], reg, logs.append)
        assert [v.id for v in reg.list() if v.pruned] == ["v1", "v3"]
    left = sorted(str(p.relative_to(tmp_path / "c1")) for p in (tmp_path / "c1").rglob("*") if p.is_file())
    assert left == ["data/sft_train.jsonl", "rl/metrics.jsonl", "sft/metrics.jsonl", "state.json"]
    assert freed["stage models"] > 0 and freed["rejected models"] == 2 * tree_bytes(tmp_path / "m1")
    assert logs == [f"c2: retention freed {human_bytes(freed['stage models'])} of stage models, "
                    f"{human_bytes(freed['rejected models'])} of rejected models"]
    assert (tmp_path / "c2" / "sft" / "final" / "model.safetensors").is_file()  # an unfinished cycle's
    assert (tmp_path / "c2" / "sft" / "checkpoints" / "step_00000003" / "trainer_state.pt").is_file()


# ---------------------------------------------------------------------------- pruning the registry


@pytest.fixture
def reg(tmp_path):
    with Registry(tmp_path / "registry") as r:
        yield r


def _versions(reg: Registry, tmp_path: Path, n: int) -> None:
    for i in range(1, n + 1):
        reg.register(weights(tmp_path / f"m{i}", i), eval_scores={"arith": i / 10}, parent=f"v{i - 1}" if i > 1 else None)


def test_a_pruned_version_keeps_its_record_and_cannot_come_back(reg, tmp_path):
    _versions(reg, tmp_path, 3)
    reg.promote("v1")
    reg.reject("v2", "arith -3 pts > eps 2")
    for vid, status in (("v1", "production"), ("v3", "candidate")):
        with pytest.raises(StatusError, match=f"version {vid} is {status}; only a rejected version can be pruned"):
            reg.prune(vid, "test")
    with pytest.raises(RegistryError, match="pruning v2 needs a reason"):
        reg.prune("v2", " ")
    v2 = reg.prune("v2", "too old")
    assert v2.pruned and v2.pruned_reason == "too old" and not v2.path.exists()
    assert v2.status == "rejected" and v2.reasons == ["arith -3 pts > eps 2"] and v2.eval_scores == {"arith": 0.2}
    assert [v.id for v in reg.lineage("v3")] == ["v3", "v2", "v1"]
    assert [(e.action, e.version) for e in reg.history()] == [("promote", "v1"), ("reject", "v2")]
    assert reg.verify("v2") == [f"model files pruned {v2.pruned_at:%Y-%m-%d %H:%M:%S} UTC (too old)"]
    assert reg.verify("v1") == [] and reg.verify("v3") == []
    assert reg.prune("v2", "again").pruned_reason == "too old"  # idempotent: the first mark stays
    with pytest.raises(StatusError, match=r"version v2 cannot be promoted: its model files were pruned .* "
                                          r"UTC \(too old\); only its record is left"):
        reg.promote("v2")
    assert [v.pruned for v in reg.list()] == [False, True, False] and reg.list(status="rejected")[0].pruned
    assert reg.get("v2").to_dict()["pruned_at"] == v2.pruned_at.isoformat()


def test_rollback_to_a_pruned_version_names_it_and_why(reg, tmp_path):
    _versions(reg, tmp_path, 2)
    reg.promote("v1")
    reg.promote("v2")
    reg.reject("v1", "found a data leak")  # an archived version rejected by hand
    assert reg.rollback_target() == "v1"
    assert prune_rejected(reg, 0) == 0 and not reg.get("v1").pruned  # the rollback target keeps its files
    reg.prune("v1", "by hand")
    with pytest.raises(StatusError, match=r"version v1 cannot be rolled back to: its model files were pruned .*"
                                          r"\(by hand\)"):
        reg.rollback()


def test_prune_rejected_keeps_the_newest_n_and_every_version_not_rejected(reg, tmp_path):
    _versions(reg, tmp_path, 6)
    reg.promote("v1")
    reg.promote("v3")
    for vid in ("v2", "v4", "v5", "v6"):
        reg.reject(vid, "gate")
    size = tree_bytes(reg.get("v2").path)
    assert prune_rejected(reg, 2) == 2 * size
    assert {v.id: v.pruned for v in reg.list()} == {"v1": False, "v2": True, "v3": False, "v4": True,
                                                     "v5": False, "v6": False}
    assert reg.get("v4").pruned_reason == "retention.keep_rejected=2: older than the newest 2 rejected versions"
    assert prune_rejected(reg, 2) == 0
    assert sorted(os.listdir(reg.models)) == ["v1", "v3", "v5", "v6"]


def _prune_and_die(root: str, vid: str, point: str) -> None:
    kill_at(point)
    with Registry(root) as r:
        r.prune(vid, "crash test")


@pytest.mark.parametrize("point", ["prune:marked", "prune:hidden"])
def test_sigkill_mid_prune_leaves_a_marked_version_whose_leftovers_go_next_time(tmp_path, point):
    root = tmp_path / "registry"
    with Registry(root) as r:
        _versions(r, tmp_path, 2)
        r.reject("v2", "gate")
    child = multiprocessing.get_context("fork").Process(target=_prune_and_die, args=(str(root), "v2", point))
    child.start()
    child.join(30)
    assert child.exitcode == -signal.SIGKILL
    with Registry(root) as r:
        assert r.get("v2").pruned and r.verify("v1") == []
        left = sorted(os.listdir(r.models))
        assert left == (["v1", "v2"] if point == "prune:marked" else [".pruned-v2", "v1"])
        if point == "prune:marked":
            assert prune_rejected(r, 0) > 0  # its folder is whole: pruned again
        else:
            r.register(weights(tmp_path / "m3", 3))  # a registration sweeps the hidden folder
        assert sorted(os.listdir(r.models)) == (["v1"] if point == "prune:marked" else ["v1", "v3"])


def test_registry_cli_shows_pruned_versions_and_refuses_them(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path / "data"))
    with Registry() as r:
        _versions(r, tmp_path, 2)
        r.promote("v1")
        r.reject("v2", "regressed")
        size = r.prune("v2", "retention").size
    run = lambda *args: CliRunner().invoke(app, ["registry", *args])  # noqa: E731
    lines = run("list").stdout.splitlines()
    assert lines[1].split()[:3] == ["*", "v1", "production"]
    assert lines[2].split()[:4] == ["v2", "rejected", "(pruned)", "v1"]
    shown = run("show", "v2").stdout
    assert f"files        2, {size} bytes, model files pruned " in shown and "(retention)" in shown
    assert json.loads(run("show", "v2", "--json").stdout)["pruned_reason"] == "retention"
    r = run("promote", "v2")
    assert r.exit_code == 2 and r.stderr.startswith("error: version v2 cannot be promoted: its model files were "
                                                    "pruned ") and "(retention)" in r.stderr
