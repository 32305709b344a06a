"""The `flywheel` command line, driven in-process through typer's CliRunner."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from flywheel.cli.main import app
from flywheel.config import SFTConfig

SHAPE = ["--hidden", "64", "--layers", "2", "--heads", "2", "--ffn", "128"]
SAMPLE_LINE = re.compile(r"  \[(\d)\] '.*'  \((\d+) tokens, (length|stop)\)")


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


@pytest.fixture(scope="module")
def tiny(runner, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    result = runner.invoke(app, ["model", "tiny", "--out", str(out), *SHAPE])
    return out, result


def test_model_tiny_writes_a_loadable_folder_and_prints_its_size(tiny):
    from flywheel.models import load

    out, result = tiny
    assert result.exit_code == 0, result.output
    # 103104 parameters for this shape (worked out in test_models.py)
    assert result.stdout == f"wrote {out} (0.10M parameters)\n"
    assert json.loads((out / "flywheel_tiny.json").read_text())["parameters"] == 103104
    model, tok = load(out)
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert tok.encode("hi", add_special_tokens=False) == [104, 105]


def test_model_tiny_with_a_bad_shape_is_a_user_error(runner, tmp_path):
    result = runner.invoke(app, ["model", "tiny", "--out", str(tmp_path / "m"), "--hidden", "30", "--heads", "4"])
    assert result.exit_code == 2
    assert result.stderr == "error: hidden (30) must be divisible by heads (4)\n"


def generate(runner, folder, *extra):
    return runner.invoke(app, ["generate", "--model", str(folder), "-p", "hi", "-p", "2+2=",
                               "-n", "2", "--max-tokens", "5", *extra])


def test_generate_prints_n_samples_per_prompt(runner, tiny):
    folder, _ = tiny
    result = generate(runner, folder, "--seed", "1")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 6
    assert lines[0] == "prompt: 'hi'" and lines[3] == "prompt: '2+2='"
    for k, line in enumerate(lines[1:3] + lines[4:6]):
        m = SAMPLE_LINE.fullmatch(line)
        assert m, line
        assert int(m.group(1)) == k % 2
        n_tokens = int(m.group(2))
        assert 1 <= n_tokens <= 5
        assert (m.group(3) == "length") == (n_tokens == 5)  # fewer than 5 only if it stopped
    assert generate(runner, folder, "--seed", "1").stdout == result.stdout  # seeded: reproducible


def test_generate_from_a_missing_model_is_a_user_error(runner, tmp_path):
    result = runner.invoke(app, ["generate", "--model", str(tmp_path / "nope"), "-p", "hi"])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: model path {str(tmp_path / 'nope')!r} does not exist")


def test_sft_with_an_unknown_key_exits_2_and_names_the_valid_keys(runner, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model: runs/tiny\ndata:\n  train: [a.jsonl]\nbogus: 1\n")
    result = runner.invoke(app, ["sft", str(config)])
    assert result.exit_code == 2
    valid = ", ".join(sorted(SFTConfig.model_fields))
    assert result.stderr == (f"error: {config}: invalid SFTConfig:\n"
                             f"  bogus: unknown key; valid keys here are: {valid}\n")


def test_sft_with_an_unknown_override_exits_2(runner, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model: runs/tiny\ndata:\n  train: [a.jsonl]\n")
    result = runner.invoke(app, ["sft", str(config), "train.steps=3", "train.stepz=3"])
    assert result.exit_code == 2
    assert ("  train.stepz: unknown key; valid keys here are: "
            "activation_checkpointing, batch_size, dropout, epochs, lora, micro_batch_size, seed, steps, strategy, "
            "world_size\n") in result.stderr
    assert "Traceback" not in result.output and result.stdout == ""


def test_help_lists_the_commands(runner):
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    listed = set(re.findall(r"│ (\w+)\s{2,}", result.output)) or set(result.output.split())
    assert {"model", "generate", "sft"} <= listed
    model_help = runner.invoke(app, ["model", "--help"])
    assert model_help.exit_code == 0 and "tiny" in model_help.output


@pytest.mark.parametrize("columns", [60, 200])
def test_help_reads_as_paragraphs_at_any_width(runner, columns):
    """Docstrings wrapped at 100 columns used to keep their breaks: "curates its" / "failures"."""
    result = runner.invoke(app, ["--help"], env={"COLUMNS": str(columns), "TERMINAL_WIDTH": str(columns)})
    text = " ".join(line.strip("│ ").strip() for line in result.output.splitlines())
    assert "curates its failures, trains, gates and promotes." in re.sub(r"\s+", " ", text)
    if columns == 200:  # wide enough: each command's description is one line
        assert re.search(r"│ demo\s+A simulated production world .* the `demo:` line\.\s+│", result.output)


def test_paragraphs_joins_lines_and_keeps_items():
    from flywheel.cli.help import paragraphs

    assert paragraphs("""a b
        c

        d
        - e
        - f""") == "a b c\n\nd\n- e\n- f"


def test_serve_refuses_a_negative_number_of_ingestion_workers(runner, tiny):
    out, _ = tiny
    result = runner.invoke(app, ["serve", "--model", str(out), "--ingest-workers", "-1"])
    assert result.exit_code == 2 and "--ingest-workers" in result.output
