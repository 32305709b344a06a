"""What the command line shows: help without a type on flags, --threads wherever torch runs,
`loop status` naming the folder it read, and one variable each for the data folder
($FLYWHEEL_DATA_DIR) and the cache ($FLYWHEEL_CACHE_DIR), the older names still working."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from flywheel.cli.main import app
from flywheel.locations import cache_dir, data_dir

WIDE = {"COLUMNS": "200", "TERMINAL_WIDTH": "200"}


def command_paths(group=None, prefix=()):
    """Every command and group of the `flywheel` tree, as argument lists."""
    group = group or get_command(app)
    yield list(prefix)
    for name, cmd in getattr(group, "commands", {}).items():
        if not getattr(cmd, "hidden", False):
            yield from command_paths(cmd, (*prefix, name)) if hasattr(cmd, "commands") else [[*prefix, name]]


def test_no_help_shows_a_type_on_a_flag():
    """typer 0.29 printed `--wait <bool>`, `--help <bool>`: a flag takes no value."""
    seen = 0
    for path in command_paths():
        out = CliRunner().invoke(app, [*path, "--help"], env=WIDE)
        assert out.exit_code == 0, (path, out.output)
        assert "<bool>" not in out.stdout, (path, out.stdout)
        assert "--help" in out.stdout
        seen += 1
    assert seen > 40
    create = CliRunner().invoke(app, ["jobs", "create", "--help"], env=WIDE).stdout
    assert "--full " in create and "--wait " in create and "<str>" in create  # flags listed; values keep types


@pytest.mark.parametrize("path", [["model", "demo-base"], ["generate"], ["serve"], ["demo"], ["loop", "run"],
                                  ["loop", "cycle"], ["env", "try"], ["worker"]])
def test_every_command_that_runs_torch_takes_threads(path):
    out = CliRunner().invoke(app, [*path, "--help"], env=WIDE).stdout
    assert "--threads" in out and "OMP_NUM_THREADS" in out, out


def test_a_bare_loop_status_names_the_folder_it_read_and_how_to_read_another(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLYWHEEL_DATA_DIR", raising=False)
    monkeypatch.delenv("FLYWHEEL_DATA", raising=False)
    out = CliRunner().invoke(app, ["loop", "status"], env=WIDE)
    assert out.exit_code == 0, out.output
    first = out.stdout.splitlines()[0]
    assert first == (f"data_dir: {tmp_path.resolve() / 'flywheel-data'} (from the default; a loop config, "
                     "--data-dir DIR or $FLYWHEEL_DATA_DIR reads another)")
    shown = json.loads(CliRunner().invoke(app, ["loop", "status", "--json"]).stdout)
    assert shown["data_dir"] == str(tmp_path.resolve() / "flywheel-data") and shown["data_dir_from"] == "the default"


def test_flywheel_data_dir_is_where_the_data_commands_look(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path / "data"))
    status = CliRunner().invoke(app, ["loop", "status"], env=WIDE).stdout
    assert status.startswith(f"data_dir: {tmp_path / 'data'} (from $FLYWHEEL_DATA_DIR;")
    from flywheel.registry import default_root

    assert default_root() == tmp_path / "data" / "registry"
    keys = CliRunner().invoke(app, ["keys", "list"])
    assert keys.exit_code == 0, keys.output
    assert (tmp_path / "data" / "jobs.db").exists() and not (tmp_path / "flywheel-data").exists()
    # an explicit --data-dir still wins
    assert CliRunner().invoke(app, ["keys", "list", "--data-dir", str(tmp_path / "d2")]).exit_code == 0
    assert (tmp_path / "d2" / "jobs.db").exists()
    # and the defaults that are not a --data-dir: a loop config's data_dir, the trace store's and
    # the cost ledger's files
    from flywheel.loop.loop_config import LoopConfig
    from flywheel.traces.db import default_url

    assert LoopConfig.model_fields["data_dir"].get_default(call_default_factory=True) == str(tmp_path / "data")
    assert default_url() == f"sqlite:///{(tmp_path / 'data' / 'traces.db').resolve()}"
    report = CliRunner().invoke(app, ["economics", "report", "--out", str(tmp_path / "r")])
    assert str(tmp_path / "data" / "ledger.jsonl") in report.output, report.output


def test_the_old_data_variable_still_works_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.delenv("FLYWHEEL_DATA_DIR", raising=False)
    monkeypatch.setenv("FLYWHEEL_DATA", str(tmp_path / "old"))
    with pytest.warns(FutureWarning, match=r"\$FLYWHEEL_DATA is deprecated; set \$FLYWHEEL_DATA_DIR"):
        assert data_dir() == tmp_path / "old"
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path / "new"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert data_dir() == tmp_path / "new"  # the new name wins, and says nothing
        assert data_dir(tmp_path / "given") == tmp_path / "given"


def test_one_cache_variable_for_the_demo_base_and_code_repair(tmp_path, monkeypatch):
    from flywheel.envs.synth_bugs import cache_dir_default

    for name in ("FLYWHEEL_CACHE_DIR", "FLYWHEEL_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert cache_dir() == Path.home() / ".cache" / "flywheel"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "flywheel"
    monkeypatch.setenv("FLYWHEEL_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == cache_dir_default() == tmp_path / "c"
    monkeypatch.delenv("FLYWHEEL_CACHE_DIR")
    monkeypatch.setenv("FLYWHEEL_CACHE", str(tmp_path / "old"))
    with pytest.warns(FutureWarning, match=r"\$FLYWHEEL_CACHE is deprecated; set \$FLYWHEEL_CACHE_DIR"):
        assert cache_dir_default() == tmp_path / "old"
    help_text = CliRunner().invoke(app, ["model", "demo-base", "--help"], env=WIDE).stdout
    assert "$FLYWHEEL_CACHE_DIR" in help_text


def test_the_demo_base_uses_the_same_cache(tmp_path, monkeypatch):
    """A base model already built under $FLYWHEEL_CACHE_DIR is found there, not built again."""
    from flywheel.demo.base import BASE_RECIPE, base_model

    monkeypatch.delenv("FLYWHEEL_CACHE", raising=False)
    monkeypatch.setenv("FLYWHEEL_CACHE_DIR", str(tmp_path / "c"))
    built = tmp_path / "c" / f"demo-base-{BASE_RECIPE.key()}" / "sft" / "final"
    built.mkdir(parents=True)
    (built / "config.json").write_text("{}")
    assert base_model(log=lambda m: pytest.fail(f"built again: {m}")) == built
