"""Help text that reads as paragraphs at any terminal width.

typer's command list keeps a docstring's hard line breaks, so a docstring wrapped at 100
columns shows as broken lines in an 80-column panel ("curates its" / "failures, ..."). Every
command's help is its docstring with each paragraph joined onto one line (a line that starts a
"- " item keeps its break); the terminal does the wrapping."""

from __future__ import annotations

import inspect

import typer


def paragraphs(text: str) -> str:
    """'a b\\nc\\n\\nd\\n- e\\n- f' -> 'a b c\\n\\nd\\n- e\\n- f'."""
    out = []
    for block in inspect.cleandoc(text).split("\n\n"):
        lines = [line.strip() for line in block.splitlines() if line.strip()]
        joined = ""
        for line in lines:
            joined += ("\n" if line.startswith("- ") else " ") + line if joined else line
        out.append(joined)
    return "\n\n".join(out)


def reflow_help(app: typer.Typer) -> typer.Typer:
    """Set every command's and group's help in `app`'s tree to its reflowed text; returns app."""
    if app.info.help:
        app.info.help = paragraphs(app.info.help)
    for cmd in app.registered_commands:
        text = cmd.help or inspect.getdoc(cmd.callback) or ""
        if text:
            cmd.help = paragraphs(text)
    for group in app.registered_groups:
        reflow_help(group.typer_instance)
    return app
