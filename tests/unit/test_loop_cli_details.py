"""Small things a loop user sees: registry scores printed compactly, overrides named in --help."""

from typer.testing import CliRunner

from flywheel.cli.main import app
from flywheel.cli.registry import _compact


def test_eval_scores_print_flat_with_four_significant_digits():
    scores = {"arith": {"incumbent": 0.12345678901234567, "candidate": 0.5}, "new_failures": 0.3333333333333333,
              "empty": {}, "tasks": 40}
    assert _compact(scores) == ("arith.incumbent=0.1235, arith.candidate=0.5, new_failures=0.3333, "
                                "empty=-, tasks=40")
    assert _compact({}) == "-"


def test_loop_commands_say_they_take_dotted_overrides():
    for command in ("run", "cycle"):
        out = CliRunner().invoke(app, ["loop", command, "--help"], terminal_width=200).stdout
        assert "dotted overrides" in out, out


def test_loop_status_reads_the_data_dir_of_its_config(tmp_path):
    config = tmp_path / "loop.yaml"
    config.write_text(f"data_dir: {tmp_path / 'elsewhere'}\n")
    out = CliRunner().invoke(app, ["loop", "status", str(config)])
    assert out.exit_code == 0, out.output
    assert f"daemon: never ran with data_dir {tmp_path / 'elsewhere'}" in out.stdout


def test_loop_status_shows_what_curation_dropped_and_the_cycles_warnings(tmp_path):
    import dataclasses
    import json

    from flywheel.loop.curation import CurationReport, dropped_summary
    from flywheel.loop.cycle import CycleState

    report = CurationReport()
    for i, why in enumerate(["verifier task: missing field 'prompt'"] * 2 + ["no prompt before the response"]):
        report.drop(f"t{i}", "rl", why)
    assert dropped_summary(report.to_dict()) == ("3 records dropped: 2 rl: verifier task: missing field 'prompt'; "
                                                 "1 rl: no prompt before the response")
    assert dropped_summary(report.to_dict(), limit=1).endswith("missing field 'prompt'; ...")
    assert dropped_summary(CurationReport().to_dict()) is None
    st = CycleState(id="c1", stage="finished", started_at="2026-12-02T00:00:00", incumbent="v1", incumbent_path="m",
                    trace_cursor=3, since_cursor=0, curation=report.to_dict(), outcome="nothing to train",
                    warnings=["suite 'arith' is played as completion but production is called as chat"])
    (tmp_path / "cycles" / "c1").mkdir(parents=True)
    (tmp_path / "cycles" / "c1" / "state.json").write_text(json.dumps(dataclasses.asdict(st)))
    out = CliRunner().invoke(app, ["loop", "status", "--data-dir", str(tmp_path)], terminal_width=200).stdout
    assert "3 records dropped: 2 rl: verifier task: missing field 'prompt'" in out, out
    assert "warning: suite 'arith' is played as completion" in out
    data = json.loads(CliRunner().invoke(app, ["loop", "status", "--data-dir", str(tmp_path), "--json"]).stdout)
    assert data["cycles"][0]["dropped"].startswith("3 records dropped") and len(data["cycles"][0]["warnings"]) == 1


def test_registry_commands_take_the_loops_data_dir_and_errors_name_the_registry(tmp_path, monkeypatch):
    from flywheel.models import TinySpec, build_tiny_model

    monkeypatch.chdir(tmp_path)  # the default registry (./flywheel-data) must stay untouched
    model = build_tiny_model(tmp_path / "m", TinySpec(hidden=16, layers=1, heads=2, ffn=32))
    data = tmp_path / "loop-data"
    run = lambda *args: CliRunner().invoke(app, ["registry", *args], terminal_width=200)
    assert run("register", str(model), "--data-dir", str(data)).exit_code == 0
    assert run("promote", "v1", "--data-dir", str(data)).stdout.startswith("promoted v1 to production")
    assert "* v1" in " ".join(run("list", "--data-dir", str(data)).stdout.split())
    assert not (tmp_path / "flywheel-data").exists()
    missing = run("promote", "v9", "--data-dir", str(data))
    assert missing.exit_code == 2 and f"(registry {(data / 'registry').resolve()})" in missing.stderr, missing.stderr
    both = run("list", "--data-dir", str(data), "--registry", str(data / "registry"))
    assert both.exit_code == 2 and "--registry or --data-dir, not both" in both.stderr


def test_loop_run_refusals_are_one_line_naming_the_path(tmp_path):
    """Nothing in production, or anchor data that is not SFT rows: exit 2 and one line, no traceback."""
    config = tmp_path / "loop.yaml"
    config.write_text(f"data_dir: {tmp_path / 'data'}\nserve: {{port: 0}}\n")
    out = CliRunner().invoke(app, ["loop", "run", str(config)])
    assert out.exit_code == 2 and "Traceback" not in out.output, out.output
    assert f"no production model in the registry {(tmp_path / 'data' / 'registry').resolve()}" in out.stderr
    anchor = tmp_path / "anchor.jsonl"
    anchor.write_text('{"prompt": "1+1=", "completion": "2"}\n{"oops": 1}\n')
    out = CliRunner().invoke(app, ["loop", "run", str(config), f"train.anchor_data=[{anchor}]"])
    assert out.exit_code == 2 and f"error: train.anchor_data: {anchor}:2 is not an SFT row" in out.stderr, out.output
