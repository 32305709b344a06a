"""Show an EconomicsReport: rich tables in the terminal, PNG files and one self-contained HTML
page (plots embedded as base64 data URIs, inline CSS, no external assets)."""

from __future__ import annotations

import base64
import html
from datetime import datetime, timezone
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table as RichTable

from flywheel.economics.plots import render_all
from flywheel.economics.tables import EconomicsReport, Table

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:72em;color:#222}
h1{font-size:1.5em} h2{font-size:1.15em;margin-top:1.6em}
table{border-collapse:collapse;margin:.5em 0;font-size:.9em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:right}
th{background:#f3f3f3} td:first-child,th:first-child{text-align:left}
.note{color:#555;font-size:.85em;max-width:60em}
.estimate{border-left:4px solid #e69500;padding-left:.8em}
td.text{text-align:left;min-width:24em}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}
figcaption{color:#555;font-size:.85em}
"""


def rich_table(t: Table):
    rt = RichTable(title=t.title, caption=t.note or None, caption_justify="left", title_justify="left",
                   box=box.SIMPLE_HEAD)
    for i, c in enumerate(t.columns):
        rt.add_column(c, justify="left" if i == 0 else "right", overflow="fold", no_wrap=i == 0)
    for row in t.rows:
        rt.add_row(*row)
    return rt


def print_table(t: Table, console=None) -> None:
    """On a terminal, fit its width (cells wrap); elsewhere (pipes, logs) print at full width."""
    console = console or Console()
    rt = rich_table(t)
    if console.is_terminal:
        console.print(rt)
        return
    saved = console.width
    console.width = max(saved, console.measure(rt, options=console.options.update_width(10_000)).maximum)
    try:
        console.print(rt)
    finally:
        console.width = saved


def print_report(report: EconomicsReport, console=None) -> None:
    console = console or Console()
    for line in report.summary_lines():
        console.print(line, highlight=False)
    for t in report.tables():
        console.print()
        print_table(t, console)


def _html_table(t: Table) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in t.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in t.rows)
    cls = ' class="estimate"' if "ESTIMATE" in t.title else ""
    note = f'<p class="note">{html.escape(t.note)}</p>' if t.note else ""
    return f"<section{cls}><h2>{html.escape(t.title)}</h2><table><tr>{head}</tr>{body}</table>{note}</section>"


def html_page(report: EconomicsReport, plots: dict[str, bytes], *, title: str = "flywheel economics report",
              intro_html: str = "") -> str:
    """One self-contained page. `intro_html` (trusted HTML, e.g. the demo's summary and table)
    comes first, under `title`; the economics summary, tables and plots follow."""
    summary = "".join(f"<li>{html.escape(s)}</li>" for s in report.summary_lines())
    tables = "".join(_html_table(t) for t in report.tables())
    imgs = []
    for name, png in plots.items():
        alt = name.removesuffix(".png").replace("_", " ")
        cls = ' class="estimate"' if "estimate" in name else ""
        imgs.append(f'<figure{cls}><img alt="{html.escape(alt)}" '
                    f'src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'
                    f'<figcaption>{html.escape(name)}</figcaption></figure>')
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    econ = "<h2>Economics</h2>" if intro_html else ""
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><p class=\"note\">generated {stamp}</p>{intro_html}{econ}<ul>{summary}</ul>"
            f"{tables}<h2>Plots</h2>{''.join(imgs)}</body></html>\n")


def write_report(report: EconomicsReport, out_dir: str | Path, extra_plots: dict[str, bytes] | None = None, *,
                 title: str = "flywheel economics report", intro_html: str = "") -> dict[str, Path]:
    """Write every plot as PNG and index.html into `out_dir`; returns name -> path.
    `extra_plots` (file name -> PNG bytes, e.g. the demo's families.png) are written and shown
    on the page first, before the report's own plots; `title` and `intro_html` as html_page."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    own = render_all(report)
    clash = sorted(set(own) & set(extra_plots or {}))
    if clash:
        raise ValueError(f"extra_plots {clash} would overwrite the report's own plots of the same name")
    bad = sorted(n for n in (extra_plots or {}) if not n.endswith(".png") or "/" in n or "\\" in n)
    if bad:
        raise ValueError(f"extra_plots names must be plain file names ending in .png, got {bad}")
    plots = {**(extra_plots or {}), **own}
    paths = {}
    for name, png in plots.items():
        (out / name).write_bytes(png)
        paths[name] = out / name
    page = out / "index.html"
    page.write_text(html_page(report, plots, title=title, intro_html=intro_html), encoding="utf-8")
    paths["index.html"] = page
    return paths
