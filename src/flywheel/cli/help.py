"""Help text that reads well: paragraphs at any terminal width, and no type on a flag.

typer's command list keeps a docstring's hard line breaks, so a docstring wrapped at 100
columns shows as broken lines in an 80-column panel ("curates its" / "failures, ..."). Every
command's help is its docstring with each paragraph joined onto one line (a line that starts a
"- " item keeps its break); the terminal does the wrapping.

typer 0.29's rich help prints every option's type, `--wait <bool>` and `--help <bool>`
included, though a flag takes no value (its plain-text help already leaves flags out:
TyperOption.get_help_record). Every command and group of the tree gets a class whose flags
show an empty type (metavar ""), the rest unchanged."""

from __future__ import annotations

import inspect

import typer
from typer.core import TyperCommand, TyperGroup


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


def _untyped_flags(params: list) -> list:
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""  # what TyperOption.display_type_rich shows instead of "<bool>"
    return params


class Command(TyperCommand):
    def format_help(self, ctx, formatter) -> None:
        _untyped_flags(self.get_params(ctx))
        super().format_help(ctx, formatter)


class Group(TyperGroup):
    def format_help(self, ctx, formatter) -> None:
        _untyped_flags(self.get_params(ctx))
        super().format_help(ctx, formatter)


def reflow_help(app: typer.Typer) -> typer.Typer:
    """Set every command's and group's help in `app`'s tree to its reflowed text, and its class
    to one whose help shows flags without a type; returns app."""
    if app.info.help:
        app.info.help = paragraphs(app.info.help)
    if app.info.cls in (None, TyperGroup) or not isinstance(app.info.cls, type):
        app.info.cls = Group
    for cmd in app.registered_commands:
        text = cmd.help or inspect.getdoc(cmd.callback) or ""
        if text:
            cmd.help = paragraphs(text)
        if cmd.cls in (None, TyperCommand):
            cmd.cls = Command
    for group in app.registered_groups:
        reflow_help(group.typer_instance)
    return app
