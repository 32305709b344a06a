"""The demo's per-day table (markdown, printed unwrapped and written next to the plots; the same
cells make the report page's table) and its family plot."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

TABLE_FILE = "demo-table.md"  # in the report folder, linked from index.html


def pct(x: float | None) -> str:
    """0.873 -> '87%'; None -> '-'."""
    return "-" if x is None else f"{100 * x:.0f}%"


def day_table(rows: Sequence) -> tuple[list[str], list[list[str]]]:
    """(header, cells): one line per day: traffic and failure rate per family (as served that
    day), the cycle that followed, its outcome and the gate's deciding reason, its cost,
    new-failure score incumbent -> candidate, the production model's suite scores after it, its
    final-test scores (demo/final_test.py: never used for a decision), intelligence per dollar
    (final-test points / $ of a promoting cycle) and serving cost per 1M tokens."""
    families = list(dict.fromkeys(f for r in rows for f in r.episodes))
    suites = list(dict.fromkeys(f for r in rows for f in r.production))
    finals = list(dict.fromkeys(f for r in rows for f in r.final))
    head = (["week", "day", "served", "traffic"] + [f"{f} failed" for f in families]
            + ["cycle", "outcome", "why", "cost $", "new failures"] + [f"{s} gate suite" for s in suites]
            + [f"{f} final test" for f in finals] + ["final points/$", "serve $/1M tok"])
    cells = []
    for r in rows:
        fails = [pct(r.failures[f] / r.episodes[f]) if r.episodes.get(f) else "-" for f in families]
        new = f"{pct(r.new_before)} -> {pct(r.new_after)}" if r.new_before is not None else "-"
        cells.append([str(r.week), str(r.day), r.served, str(sum(r.episodes.values()))] + fails
                     + [r.cycle or "-", r.outcome, r.why, f"{r.usd:.4f}", new]
                     + [pct(r.production.get(s)) for s in suites] + [pct(r.final.get(f)) for f in finals]
                     + ["-" if r.ipd is None else f"{r.ipd:,.0f}",
                        "-" if r.serve_usd_per_m is None else f"{r.serve_usd_per_m:.3f}"])
    return head, cells


def markdown_table(rows: Sequence) -> str:
    """day_table as a markdown table, one line per day however long ('|' in a cell becomes '/')."""
    head, cells = day_table(rows)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells]
    return "\n".join(lines)


def write_table(table: str, folder: Path, console) -> Path:
    """Write `table` to folder/demo-table.md and print it without wrapping a line (and without
    reading rich markup in it: a gate reason holds brackets)."""
    path = Path(folder) / TABLE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table + "\n", encoding="utf-8")
    console.print(table, soft_wrap=True, markup=False, highlight=False, crop=False)
    return path


def family_plot(rows: Sequence) -> bytes:
    """PNG of family_figure."""
    from flywheel.economics.plots import png

    return png(family_figure(rows))


def family_figure(rows: Sequence):
    """The production model's success per family after each day's cycle (a matplotlib Figure);
    the legend sits under the axes, where it covers no data."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.8))
    ax = fig.subplots()
    labels = [f"w{r.week}d{r.day}" for r in rows]
    for fam in dict.fromkeys(f for r in rows for f in r.production):
        line, = ax.plot(labels, [100 * r.production.get(fam, float("nan")) for r in rows], marker="o",
                        label=f"{fam} (gate suite)")
        if any(fam in r.final for r in rows):
            ax.plot(labels, [100 * r.final.get(fam, float("nan")) for r in rows], ls="--", marker="x",
                    color=line.get_color(), label=f"{fam} (final test)")
    for i, r in enumerate(rows):
        if r.outcome == "promoted":
            ax.axvline(i, color="grey", alpha=0.2, lw=6)
    ax.set_ylim(-3, 103)
    ax.set_xlabel("day (w = week, d = day); grey: the day's cycle promoted")
    ax.set_ylabel("held-out success of production, %")
    ax.set_title("flywheel demo: each family's success after each day's cycle")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize="small", frameon=False)
    return fig
