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
