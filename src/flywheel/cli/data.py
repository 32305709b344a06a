"""`flywheel data ...`: generate task data sets locally."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(help="Generate task data sets.", no_args_is_help=True)


@app.command("arithmetic")
def arithmetic(out: Path = typer.Option(..., "--out", help="folder for the JSONL files")) -> None:
    """The shared `ab+cd=` task as prompt/completion JSONL: 9,800 train rows and the 200 held-out pairs."""
    from flywheel.envs.arithmetic import split_pairs, write_sft_jsonl

    train, heldout = split_pairs()
    a = write_sft_jsonl(out / "arithmetic_train.jsonl", train)
    b = write_sft_jsonl(out / "arithmetic_heldout.jsonl", heldout)
    typer.echo(f"wrote {a} ({len(train)} rows) and {b} ({len(heldout)} rows)")
