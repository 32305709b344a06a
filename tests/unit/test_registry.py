"""The model registry: registration and lineage, promote / rollback / reject, one production
version at any time, crash safety under SIGKILL at each step of a promotion, and the CLI.

Models are fake Hugging Face folders (config.json + a few bytes of "weights"): the registry
never loads them.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sqlite3
import threading
from pathlib import Path

import pytest
from sqlalchemy import update
from sqlalchemy.exc import IntegrityError
from typer.testing import CliRunner

from flywheel.cli.main import app
from flywheel.crash_points import kill_at
from flywheel.database import writing
from flywheel.registry import InvalidModelFolder, Registry, RegistryError, StatusError, VersionNotFound
from flywheel.registry.storage import VersionRow


def fake_model(folder: Path, seed: int = 0) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 8, "seed": seed}))
    (folder / "model.safetensors").write_bytes(bytes((seed + i) % 256 for i in range(4096)))
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "tokenizer.json").write_text('{"model": {}}')
    (folder / "trainer_state.pt").write_bytes(b"optimizer state, not part of the model")
    return folder


@pytest.fixture
def model(tmp_path) -> Path:
    return fake_model(tmp_path / "run" / "final")


@pytest.fixture
def reg(tmp_path):
    with Registry(tmp_path / "registry") as r:
        yield r


def productions(root: Path) -> list[str]:
    """Ids whose status is production, read with plain sqlite3 (no registry code involved)."""
    with sqlite3.connect(root / "registry.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        return [r[0] for r in db.execute("SELECT id FROM registry_versions WHERE status = 'production'")]


# ---- registration and lineage


def test_register_copies_the_folder_and_records_everything(reg, model):
    v = reg.register(model, cycle=7, data_counts={"sft": 120, "rl_tasks": 40}, config={"lr": 1e-4},
                     eval_scores={"arith": 0.5}, cost={"usd": 0.25, "device_seconds": 90.0}, notes="warm start")
    assert (v.id, v.parent, v.cycle, v.status, v.storage) == ("v1", None, "7", "candidate", "copy")
    assert v.data_counts == {"sft": 120, "rl_tasks": 40} and v.config == {"lr": 1e-4}
    assert v.eval_scores == {"arith": 0.5} and v.usd == 0.25 and v.notes == "warm start"
    assert v.path == reg.root / "models" / "v1" and v.source == str(model.resolve())
    assert sorted(v.files) == ["config.json", "model.safetensors", "tokenizer/tokenizer.json"]
    assert v.files["model.safetensors"][0] == 4096
    assert not (v.path / "trainer_state.pt").exists()  # trainer state stays with the run
    # deleting the run folder does not touch the registry's copy
    weights = (model / "model.safetensors").read_bytes()
    for f in sorted(model.rglob("*"), reverse=True):
        f.unlink() if f.is_file() else f.rmdir()
    model.rmdir()
    assert (v.path / "model.safetensors").read_bytes() == weights
    assert reg.verify("v1") == []
    with Registry(reg.root) as again:  # durable, and reopening keeps the records
        assert again.get("v1") == v


def test_hard_links_share_the_data_and_verify_catches_an_in_place_rewrite(reg, model):
    v = reg.register(model, link=True)
    assert v.storage == "hardlink"
    assert (v.path / "model.safetensors").stat().st_ino == (model / "model.safetensors").stat().st_ino
    (model / "model.safetensors").unlink()  # deleting the run's name keeps the data
    assert (v.path / "model.safetensors").stat().st_size == 4096 and reg.verify(v.id) == []
    with open(model / "tokenizer" / "tokenizer.json", "w") as f:  # a rewrite in place changes both names
        f.write("{}")
    assert reg.verify(v.id) == ["tokenizer/tokenizer.json: 2 bytes, registered with 13"]


def test_lineage_ids_listing_and_update(reg, tmp_path):
    v1 = reg.register(fake_model(tmp_path / "a", 1))
    v2 = reg.register(fake_model(tmp_path / "b", 2), parent=v1.id, cycle="c1")
    v3 = reg.register(fake_model(tmp_path / "c", 3), parent=v2.id, cycle="c2")
    assert [v.id for v in reg.lineage(v3.id)] == ["v3", "v2", "v1"]
    assert [v.id for v in reg.list()] == ["v1", "v2", "v3"]
    assert [v.id for v in reg.list(cycle="c2")] == ["v3"] and reg.list(status="production") == []
    assert (reg.get("v2").path / "model.safetensors").read_bytes()[:2] == bytes([2, 3])
    reg.update("v3", eval_scores={"regression": 0.9})
    v = reg.update("v3", eval_scores={"new_failures": 0.7}, cost={"usd": 1.5}, notes="gated")
    assert v.eval_scores == {"regression": 0.9, "new_failures": 0.7} and v.cost == {"usd": 1.5}
    assert v.notes == "gated" and reg.production() is None


def test_a_sqlite_url_puts_the_models_next_to_the_database(tmp_path, model):
    with Registry(f"sqlite:///{tmp_path}/elsewhere/models.db") as r:
        assert r.root == tmp_path / "elsewhere" and r.register(model).path == tmp_path / "elsewhere/models/v1"
        with pytest.raises(RegistryError, match="unknown status 'live' \\(one of: candidate, production, archived"):
            r.list(status="live")
    assert (tmp_path / "elsewhere" / "models.db").is_file()


def test_register_with_a_key_is_idempotent(reg, model):
    first = reg.register(model, cycle="c1", key="cycle-c1")
    assert reg.register(model, cycle="c1", key="cycle-c1") == first
    assert [v.id for v in reg.list()] == ["v1"] and sorted(os.listdir(reg.models)) == ["v1"]


def test_bad_inputs_are_named(reg, model, tmp_path):
    """The registry asks the one model-folder rule (models.loading.check_model_folder)."""
    cases = [
        (tmp_path / "nowhere", "model path .*nowhere' does not exist"),
        (model / "config.json", "config.json' is a file, not a model folder"),
    ]
    for folder, message in cases:
        with pytest.raises(InvalidModelFolder, match=message):
            reg.register(folder)
    no_config = fake_model(tmp_path / "no_config")
    (no_config / "config.json").unlink()
    with pytest.raises(InvalidModelFolder, match="no_config' is not a model folder: it has no config.json"):
        reg.register(no_config)
    (no_config / "config.json").write_text("{not json")
    with pytest.raises(InvalidModelFolder, match="config.json: invalid JSON at line 1"):
        reg.register(no_config)
    (no_config / "config.json").write_text("[1, 2]")
    with pytest.raises(InvalidModelFolder, match="holds list, expected a JSON object"):
        reg.register(no_config)
    (no_config / "config.json").write_text("{}")
    with pytest.raises(InvalidModelFolder, match="has no 'model_type'"):
        reg.register(no_config)
    (no_config / "config.json").write_text('{"model_type": "qwen2"}')
    (no_config / "model.safetensors").unlink()
    with pytest.raises(InvalidModelFolder, match=r"no_config' has a config but no weights \(\*.safetensors"):
        reg.register(no_config)  # trainer_state.pt is not a model's weights
    (no_config / "model.safetensors").write_bytes(b"x")
    (no_config / "config.json").write_text('{"model_type": "vit"}')  # load() could not load it: not registered
    with pytest.raises(InvalidModelFolder, match="model_type 'vit' is not a causal language model"):
        reg.register(no_config)
    with pytest.raises(VersionNotFound, match=r"unknown model version 'v9' .*\(versions: none registered yet\)"):
        reg.register(model, parent="v9")
    with pytest.raises(RegistryError, match="data_counts must be a mapping, got list"):
        reg.register(model, data_counts=[1])
    with pytest.raises(RegistryError, match="config is not JSON-serialisable"):
        reg.register(model, config={"x": object()})
    assert reg.list() == [] and os.listdir(reg.models) == []  # nothing half-made
    reg.register(model)
    with pytest.raises(VersionNotFound, match=r"unknown model version 'v2' in .*\(versions: v1\)"):
        reg.get("v2")


# ---- promotion, rollback, rejection


def test_promote_archives_the_previous_and_keeps_a_history(reg, tmp_path):
    for i in range(3):
        reg.register(fake_model(tmp_path / f"m{i}", i))
    assert reg.production() is None and tuple(reg.production_marker()) == (None, 0)
    reg.promote("v1", "first")
    reg.promote("v2", "new failures +12 pts")
    assert reg.production().id == "v2" and tuple(reg.production_marker()) == ("v2", 2)
    assert [v.status for v in reg.list()] == ["archived", "production", "candidate"]
    h = reg.history()
    assert [(e.action, e.previous, e.version, e.reason, e.generation) for e in h] == [
        ("promote", None, "v1", "first", 1), ("promote", "v1", "v2", "new failures +12 pts", 2)]
    assert h[0].at <= h[1].at and h[0].at.tzinfo is not None
    # an archived version may be promoted again
    reg.promote("v1", "back")
    assert productions(reg.root) == ["v1"] and reg.production_marker().generation == 3


def test_promoting_production_again_changes_nothing(reg, model):
    reg.register(model)
    reg.promote("v1", "first")
    before = (reg.production_marker(), reg.history(), reg.list())
    assert reg.promote("v1", "again").status == "production"
    assert (reg.production_marker(), reg.history(), reg.list()) == before


def test_rollback_walks_back_through_the_promotions(reg, tmp_path):
    for i in range(4):
        reg.register(fake_model(tmp_path / f"m{i}", i))
    with pytest.raises(StatusError, match="no version is in production"):
        reg.rollback()
    for vid in ("v1", "v2", "v3"):
        reg.promote(vid)
    assert reg.rollback(reason="latency regression").id == "v2"
    assert reg.rollback().id == "v1"
    with pytest.raises(StatusError, match="production version v1 replaced no earlier version"):
        reg.rollback()
    assert reg.rollback(to="v3").id == "v3"
    assert reg.rollback(to="v3").id == "v3"  # already there: no-op
    with pytest.raises(StatusError, match="version v4 was never in production; promote it"):
        reg.rollback(to="v4")
    with pytest.raises(VersionNotFound, match="'v8'"):
        reg.rollback(to="v8")
    log = [(e.action, e.previous, e.version, e.generation) for e in reg.history()]
    assert log[3:] == [("rollback", "v3", "v2", 4), ("rollback", "v2", "v1", 5), ("rollback", "v1", "v3", 6)]
    assert reg.history()[3].reason == "latency regression" and reg.history()[4].reason == "rollback from v2"
    assert productions(reg.root) == ["v3"] and tuple(reg.production_marker()) == ("v3", 6)


def test_marker_changes_even_when_an_id_comes_back(reg, tmp_path):
    reg.register(fake_model(tmp_path / "a", 1))
    reg.register(fake_model(tmp_path / "b", 2))
    reg.promote("v1")
    seen = reg.production_marker()
    reg.promote("v2")
    reg.rollback()
    assert reg.production_marker().version == seen.version and reg.production_marker() != seen


def test_reject(reg, tmp_path):
    for i in range(3):
        reg.register(fake_model(tmp_path / f"m{i}", i))
    v = reg.reject("v2", ["new failures +1 pt < delta 5", "arith -3 pts > eps 2"])
    assert v.status == "rejected" and v.reasons == ["new failures +1 pt < delta 5", "arith -3 pts > eps 2"]
    assert reg.reject("v2", "arith -3 pts > eps 2").reasons == v.reasons  # same reason again: no-op
    with pytest.raises(StatusError, match=r"version v2 is rejected \(new failures \+1 pt < delta 5; arith"):
        reg.promote("v2")
    with pytest.raises(RegistryError, match="rejecting v3 needs at least one reason"):
        reg.reject("v3", ["  "])
    reg.promote("v1")
    with pytest.raises(StatusError, match="version v1 is in production"):
        reg.reject("v1", "bad")
    reg.promote("v3")
    reg.reject("v1", "found a data leak")  # an archived version can be rejected ...
    with pytest.raises(StatusError, match=r"version v1 is rejected \(found a data leak\); cannot roll back"):
        reg.rollback()  # ... and is then no rollback target
    assert [e.action for e in reg.history()] == ["reject", "promote", "promote", "reject"]
    assert productions(reg.root) == ["v3"]


def test_the_database_refuses_a_second_production_row(reg, tmp_path):
    reg.register(fake_model(tmp_path / "a", 1))
    reg.register(fake_model(tmp_path / "b", 2))
    reg.promote("v1")
    with pytest.raises(IntegrityError), writing(reg.engine) as conn:
        conn.execute(update(VersionRow).where(VersionRow.id == "v2").values(status="production"))
    assert productions(reg.root) == ["v1"]


def test_concurrent_promotions_leave_one_production_and_a_gapless_history(reg, tmp_path):
    ids = [reg.register(fake_model(tmp_path / f"m{i}", i)).id for i in range(4)]
    errors = []

    def promoter(vid):
        try:
            with Registry(reg.root) as r:
                for _ in range(10):
                    r.promote(vid, f"thread {vid}")
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=promoter, args=(vid,)) for vid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    h = reg.history()
    assert [e.generation for e in h] == list(range(1, len(h) + 1))
    assert all(a.version == b.previous for a, b in zip(h, h[1:]))  # each change starts where the last ended
    assert productions(reg.root) == [h[-1].version] == [reg.production_marker().version]


# ---- SIGKILL at each step


def _promote_and_die(root: str, vid: str, point: str, action: str) -> None:
    kill_at(point)
    with Registry(root) as r:
        r.promote(vid, "child") if action == "promote" else r.rollback(reason="child")
    os._exit(3)  # the kill point was never reached


def _run_killed(*args) -> None:
    child = multiprocessing.get_context("fork").Process(target=_promote_and_die, args=args)
    child.start()
    child.join(30)
    assert child.exitcode == -signal.SIGKILL


STEPS = ["locked", "archived", "marked", "logged", "state", "committed"]


@pytest.mark.parametrize("action", ["promote", "rollback"])
@pytest.mark.parametrize("step", STEPS)
def test_sigkill_during_a_change_of_production_leaves_old_or_new(tmp_path, step, action):
    root = tmp_path / "registry"
    with Registry(root) as r:
        for i in range(3):
            r.register(fake_model(tmp_path / f"m{i}", i))
        r.promote("v1")
        if action == "rollback":
            r.promote("v2")
        before = r.production_marker()
    _run_killed(str(root), "v2", f"{action}:{step}", action)
    expected = ("v2" if action == "promote" else "v1") if step == "committed" else before.version
    assert productions(root) == [expected]
    with Registry(root) as r:  # reopens cleanly: nothing locked, nothing half-written
        marker = r.production_marker()
        assert marker.version == expected == r.history()[-1].version
        assert marker.generation == before.generation + (step == "committed")
        assert len(r.history()) == marker.generation
        r.promote("v3", "after the crash")
        assert productions(root) == ["v3"]


@pytest.mark.parametrize("step", ["locked", "marked", "committed"])
def test_sigkill_during_the_first_promotion_leaves_none_or_it(tmp_path, step):
    root = tmp_path / "registry"
    with Registry(root) as r:
        r.register(fake_model(tmp_path / "m", 0))
    _run_killed(str(root), "v1", f"promote:{step}", "promote")
    assert productions(root) == (["v1"] if step == "committed" else [])


def _register_and_die(root: str, folder: str, point: str) -> None:
    kill_at(point)
    with Registry(root) as r:
        r.register(folder)
    os._exit(3)


@pytest.mark.parametrize("step", ["register:copied", "register:renamed"])
def test_sigkill_during_register_leaves_no_version_and_no_lasting_debris(tmp_path, step):
    root = tmp_path / "registry"
    with Registry(root) as r:
        r.register(fake_model(tmp_path / "a", 1))
    child = multiprocessing.get_context("fork").Process(
        target=_register_and_die, args=(str(root), str(fake_model(tmp_path / "b", 2)), step))
    child.start()
    child.join(30)
    assert child.exitcode == -signal.SIGKILL
    with Registry(root) as r:
        assert [v.id for v in r.list()] == ["v1"]
        v = r.register(fake_model(tmp_path / "c", 3))
        assert v.id == "v2" and (v.path / "model.safetensors").read_bytes()[:1] == bytes([3])
        assert r.verify("v2") == [] and sorted(os.listdir(r.models)) == ["v1", "v2"]


# ---- command line


def test_cli_round_trip(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path / "data"))
    runner = CliRunner()
    run = lambda *args: runner.invoke(app, ["registry", *args])  # noqa: E731
    a, b = fake_model(tmp_path / "a", 1), fake_model(tmp_path / "b", 2)

    assert run("list").stdout.startswith("no versions registered in ")
    r = run("register", str(a))
    assert r.exit_code == 0, r.output
    assert r.stdout == f"registered v1 (candidate) from {a} -> {tmp_path / 'data/registry/models/v1'}\n"
    assert run("register", str(b), "--parent", "v1", "--cycle", "c1", "--notes", "try").exit_code == 0
    r = run("promote", "v1", "--reason", "baseline")
    assert (r.exit_code, r.stdout) == (0, "promoted v1 to production\n")
    assert run("promote", "v1").stdout == "v1 is already in production (nothing changed)\n"
    assert run("promote", "v2").stdout == "promoted v2 to production (was v1)\n"
    r = run("list")
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["ID", "STATUS", "PARENT", "CYCLE", "CREATED", "(UTC)", "USD", "EVAL"]
    assert lines[1].split()[:4] == ["v1", "archived", "-", "-"]
    assert lines[2].split()[:5] == ["*", "v2", "production", "v1", "c1"]
    r = run("show", "v2")
    assert "lineage      v2 <- v1" in r.stdout and "intact" in r.stdout and "notes        try" in r.stdout
    shown = json.loads(run("show", "v2", "--json").stdout)
    assert shown["lineage"] == ["v2", "v1"] and shown["status"] == "production" and shown["problems"] == []
    assert run("rollback").stdout == "rolled back production from v2 to v1\n"
    assert run("rollback", "--to", "v2").stdout == "rolled back production from v1 to v2\n"
    r = run("reject", "v1", "--reason", "regressed on arith", "--reason", "too slow")
    assert r.stdout == "rejected v1: regressed on arith; too slow\n"
    history = run("history").stdout.splitlines()
    assert [line.split()[2:6] for line in history] == [
        ["#1", "promote", "-", "->"], ["#2", "promote", "v1", "->"], ["#3", "rollback", "v2", "->"],
        ["#4", "rollback", "v1", "->"], ["#4", "reject", "v1", "regressed"]]
    # the default location is $FLYWHEEL_DATA_DIR/registry; --registry overrides it
    assert (tmp_path / "data" / "registry" / "registry.db").is_file()
    assert run("list", "--registry", str(tmp_path / "other")).stdout.startswith("no versions registered")


def test_cli_errors_are_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLYWHEEL_DATA_DIR", raising=False)
    runner = CliRunner()
    empty = tmp_path / "empty"
    empty.mkdir()
    r = runner.invoke(app, ["registry", "register", str(empty)])
    registry = tmp_path / "flywheel-data" / "registry"  # each error names the registry it used
    assert r.exit_code == 2 and r.stderr == (f"error: {str(empty)!r} is not a model folder: it has no config.json "
                                             f"(registry {registry})\n")
    assert (tmp_path / "flywheel-data" / "registry" / "registry.db").is_file()  # the default location
    r = runner.invoke(app, ["registry", "show", "v3"])
    assert r.exit_code == 2 and r.stderr.startswith("error: unknown model version 'v3'")
    runner.invoke(app, ["models", "register", str(fake_model(tmp_path / "m"))])
    runner.invoke(app, ["models", "reject", "v1", "--reason", "worse"])
    r = runner.invoke(app, ["models", "promote", "v1"])
    assert r.exit_code == 2 and r.stderr == "error: version v1 is rejected (worse); a rejected version " \
                                            f"cannot be promoted (registry {registry})\n"
    r = runner.invoke(app, ["models", "rollback"])
    assert r.exit_code == 2 and "nothing to roll back" in r.stderr
