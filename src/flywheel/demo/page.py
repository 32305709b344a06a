"""The top of the demo's report page (report/index.html): what the demo did and found, the
per-day table with each cycle's outcome and the gate's reason, and a link to demo-table.md.
The economics report (economics/render.py) follows it on the same page."""

from __future__ import annotations

import html
import math
from typing import Any, Sequence

from flywheel.demo.report import TABLE_FILE, day_table, pct
from flywheel.demo.summary import took_line

TITLE = "flywheel demo report"
EVAL_NAME = "final test (mean over families)"  # what the economics report's points are measured on


def _figure(x: float, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def summary_items(s: dict[str, Any]) -> list[str]:
    """The demo's figures as plain sentences (the summary dict of demo/summary.py)."""
    fams = s["per_family"]
    return [
        took_line(s) + ".",
        f"{s['cycles']} cycles, {s['promoted']} promoted; the gate decides on each family's gate suite, and the "
        "final test (never used for a decision) checks what users gained.",
        "Gate suites, start -> end: " + ", ".join(f"{k} {pct(v['start'])} -> {pct(v['end'])}" for k, v in fams.items())
        + ".",
        "Final test, start -> end: " + ", ".join(
            f"{k} {pct(v['final_start'])} -> {pct(v['final_end'])}" for k, v in fams.items()) + ".",
        f"Families that arrived after week 1, on the final test: {_figure(s['final_new_family_before'], '.0%')} when "
        f"they arrived, {_figure(s['final_new_family_after'], '.0%')} after their third cycle; the week-1 family "
        f"moved {_figure(s['final_old_delta'], '+.1f')} points.",
        f"Intelligence per dollar: {_figure(s['final_points'], '+.1f')} final-test points (mean over families) for "
        f"${s['usd']:.4f} of cycles = {_figure(s['points_per_usd'], ',.0f')} points per dollar. The total cost below "
        "is higher: it also counts serving the traffic and scoring the base model before week 1, which are "
        "production's cost, not the cycles'.",
    ]


def _table_html(rows: Sequence) -> str:
    head, cells = day_table(rows)
    text = {head.index(c) for c in ("outcome", "why")}  # left-aligned prose
    th = "".join(f"<th>{html.escape(c)}</th>" for c in head)
    cls = ' class="text"'
    body = "".join("<tr>" + "".join(f"<td{cls if i in text else ''}>{html.escape(v)}</td>"
                                    for i, v in enumerate(row)) + "</tr>" for row in cells)
    return f"<table><tr>{th}</tr>{body}</table>"


def demo_html(summary: dict[str, Any], rows: Sequence) -> str:
    """HTML for the page's top: the summary, the per-day table, the link to demo-table.md."""
    items = "".join(f"<li>{html.escape(s)}</li>" for s in summary_items(summary))
    return (f"<h2>Summary</h2><ul>{items}</ul>"
            "<h2>Day by day</h2>"
            '<p class="note">After each day\'s traffic a cycle trains a candidate; the gate promotes it or not '
            "(why: the gate's deciding reason). Failure rates are the served model's on the day's traffic; "
            "gate suite and final test: production after the day's cycle. The same table as markdown: "
            f'<a href="{TABLE_FILE}">{TABLE_FILE}</a>.</p>'
            f"{_table_html(rows)}")
